"""The pieces the paged attention kernels share (decode, decode split-K, prefill): ``@triton.jit`` device
functions, inlined by the compiler, called as Python functions by the interpreter (see :func:`._jit.helper`).

Every attention kernel walks a sequence's keys in tiles of ``BLOCK_N`` positions: :func:`load_kv_tile` reads a
tile of K and V through the block table, :func:`tile_scores` turns it into base-2 logits, and
:func:`online_softmax` folds it into the running max ``m``, sum ``l`` and output accumulator ``acc`` (the flash
attention recurrence, float32, ``exp2`` with ``log2 e`` folded into ``qk_scale``).
"""

from __future__ import annotations

import triton.language as tl

from ._jit import helper


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
def tile_scores(q, k, qk_scale, FP32_DOT: tl.constexpr):
    """Base-2 logits ``q @ k * qk_scale`` (``qk_scale = scale * log2 e``) of a ``[M, D]`` query tile against a
    transposed ``[D, N]`` key tile, float32 (``FP32_DOT``: an exact float32 product, for float32 or mixed-dtype
    inputs and the interpreter; else the tensor cores' product of the input dtype, accumulated in float32)."""
    if FP32_DOT:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    return s * qk_scale


@helper
def online_softmax(s, v, m_i, l_i, acc, FP32_DOT: tl.constexpr):
    """Fold a tile of base-2 logits ``s [M, N]`` (masked keys at ``-inf``) and its values ``v [N, D]`` into the
    running row max ``m_i [M]``, row sum ``l_i [M]`` and accumulator ``acc [M, D]``; returns the new three.

    Every row must have a finite logit in this tile or an earlier one (else ``m_i - m_new`` is ``nan``)."""
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
