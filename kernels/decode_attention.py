"""Triton paged decode attention: one query token per sequence, read through the block table.

Program ``(b, kv_head, split)`` computes all ``G = Hq // Hkv`` query heads that share ``kv_head`` together (the
``[G, D]`` query tile is padded to 16 rows for ``tl.dot``), so each K/V tile is loaded once per kv head. It walks
its tokens in tiles of ``BLOCK_N`` (independent of the page size: the physical slot of every token is looked up
in the block table, so pages of 8..64 tokens all work) with an online softmax in float32 (``exp2`` with the
``log2 e`` folded into the scale; the tile load, scores and softmax update live in :mod:`._tiles`, shared with the
prefill kernel).

Split-K ("flash-decoding"): when there are few (sequence, kv head) pairs for the GPU but long contexts, each
sequence's context is cut into ``num_splits`` equal ranges handled by separate programs that write a normalised
partial output and its log-sum-exp; a second kernel merges them. :func:`choose_num_splits` is the heuristic;
``num_splits=`` forces a value (1 = single pass). Semantics: :func:`reference.paged_decode_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._jit import interpreting, kernel
from ._tiles import OptionArgs, add_sink, load_kv_tile, online_softmax, paged_inputs, tile_scores
from .options import AttentionOptions
from .paged_kv import PagedKV

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256


@kernel
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    stride_bt,
    group,
    head_dim,
    num_splits,
    window,
    softcap,
    sinks_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if WINDOW:  # the query (position seq_len - 1) sees keys seq_len - window .. seq_len - 1
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    if SPLIT:
        per_split = ((seq_len - lo + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(seq_len, start + per_split)
    else:
        start = lo
        end = seq_len

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_dim
    heads = kvh * group + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_mask = tok < end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, tok, t_mask, d, d_mask, kvh, stride_cache_block, stride_cache_tok,
            stride_cache_head, BLOCK_SIZE, True,
        )  # fmt: skip
        s = tl.where(t_mask[None, :], tile_scores(q, k, qk_scale, softcap, FP32_DOT, SOFTCAP), float("-inf"))
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, FP32_DOT, False)
    if SINKS and not SPLIT:  # split-K: the merge kernel adds the sink, once
        l_i, acc = add_sink(tl.load(sinks_ptr + heads, mask=g_mask, other=0.0), m_i, l_i, acc)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty split (or seq_len 0) has l_i == 0
    out = acc / l_safe[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, out, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@kernel
def _decode_reduce_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    head_dim,
    sinks_ptr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.reduce(lse, 0, tl.standard._elementwise_max)
    if SINKS:
        sink = tl.load(sinks_ptr + h)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    part = tl.load(
        partial_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    w_sum = tl.reduce(w, 0, tl.standard._sum_combine)
    if SINKS:  # one more logit in the denominator, with no value
        w_sum += tl.exp2(sink - m)
    out = tl.reduce(w[:, None] * part, 0, tl.standard._sum_combine) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K only when ``batch * num_kv_heads`` programs leave the GPU idle and contexts are long.

    Aim for about two waves of programs (``2 * num_sms``) while keeping at least ``MIN_TOKENS_PER_SPLIT``
    tokens per split (fewer make the merge cost more than it saves).
    """
    programs = batch * num_kv_heads
    target = 2 * num_sms
    if programs >= target or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    splits = min(math.ceil(target / programs), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return max(1, splits)


def decode_tiles(block_d: int, block_g: int, fp32_dot: bool) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` for a ``[block_g, block_d]`` query tile (sized to stay clear of spills)."""
    if fp32_dot:
        return (32 if block_d <= 64 else 16), 4
    return (64 if block_d <= 128 else 32), 4


def _splits(
    num_splits: int | None, max_seq_len: int | None, kv: PagedKV, options: AttentionOptions, device
) -> int:
    """The split count of :func:`paged_decode_attention` (the heuristic's when ``num_splits`` is None)."""
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(kv.seq_lens.max())
        if options.sliding_window is not None:
            max_seq_len = min(max_seq_len, options.sliding_window)  # keys each query reads
        num_splits = choose_num_splits(kv.seq_lens.shape[0], kv.num_kv_heads, max_seq_len, _num_sms(device))
    return max(1, min(int(num_splits), MAX_SPLITS))


def paged_decode_attention(
    q: Tensor,
    kv: PagedKV,
    options: AttentionOptions,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """``q [B,Hq,D]`` (query of the token at ``kv.seq_lens[b]-1``) over ``kv`` → ``[B,Hq,D]``.

    ``num_splits``: None = heuristic, 1 = single pass, > 1 = split-K with that many splits. ``max_seq_len``
    (an upper bound on ``kv.seq_lens``) saves a device sync when the heuristic runs. ``options``: the scale,
    and ``sliding_window``, ``softcap``, ``sinks [Hq]`` (see :mod:`.reference`); with a window only the last
    ``sliding_window`` keys (and their block-table entries) are read.
    """
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return q.new_empty(q.shape)
    q, kv, group = paged_inputs(q, kv)
    device = q.device
    opt = OptionArgs.make(options, like=q)
    num_splits = _splits(num_splits, max_seq_len, kv, options, device)
    fp32_dot = interpreting(device) or q.dtype != kv.k_cache.dtype or q.dtype == torch.float32
    block_d = triton.next_power_of_2(head_dim)
    block_g = max(16, triton.next_power_of_2(group))
    block_n, num_warps = decode_tiles(block_d, block_g, fp32_dot)
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=device)
    common = dict(
        BLOCK_SIZE=kv.block_size,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        FP32_DOT=fp32_dot,
        **opt.constexprs,
        num_warps=num_warps,
    )
    launch = _decode_kernel.on(device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    cache_strides = (*kv.k_cache.stride()[:3], kv.block_tables.stride(0))
    option_args = (opt.window, opt.softcap, opt.sinks)
    if num_splits == 1:
        launch[(batch, kv.num_kv_heads, 1)](
            *args, out, out, opt.qk_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), 0, 0, 0,
            *cache_strides, group, head_dim, 1, *option_args, SPLIT=False, **common,
        )  # fmt: skip
        return out
    partial = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=device)
    launch[(batch, kv.num_kv_heads, num_splits)](
        *args, partial, lse, opt.qk_scale, q.stride(0), q.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        *cache_strides, group, head_dim, num_splits, *option_args, SPLIT=True, **common,
    )  # fmt: skip
    _decode_reduce_kernel.on(device)[(batch, num_q_heads)](
        partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), num_splits, head_dim, opt.sinks,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, SINKS=opt.SINKS, num_warps=4,
    )  # fmt: skip
    return out
