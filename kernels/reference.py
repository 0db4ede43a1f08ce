"""What every kernel in this package computes, written as plainly as possible: the reference the tests hold both
backends to (the torch backend, :mod:`.torch_backend`, and the Triton kernels).

Nothing here is fast and the engine never calls it. Attention runs one sequence and one query at a time: a
sequence's keys are gathered slot by slot through its block table, each query takes the slice of them it may
see, and scores and softmax are float64. Outputs are float64 (compare a backend's output, cast up, with them).

Attention semantics
-------------------
The K/V side of a call is one :class:`.paged_kv.PagedKV` (caches, ``block_tables``, ``seq_lens``).
Sequence ``b`` holds ``seq_lens[b]`` tokens; token ``t`` lives at slot
``block_tables[b, t // block_size] * block_size + t % block_size`` of the flattened ``[NB * BS, Hkv, D]`` cache.
Its queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` are its last ``n_b`` tokens, at positions
``seq_lens[b] - n_b .. seq_lens[b] - 1`` (decode: ``n_b == 1``). Query head ``h`` reads kv head
``h // (Hq // Hkv)`` (GQA). A query at position ``p`` attends to the keys at positions ``k`` with

* ``k <= p`` (causal), and
* ``k > p - sliding_window`` when ``sliding_window`` is given: the query sees itself and the
  ``sliding_window - 1`` tokens before it. This is transformers' convention (``masking_utils``:
  ``sliding_window_overlay`` keeps ``kv_idx > q_idx - sliding_window``, and'ed with ``kv_idx <= q_idx``), used
  by its Mistral, Qwen2, Gemma 2/3 and gpt-oss models.

The options (``scale``, ``sliding_window``, ``softcap``, ``sinks``) are one :class:`.options.AttentionOptions`.
Logits are ``s = scale * q·k``; with ``softcap`` they are soft-capped to ``softcap * tanh(s / softcap)`` (Gemma 2's
attention logit soft-capping, applied before masking, as transformers does). The output is
``sum_k softmax(s)_k * v_k`` over the visible keys; with ``sinks`` (``[Hq]``, gpt-oss's attention sinks) head ``h``
has one more logit, ``sinks[h]``, in the softmax denominator and no value: weights
``exp(s_k) / (sum_j exp(s_j) + exp(sinks[h]))``, which sum to less than 1.

Block-table entries of blocks that hold no key visible to any query of the sequence (entirely before every
query's window) are never read, here or by either backend: they may hold anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .options import AttentionOptions
from .paged_kv import PagedKV


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
    q: Tensor, cu_seqlens_q: Tensor, kv: PagedKV, options: AttentionOptions
) -> Tensor:
    """Packed queries ``q [T, Hq, D]`` delimited by ``cu_seqlens_q [B+1]`` over ``kv`` → float64 ``[T, Hq, D]``
    (semantics above)."""
    sliding_window = options.sliding_window
    num_q_heads = q.shape[1]
    block_size, num_kv_heads = kv.block_size, kv.num_kv_heads
    kv_head = torch.arange(num_q_heads) // (num_q_heads // num_kv_heads)  # of each query head
    cu = cu_seqlens_q.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu) - 1):
        seq_len = int(kv.seq_lens[b])
        first_pos = seq_len - (cu[b + 1] - cu[b])  # position of the sequence's first query
        # The sequence's keys from the first one its first query sees, slot by slot through the block table.
        first_key = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
        table = kv.block_tables[b].tolist()
        slots = [table[t // block_size] * block_size + t % block_size for t in range(first_key, seq_len)]
        keys = kv.k_cache.flatten(0, 1)[slots][:, kv_head].double()  # [L, Hq, D]: key t at row t - first_key
        values = kv.v_cache.flatten(0, 1)[slots][:, kv_head].double()
        for i in range(cu[b], cu[b + 1]):
            pos = first_pos + i - cu[b]
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)  # first visible key
            visible = slice(lo - first_key, pos + 1 - first_key)
            out[i] = _attend(q[i], keys[visible], values[visible], options)
    return out


def paged_decode_attention(q: Tensor, kv: PagedKV, options: AttentionOptions) -> Tensor:
    """One query per sequence, ``q [B, Hq, D]`` (the token at ``kv.seq_lens[b] - 1``) → float64
    ``[B, Hq, D]``."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_prefill_attention(q, cu, kv, options)


def _attend(q: Tensor, keys: Tensor, values: Tensor, options: AttentionOptions) -> Tensor:
    """One query ``q [Hq, D]`` over its visible ``keys`` / ``values`` ``[L, Hq, D]`` (float64) → ``[Hq, D]``."""
    softcap, sinks = options.softcap, options.sinks
    scores = torch.einsum("lhd,hd->hl", keys, q.double()) * options.scale  # [Hq, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(-1, 1)], dim=1)
    weights = torch.softmax(scores, dim=1)[:, : keys.shape[0]]
    return torch.einsum("hl,lhd->hd", weights, values)
