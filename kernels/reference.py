"""What every kernel in this package computes, written as plainly as possible: the reference the tests hold both
backends to (the torch backend, :mod:`.torch_backend`, and the Triton kernels).

Nothing here is fast and the engine never calls it. Attention runs one sequence and one query at a time: the
query's visible keys are gathered slot by slot through the block table, scores and softmax are float64, and
positions are masked by plain comparisons. Outputs are float64 (compare a backend's output, cast up, with them).

Attention semantics
-------------------
Sequence ``b`` holds ``seq_lens[b]`` tokens; token ``t`` lives at slot
``block_tables[b, t // block_size] * block_size + t % block_size`` of the flattened ``[NB * BS, Hkv, D]`` cache.
Its queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` are its last ``n_b`` tokens, at positions
``seq_lens[b] - n_b .. seq_lens[b] - 1`` (decode: ``n_b == 1``). Query head ``h`` reads kv head
``h // (Hq // Hkv)`` (GQA). A query at position ``p`` attends to the keys at positions ``k <= p`` (causal).
Logits are ``s = scale * q·k``; the output is ``sum_k softmax(s)_k * v_k`` over the visible keys.
"""

from __future__ import annotations

import torch
from torch import Tensor


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write token ``t``'s ``key[t]``/``value[t]`` ``[Hkv, D]`` at slot ``slot_mapping[t]`` of the caches
    ``[NB, BS, Hkv, D]`` (converted to the cache dtype); slot ``-1`` stores nothing."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat_k[slot] = key[t].to(k_cache.dtype)
            flat_v[slot] = value[t].to(v_cache.dtype)


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """For each pair ``(src, dst)`` of ``block_mapping [N, 2]``, copy block ``src`` to ``dst`` in every layer, K
    and V, of ``kv_cache [L, 2, NB, BS, Hkv, D]``; every source is read before any destination is written."""
    pairs = block_mapping.tolist()
    sources = [kv_cache[:, :, src].clone() for src, _ in pairs]
    for (_, dst), block in zip(pairs, sources):
        kv_cache[:, :, dst] = block


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Packed queries ``q [T, Hq, D]`` over caches ``[NB, BS, Hkv, D]`` → float64 ``[T, Hq, D]`` (semantics above)."""
    cu = cu_seqlens_q.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu) - 1):
        table = block_tables[b].tolist()
        seq_len = int(seq_lens[b])
        first = seq_len - (cu[b + 1] - cu[b])
        for i in range(cu[b], cu[b + 1]):
            pos = first + i - cu[b]
            out[i] = _attend(q[i], k_cache, v_cache, table, pos, scale)
    return out


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """One query per sequence, ``q [B, Hq, D]`` (the token at ``seq_lens[b] - 1``) → float64 ``[B, Hq, D]``."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens, block_tables, scale)


def _attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    table: list[int],
    pos: int,
    scale: float,
) -> Tensor:
    """One query ``q [Hq, D]`` at position ``pos`` of the sequence with block table ``table`` → ``[Hq, D]``."""
    num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    slots = [table[k // block_size] * block_size + k % block_size for k in range(pos + 1)]
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()  # [L, Hkv, D]
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double()
    kv_head = torch.arange(num_q_heads) // (num_q_heads // num_kv_heads)
    keys, values = keys[:, kv_head], values[:, kv_head]  # [L, Hq, D]
    scores = torch.einsum("lhd,hd->hl", keys, q.double()) * scale  # [Hq, L]
    weights = torch.softmax(scores, dim=1)
    return torch.einsum("hl,lhd->hd", weights, values)
