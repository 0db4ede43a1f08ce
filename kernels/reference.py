"""Torch reference implementations of the paged-attention kernels.

These define the semantics of every kernel in this package and are the engine's CPU path.

KV cache layout: one tensor ``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
layer ``i`` reads ``k_cache = kv_cache[i, 0]`` and ``v_cache = kv_cache[i, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` and contiguous. Token ``t`` of a sequence lives at slot
``block_table[t // block_size] * block_size + t % block_size``. Slot ``-1`` means "do not store".
GQA: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``. Scores and softmax accumulate in
float32; outputs have the query's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def store_kv_ref(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping`` ``[T]`` (−1 = skip)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_context(cache: Tensor, block_tables: Tensor, max_len: int) -> Tensor:
    """Gather ``[B, max_len, Hkv, D]`` contiguous K or V of each sequence through its block table."""
    block_size = cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    gathered = cache[block_tables[:, :num_blocks].long()]  # [B, nb, bs, Hkv, D]
    b = gathered.shape[0]
    return gathered.reshape(b, num_blocks * block_size, cache.shape[2], cache.shape[3])[:, :max_len]


def paged_decode_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """One query per sequence (the token at position ``seq_lens[b] - 1``) attending to its whole context."""
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return q.new_empty(q.shape)
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_len = int(seq_lens.max())
    k = _gather_context(k_cache, block_tables, max_len).float()  # [B, L, Hkv, D]
    v = _gather_context(v_cache, block_tables, max_len).float()
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # [B, Hkv, G, L]
    pos = torch.arange(max_len, device=q.device)
    invalid = pos[None, :] >= seq_lens.to(q.device).long()[:, None]  # [B, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def paged_prefill_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Variable-length query chunks attending causally to their cached context plus themselves.

    Sequence ``b`` owns queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` at absolute positions
    ``seq_lens[b] - q_len_b .. seq_lens[b] - 1``; a query at position ``p`` attends to keys ``0..p``, all read
    from the paged cache (the new tokens' K/V must already be stored).
    """
    total, num_q_heads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    if total == 0 or batch == 0:
        return q.new_empty(q.shape)
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    device = q.device
    cu = cu_seqlens_q.to(device).long()
    q_lens = cu[1:] - cu[:-1]
    lens = seq_lens.to(device).long()
    max_q = int(q_lens.max())
    max_len = int(lens.max())
    # Scatter the packed queries into a padded [B, max_q, ...] tensor.
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
    idx_in_seq = torch.arange(total, device=device) - cu[:-1][seq_of_token]
    qp = q.new_zeros(batch, max_q, num_q_heads, head_dim, dtype=torch.float32)
    qp[seq_of_token, idx_in_seq] = q.float()
    k = _gather_context(k_cache, block_tables, max_len).float()  # [B, L, Hkv, D]
    v = _gather_context(v_cache, block_tables, max_len).float()
    qg = qp.view(batch, max_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("bqhgd,blhd->bhgql", qg, k) * scale  # [B, Hkv, G, Q, L]
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, Q]
    k_pos = torch.arange(max_len, device=device)
    invalid = k_pos[None, None, :] > q_pos[:, :, None]  # [B, Q, L] (also masks keys >= seq_len)
    scores.masked_fill_(invalid[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgql,blhd->bqhgd", probs, v).reshape(batch, max_q, num_q_heads, head_dim)
    return out[seq_of_token, idx_in_seq].to(q.dtype)


def copy_blocks_ref(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy physical blocks ``block_mapping[:, 0] -> block_mapping[:, 1]`` in every layer, K and V."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(kv_cache.device)
    dst = block_mapping[:, 1].long().to(kv_cache.device)
    kv_cache[:, :, dst] = kv_cache[:, :, src]
