"""Triton batched LoRA (semantics: :mod:`.lora`): a shrink and an expand kernel over a :class:`~.lora.LoRAPlan`.

Program ``(m, j)`` of either kernel works on block ``m`` of the plan: up to ``BLOCK_M`` tokens
(``order[block_start[m]:block_end[m]]``) that all use slot ``block_slot[m]``, so each program multiplies one
token tile by one adapter's factors (a segmented GEMM, no per-token gather of weights).

* shrink: ``h[rows, j-th tile of P * R] = x[tokens] @ A[slot].view(P * R, in)^T`` — every part at once; the
  zero-padded ranks give zero columns. ``h`` is kept in plan order (``[len(order), P * R]``, float32).
* expand, once per part ``i``: ``y[tokens, offsets[i] + n] += (h[rows, i*R:(i+1)*R] @ B_i[slot]^T) * scale``
  for the ``j``-th tile of ``n``. Each ``(token, column)`` belongs to exactly one program: no atomics.

Accumulation is float32; the delta is cast to ``y``'s dtype when added. With float32 ``x`` or ``y`` the products
are exact float32 (``input_precision="ieee"``), never the tensor cores' tf32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._jit import interpreting, kernel
from .lora import BLOCK_M, LoRAPlan, LoRAWeights


@kernel
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    order_ptr,
    block_slot_ptr,
    block_start_ptr,
    block_end_ptr,
    in_features,
    total_rank,
    stride_x,
    stride_a_slot,
    stride_h,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    m = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(block_slot_ptr + m).to(tl.int64)
    start = tl.load(block_start_ptr + m)
    end = tl.load(block_end_ptr + m)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    r = j * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < total_rank
    acc = tl.full([BLOCK_M, BLOCK_R], 0.0, tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        xt = tl.load(
            x_ptr + tokens[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        at = tl.load(
            a_ptr + slot * stride_a_slot + r[None, :] * in_features + k[:, None],
            mask=r_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32))
    tl.store(
        h_ptr + rows[:, None].to(tl.int64) * stride_h + r[None, :], acc, mask=row_ok[:, None] & r_ok[None, :]
    )


@kernel
def _expand_kernel(
    h_ptr,
    b_ptr,
    scale_ptr,
    y_ptr,
    order_ptr,
    block_slot_ptr,
    block_start_ptr,
    block_end_ptr,
    rank,
    part,
    num_parts,
    out_features,
    offset,
    stride_h,
    stride_b_slot,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    m = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(block_slot_ptr + m).to(tl.int64)
    start = tl.load(block_start_ptr + m)
    end = tl.load(block_end_ptr + m)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    ht = tl.load(
        h_ptr + rows[:, None].to(tl.int64) * stride_h + part * rank + r[None, :],
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    bt = tl.load(
        b_ptr + slot * stride_b_slot + n[None, :] * rank + r[:, None],
        mask=r_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        delta = tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
    else:
        delta = tl.dot(ht, bt.to(tl.float32))
    scale = tl.load(scale_ptr + slot * num_parts + part)
    delta = delta * scale
    mask = row_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + tokens[:, None] * stride_y + offset + n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora_triton(y: Tensor, x: Tensor, plan: LoRAPlan, w: LoRAWeights) -> Tensor:
    """``y [T, out]`` += each token's adapter delta (:mod:`.lora`), in place; returns ``y``. ``x`` and ``y``
    rows must be contiguous (stride 1 along features)."""
    if plan.empty:
        return y
    assert x.stride(1) == 1 and y.stride(1) == 1
    device = x.device
    num_parts, rank, in_features = w.a.shape[1:]
    total_rank = num_parts * rank
    nrows = plan.order.shape[0]
    nblocks = plan.block_slot.shape[0]
    h = torch.empty(nrows, total_rank, dtype=torch.float32, device=device)
    a = w.a.contiguous()
    block_r = max(16, triton.next_power_of_2(min(total_rank, 64)))
    block_k = max(16, min(64, triton.next_power_of_2(in_features)))
    grid = (nblocks, triton.cdiv(total_rank, block_r))
    meta = (plan.order, plan.block_slot, plan.block_start, plan.block_end)
    # A float32 model's products are exact float32 (FMA units); 16-bit inputs are exact in the tensor cores'
    # default tf32 inputs, so they keep the fast path.
    fp32_dot = x.dtype == torch.float32 or y.dtype == torch.float32
    if interpreting(device) and x.dtype == torch.bfloat16:  # the interpreter computes bfloat16 wrongly
        x = x.float()
    _shrink_kernel.on(device)[grid](
        x, a, h, *meta, in_features, total_rank, x.stride(0), a.stride(0), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k, FP32_DOT=fp32_dot,
    )  # fmt: skip
    block_rank = max(16, triton.next_power_of_2(rank))
    for part, (offset, size) in enumerate(zip(w.offsets, w.sizes)):
        b = w.b[part].contiguous()
        block_n = max(16, min(64, triton.next_power_of_2(size)))
        grid = (nblocks, triton.cdiv(size, block_n))
        _expand_kernel.on(device)[grid](
            h, b, w.scale, y, *meta, rank, part, num_parts, size, offset, h.stride(0), b.stride(0), y.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_R=block_rank, BLOCK_N=block_n, FP32_DOT=fp32_dot,
        )  # fmt: skip
    return y
