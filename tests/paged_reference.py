"""A slow, obviously-correct paged attention for model tests: per sequence, gather K/V through the block table
and compute eager attention with the causal rule, an optional sliding window (a query at position p sees keys
at positions > p - window, transformers' convention), optional logit soft-capping, optional attention sinks
(one more logit per head in the softmax denominator, gpt-oss) and optional per-query key bounds
(``AttentionMetadata.key_end``: bidirectional spans).

`ReferencePagedAttention` has the engine's `PagedAttention.forward` signature (an `AttentionOptions` per call)
and records each call's options, so models can be checked against it independently of the kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchgen.attention import AttentionMetadata, AttentionOptions, PagedAttention


def paged_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, options: AttentionOptions
) -> Tensor:
    """q [T, Hq, D] (packed, sequences in `meta` order) -> [T, Hq, D], reading K/V from the paged caches."""
    scale, sliding_window, softcap, sinks = (
        options.scale,
        options.sliding_window,
        options.softcap,
        options.sinks,
    )
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        lo, hi = cu[b], cu[b + 1]
        n = hi - lo
        pos = torch.arange(seq_len)
        slots = meta.block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].float()  # [L, Hkv, D]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].float()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qs = q[lo:hi].float()  # [n, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(seq_len - n, seq_len)[:, None]
        allowed = pos[None, :] <= qpos
        if meta.key_end is not None:  # bidirectional spans: a query sees keys before its bound
            allowed |= pos[None, :] < meta.key_end[lo:hi].long()[:, None]
        if sliding_window is not None:
            allowed &= pos[None, :] > qpos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # gpt-oss: one more logit per head in the denominator, with no value
            sink = sinks.float().view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


class ReferencePagedAttention(PagedAttention):
    """`PagedAttention` whose forward is `paged_attention_reference` (torch store_kv, then the reference)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.calls: list[dict] = []

    def forward(self, q, k, v, k_cache, v_cache, meta, options, kv_scales=None):
        assert kv_scales is None, "the reference reads unscaled caches"
        self.calls.append(dict(vars(options)))  # scale, sliding_window, softcap, sinks
        self.impl.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_reference(q, k_cache, v_cache, meta, options)
