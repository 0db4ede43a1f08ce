"""Weight-only quantized GEMMs in Triton: ``y = x wᵀ (+ b)`` with ``w`` dequantized tile by tile in registers,
never widened in memory. The GPU counterpart of :mod:`.cpu_quant_linear`, over the same packed layouts:

* :func:`int_linear_triton`: integer weights packed along the inputs into int32 words (value ``j`` of a word in
  bits ``bits*j ...``, lowest first; compressed-tensors' ``pack_to_int32`` layout), stored with an offset of
  ``2^(bits-1)``, one float32 scale per output row and group of ``group`` consecutive inputs, and optionally one
  float32 additive term per (row, group): ``w[n, k] = (u[n, k] - 2^(bits-1)) * scale[n, k // group]
  (+ zero[n, k // group])``; with ``round_bf16`` the weight is rounded to bfloat16 before the product
  (compressed-tensors' decompression to a bfloat16 model). ``bits`` is 4 or 8.
* :func:`fp8_linear_triton`: float8_e4m3fn bytes ``[N, K]`` (held as uint8) with one float32 scale per output row
  and group of ``group`` inputs: ``w[n, k] = fp8(q[n, k]) * scale[n, k // group]``. The bytes are decoded with
  integer arithmetic (exact; no fp8 hardware needed).

One kernel runs both: program ``(i, j)`` computes the ``BLOCK_M x BLOCK_N`` output tile ``(i, j)`` over all of
``K`` (no split-K, no atomics: each output element is written once), each ``BLOCK_K`` slice of the weights
decoded by the format's ``@helper`` (``_int_tile``, ``_fp8_tile``). Accumulation is float32. With float32 inputs the products are
exact float32 (``input_precision="ieee"``), so the result equals ``x @ dense_weightᵀ`` up to summation order;
16-bit inputs multiply the weight tile rounded to the input's dtype on the tensor cores. Both run compiled on
CUDA tensors and interpreted on CPU tensors (:mod:`._jit`), which is how the CPU test suite holds them to their
float64 references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._jit import helper, interpreting, kernel


@helper
def _int_tile(w_rows, s_ptr, z_ptr, s_rows, k, mask, GROUP: tl.constexpr, BITS: tl.constexpr,
              PER_WORD: tl.constexpr, MASK: tl.constexpr, OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
              ROUND_BF16: tl.constexpr):  # fmt: skip
    """The float32 weights ``[BLOCK_K, BLOCK_N]`` of inputs ``k`` from packed integer words."""
    words = tl.load(w_rows + (k // PER_WORD)[:, None], mask=mask, other=0)
    u = (words >> ((k % PER_WORD) * BITS)[:, None]) & MASK  # arithmetic shift: the mask keeps the value
    g = s_rows + (k // GROUP)[:, None]
    w = (u - OFFSET).to(tl.float32) * tl.load(s_ptr + g, mask=mask, other=0.0)
    if HAS_ZERO:
        w += tl.load(z_ptr + g, mask=mask, other=0.0)
    if ROUND_BF16:  # to the nearest bfloat16, ties to even, in integer bits (the interpreter's cast is wrong)
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        w = bits.to(tl.float32, bitcast=True)
    return w


@helper
def _fp8_tile(w_rows, s_ptr, s_rows, k, mask, GROUP: tl.constexpr):
    """The float32 weights ``[BLOCK_K, BLOCK_N]`` of inputs ``k`` from e4m3fn bytes: sign, 4 exponent bits (bias
    7), 3 mantissa bits; no infinities, 0x7f / 0xff are NaN."""
    b = tl.load(w_rows + k[:, None], mask=mask, other=0).to(tl.int32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = ((exp + 120) << 23) | (man << 20)  # the same value's float32 bits
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    mag = tl.where((b & 127) == 127, float("nan"), mag)
    sign = tl.where((b & 128) != 0, -1.0, 1.0)
    return sign * mag * tl.load(s_ptr + s_rows + (k // GROUP)[:, None], mask=mask, other=0.0)


@kernel
def _linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    stride_y,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER_WORD: tl.constexpr,
    MASK: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_w
    s_rows = rn.to(tl.int64)[None, :] * stride_s
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        mask = k_ok[:, None] & n_ok[None, :]
        if FP8:
            w = _fp8_tile(w_rows, s_ptr, s_rows, k, mask, GROUP)
        else:
            w = _int_tile(w_rows, s_ptr, z_ptr, s_rows, k, mask, GROUP, BITS, PER_WORD, MASK, OFFSET, HAS_ZERO,
                          ROUND_BF16)  # fmt: skip
        if FP32_DOT:
            acc += tl.dot(xt.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(xt, w.to(xt.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _blocks(m: int, n: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode batches are a few rows, prefill many; ``tl.dot`` needs 16 or more.
    The interpreter runs whole tiles as numpy arrays, so larger tiles are cheaper there."""
    if interpreting(device):
        return max(16, min(64, triton.next_power_of_2(m))), 64, 64
    return max(16, min(64, triton.next_power_of_2(m))), 64 if n >= 4096 else 32, 64


def _launch(x: Tensor, weight: Tensor, scales: Tensor, zero: Tensor | None, bias: Tensor | None,
            out: Tensor | None, k: int, fmt: dict) -> Tensor:  # fmt: skip
    """``x [..., k] @ wᵀ (+ bias)`` by :func:`_linear_kernel` with the format's constexprs `fmt`: returns
    ``[..., N]`` in `x`'s dtype, or writes ``out`` (``[M, N]``, unit stride along N). The interpreter computes and
    casts 16-bit values wrongly, so there a 16-bit `x` is multiplied in float32 and the result cast by torch."""
    if interpreting(x.device) and x.dtype in (torch.bfloat16, torch.float16):
        y = _launch(x.float(), weight, scales, zero, bias, None, k, fmt)
        return y.to(x.dtype) if out is None else out.copy_(y.reshape(out.shape))
    assert x.shape[-1] == k
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if out is None:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        result = y.view(*x.shape[:-1], n)
    else:
        assert out.shape == (m, n) and out.stride(-1) == 1
        y = result = out
    if m == 0:
        return result
    bm, bn, bk = _blocks(m, n, x.device)
    scales = scales.contiguous()
    if zero is not None:
        zero = zero.contiguous()
        assert zero.shape == scales.shape
    _linear_kernel.on(x.device)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        rows, weight, scales, scales if zero is None else zero, scales if bias is None else bias, y,
        m, n, k, rows.stride(0), weight.stride(0), scales.stride(0), y.stride(0),
        HAS_ZERO=zero is not None, HAS_BIAS=bias is not None, FP32_DOT=x.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **fmt,
    )  # fmt: skip
    return result


def int_linear_triton(
    x: Tensor,
    packed: Tensor,
    bits: int,
    scales: Tensor,
    group: int,
    bias: Tensor | None = None,
    zero: Tensor | None = None,
    round_bf16: bool = False,
    out: Tensor | None = None,
) -> Tensor:
    """``x [..., K] @ wᵀ (+ bias)`` for packed integer weights (module docstring): `packed` ``[N, K * bits / 32]``
    int32, `scales` (and `zero`) ``[N, K / group]`` float32. Returns ``[..., N]`` in `x`'s dtype, or writes
    ``out`` (``[M, N]``, unit stride along N, e.g. a column slice of a fused projection's output)."""
    assert bits in (4, 8) and packed.dtype == torch.int32
    per = 32 // bits
    n, k = packed.shape[0], packed.shape[1] * per
    assert k % group == 0 and scales.shape == (n, k // group)
    fmt = dict(FP8=False, GROUP=group, BITS=bits, PER_WORD=per, MASK=(1 << bits) - 1, OFFSET=1 << (bits - 1),
               ROUND_BF16=round_bf16)  # fmt: skip
    return _launch(x, packed, scales, zero, bias, out, k, fmt)


def fp8_linear_triton(
    x: Tensor,
    weight: Tensor,
    scales: Tensor,
    group: int,
    bias: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``x [..., K] @ wᵀ (+ bias)`` for fp8 e4m3fn weights (module docstring): `weight` ``[N, K]`` uint8 (the fp8
    bytes), `scales` ``[N, ceil(K / group)]`` float32. Returns ``[..., N]`` in `x`'s dtype, or writes ``out``."""
    assert weight.dtype == torch.uint8 and weight.stride(-1) == 1
    n, k = weight.shape
    assert scales.shape == (n, -(-k // group))
    fmt = dict(FP8=True, GROUP=group, BITS=8, PER_WORD=1, MASK=255, OFFSET=0, ROUND_BF16=False)
    return _launch(x, weight, scales, None, bias, out, k, fmt)
