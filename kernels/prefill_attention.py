"""Triton paged prefill attention: variable-length query chunks over their cached prefix plus themselves.

Sequence ``b`` owns queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` at absolute positions
``seq_lens[b] - q_len_b .. seq_lens[b] - 1`` (its new tokens' K/V are already in the cache). Program
``(q_tile, kv_head, b)`` takes ``BLOCK_Q`` consecutive queries times all ``G`` query heads of ``kv_head`` as
one ``[BLOCK_Q * BLOCK_G, D]`` tile (row ``r`` = query ``r // BLOCK_G``, head ``r % BLOCK_G``), so GQA heads share
every K/V tile load. Keys are read through the block table in tiles of ``BLOCK_N`` with an online softmax in
float32 (the pieces shared with the decode kernel are in :mod:`._tiles`): first the tiles every query of the
tile may see in full (the cached prefix and earlier new tokens, no mask), then the diagonal tiles under the
causal mask. With a sliding window, the tiles where the windows of the tile's queries begin come first, masked
too, and nothing before them is read. Tiles run longest-first (the last query tiles of a sequence have the
most keys). Semantics: :func:`reference.paged_prefill_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._jit import helper, interpreting, kernel
from ._tiles import OptionArgs, add_sink, load_kv_tile, online_softmax, paged_inputs, tile_scores
from .options import AttentionOptions
from .paged_kv import PagedKV


@helper
def _masked_tile(
    q,
    q_pos,
    n0,
    seq_len,
    win_lo,
    window,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    d,
    d_mask,
    kvh,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    qk_scale,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """One key tile ``n0 ..`` that some query rows may see only in part: keys past ``seq_len``, after a row's
    position (causal) or, with ``WINDOW``, before ``win_lo`` (never read) or outside a row's window are
    masked. Returns the new ``m_i, l_i, acc``."""
    k_pos = n0 + tl.arange(0, BLOCK_N)
    kv_mask = k_pos < seq_len
    if WINDOW:
        kv_mask = kv_mask & (k_pos >= win_lo)
    k, v = load_kv_tile(
        k_cache_ptr, v_cache_ptr, bt_row, k_pos, kv_mask, d, d_mask, kvh, stride_cache_block, stride_cache_tok,
        stride_cache_head, BLOCK_SIZE, True,
    )  # fmt: skip
    s = tile_scores(q, k, qk_scale, softcap, FP32_DOT, SOFTCAP)
    visible = (k_pos[None, :] <= q_pos[:, None]) & kv_mask[None, :]
    if WINDOW:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    # Under a window a row may see nothing in a tile before it has seen anything at all.
    return online_softmax(s, v, m_i, l_i, acc, FP32_DOT, WINDOW)


@kernel
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    stride_bt,
    group,
    head_dim,
    window,
    softcap,
    sinks_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    tok_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - tok_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    r = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + r // BLOCK_G
    gi = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    row_mask = (qi < q_len) & (gi < group)
    heads = kvh * group + gi
    tok = (tok_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    # Padding rows (past q_len) sit at positions >= seq_len: without a window they see every key, so no row is
    # ever empty; with one they may see none (and are not stored).
    q_pos = ctx_len + qi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    first_pos = ctx_len + tile * BLOCK_Q  # position of the tile's first query
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys before full_end: after no row's position
    if WINDOW:
        win_lo = tl.maximum(first_pos - window + 1, 0)  # the first key any row of the tile sees
        # keys from full_lo on: inside every row's window
        full_lo = (tl.maximum(last_pos - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        for n0 in range(win_lo // BLOCK_N * BLOCK_N, tl.minimum(full_lo, full_end), BLOCK_N):
            m_i, l_i, acc = _masked_tile(
                q, q_pos, n0, seq_len, win_lo, window, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, d,
                d_mask, kvh, stride_cache_block, stride_cache_tok, stride_cache_head, qk_scale, softcap,
                BLOCK_SIZE, BLOCK_N, FP32_DOT, SOFTCAP, WINDOW,
            )  # fmt: skip
    else:
        win_lo = 0
        full_lo = 0
    for n0 in range(full_lo, full_end, BLOCK_N):  # keys [full_lo, full_end): visible to every row
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, k_pos, k_pos, d, d_mask, kvh, stride_cache_block, stride_cache_tok,
            stride_cache_head, BLOCK_SIZE, False,
        )  # fmt: skip
        s = tile_scores(q, k, qk_scale, softcap, FP32_DOT, SOFTCAP)
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, FP32_DOT, False)
    for n0 in range(full_end, last_pos + 1, BLOCK_N):  # the diagonal: causal mask
        m_i, l_i, acc = _masked_tile(
            q, q_pos, n0, seq_len, win_lo, window, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, d, d_mask,
            kvh, stride_cache_block, stride_cache_tok, stride_cache_head, qk_scale, softcap, BLOCK_SIZE, BLOCK_N,
            FP32_DOT, SOFTCAP, WINDOW,
        )  # fmt: skip
    if SINKS:
        l_i, acc = add_sink(tl.load(sinks_ptr + heads, mask=gi < group, other=0.0), m_i, l_i, acc)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def prefill_tiles(block_d: int, block_g: int, fp32_dot: bool, windowed: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)``: query-tile rows (``BLOCK_Q * BLOCK_G``), keys per step, warps."""
    if fp32_dot:
        # float32 dots run on FMA units (input_precision="ieee"): small tiles keep them out of spills
        block_m, block_n, num_warps = (
            (32, 32, 8) if block_d <= 64 else (16, 32, 4) if block_d <= 128 else (16, 16, 4)
        )
        if windowed and 64 < block_d <= 128:  # the window's extra loop spills with 4 warps (255 registers)
            num_warps = 8
    elif block_d <= 128:
        block_m, block_n, num_warps = 128, 64, 8
    else:
        block_m, block_n, num_warps = 64, 32, 8
    return max(block_m, block_g), block_n, num_warps


def paged_prefill_attention(
    q: Tensor,
    cu_seqlens_q: Tensor,
    kv: PagedKV,
    options: AttentionOptions,
    *,
    max_query_len: int | None = None,
) -> Tensor:
    """``q [T,Hq,D]`` packed query chunks over ``kv`` → ``[T,Hq,D]``.

    ``cu_seqlens_q [B+1]`` int32 delimit the chunks. ``max_query_len`` (an upper bound on the chunk lengths)
    saves a device sync. ``options``: the scale, and ``sliding_window``, ``softcap``, ``sinks [Hq]`` (see
    :mod:`.reference`); with a window, keys before a query tile's first window (and their block-table entries)
    are not read.
    """
    total, num_q_heads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    if total == 0 or batch == 0:
        return q.new_empty(q.shape)
    q, kv, group = paged_inputs(q, kv)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    device = q.device
    opt = OptionArgs.make(options, like=q)
    fp32_dot = interpreting(device) or q.dtype != kv.k_cache.dtype or q.dtype == torch.float32
    block_d = triton.next_power_of_2(head_dim)
    block_g = triton.next_power_of_2(group)
    block_m, block_n, num_warps = prefill_tiles(block_d, block_g, fp32_dot, windowed=opt.WINDOW)
    block_q = block_m // block_g
    out = torch.empty((total, num_q_heads, head_dim), dtype=q.dtype, device=device)
    grid = (triton.cdiv(max_query_len, block_q), kv.num_kv_heads, batch)
    _prefill_kernel.on(device)[grid](
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, cu_seqlens_q, out, opt.qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.k_cache.stride(0), kv.k_cache.stride(1), kv.k_cache.stride(2), kv.block_tables.stride(0),
        group, head_dim, opt.window, opt.softcap, opt.sinks,
        BLOCK_SIZE=kv.block_size, BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        FP32_DOT=fp32_dot, **opt.constexprs, num_warps=num_warps,
    )  # fmt: skip
    return out
