"""The pieces the paged attention kernels share (decode, decode split-K, prefill): ``@triton.jit`` device
functions, inlined by the compiler, called as Python functions by the interpreter (see :func:`._jit.helper`).

Every attention kernel walks a sequence's keys in tiles of ``BLOCK_N`` positions: :func:`load_kv_tile` reads a
tile of K and V through the block table, :func:`tile_scores` turns it into base-2 logits (soft-capped if asked),
and :func:`online_softmax` folds it into the running max ``m``, sum ``l`` and output accumulator ``acc`` (the
flash attention recurrence, float32, ``exp2`` with ``log2 e`` folded into ``qk_scale``); :func:`add_sink` adds
an attention sink at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton.language as tl
from torch import Tensor

from ._jit import helper
from .options import AttentionOptions
from .paged_kv import PagedKV

LOG2E = 1.4426950408889634


@dataclass
class OptionArgs:
    """An :class:`.options.AttentionOptions` as kernel arguments (host side): ``qk_scale``, ``softcap``, ``window`` and
    ``sinks`` (a float32 ``[Hq]`` tensor of base-2 sink logits, or a placeholder pointer) for the kernel's
    runtime parameters, and ``WINDOW`` / ``SOFTCAP`` / ``SINKS`` for its constexpr switches."""

    qk_scale: float
    softcap: float
    window: int
    sinks: Tensor
    WINDOW: bool
    SOFTCAP: bool
    SINKS: bool

    @classmethod
    def make(cls, options: AttentionOptions, like: Tensor) -> OptionArgs:
        scale, sliding_window, softcap, sinks = (
            options.scale, options.sliding_window, options.softcap, options.sinks
        )  # fmt: skip
        if sinks is not None:
            sinks = (sinks.to(device=like.device, dtype=torch.float32) * LOG2E).contiguous()
        return cls(
            qk_scale=scale * LOG2E if softcap is None else scale / softcap,
            softcap=0.0 if softcap is None else softcap * LOG2E,
            window=0 if sliding_window is None else int(sliding_window),
            sinks=like if sinks is None else sinks,
            WINDOW=sliding_window is not None,
            SOFTCAP=softcap is not None,
            SINKS=sinks is not None,
        )

    @property
    def constexprs(self) -> dict[str, bool]:
        return dict(WINDOW=self.WINDOW, SOFTCAP=self.SOFTCAP, SINKS=self.SINKS)


def paged_inputs(q: Tensor, kv: PagedKV) -> tuple[Tensor, PagedKV, int]:
    """Check the caches (contiguous, same shape ``[NB, BS, Hkv, D]``, ``Hkv`` dividing ``Hq``) and return
    ``(q, kv, group)`` with ``q`` and ``kv.block_tables`` unit-stride in their last dimension, as the kernels
    index them."""
    assert kv.k_cache.is_contiguous() and kv.v_cache.is_contiguous() and kv.k_cache.shape == kv.v_cache.shape
    assert q.shape[1] % kv.num_kv_heads == 0
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.block_tables.stride(-1) != 1:
        kv = replace(kv, block_tables=kv.block_tables.contiguous())
    return q, kv, q.shape[1] // kv.num_kv_heads


@helper
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    k_pos,
    kv_mask,
    d,
    d_mask,
    kvh,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K (transposed, ``[BLOCK_D, BLOCK_N]``) and V (``[BLOCK_N, BLOCK_D]``) of kv head ``kvh`` at positions
    ``k_pos [BLOCK_N]`` of the sequence whose block-table row starts at ``bt_row``.

    With ``MASKED``, positions where ``kv_mask`` is false read nothing, not even their block-table entry (they
    load as 0); without (``kv_mask`` is then ignored), every position must be a real token of the sequence.
    """
    if MASKED:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
    row = blk * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_tok + kvh * stride_cache_head
    if MASKED:
        k = tl.load(
            k_cache_ptr + row[None, :] + d[:, None], mask=kv_mask[None, :] & d_mask[:, None], other=0.0
        )
        v = tl.load(
            v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask[:, None] & d_mask[None, :], other=0.0
        )
    else:
        k = tl.load(k_cache_ptr + row[None, :] + d[:, None], mask=d_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
    return k, v


@helper
def tile_scores(q, k, qk_scale, softcap, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Base-2 logits of a ``[M, D]`` query tile against a transposed ``[D, N]`` key tile, float32: ``q @ k *
    qk_scale`` with ``qk_scale = scale * log2 e``; with ``SOFTCAP``, ``qk_scale = scale / cap`` and ``softcap =
    cap * log2 e``, giving ``cap * tanh(scale * q·k / cap) * log2 e``.

    ``FP32_DOT``: an exact float32 product, for float32 or mixed-dtype inputs and the interpreter; else the
    tensor cores' product of the input dtype, accumulated in float32.
    """
    if FP32_DOT:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (e^(2x) + 1): saturates cleanly to +-1 (e^(2x) overflowing to inf or reaching 0)
        s = softcap - 2.0 * softcap / (tl.exp2(s * 2.8853900817779268) + 1.0)  # 2.885... = 2 log2 e
    return s


@helper
def online_softmax(s, v, m_i, l_i, acc, FP32_DOT: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """Fold a tile of base-2 logits ``s [M, N]`` (masked keys at ``-inf``) and its values ``v [N, D]`` into the
    running row max ``m_i [M]``, row sum ``l_i [M]`` and accumulator ``acc [M, D]``; returns the new three.

    Unless ``MAY_BE_EMPTY``, every row must have a finite logit in this tile or an earlier one (else
    ``m_i - m_new`` is ``nan``); with it, rows that have seen only masked keys keep ``l_i == 0``, ``acc == 0``.
    """
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@helper
def add_sink(sink, m_i, l_i, acc):
    """Add one more logit per row, ``sink [M]`` (base 2), with no value, to the softmax state (attention sinks):
    it joins the row sum only. Returns ``l_i, acc``, rescaled to the max of ``m_i`` and ``sink``."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]
