"""One attention interface over the paged KV cache, backed by the torch references or the Triton kernels.

A batch is packed: decode sequences (one query token each) come first, then prefill chunks. Every layer first
stores the new tokens' K/V into their slots, then attends through the block tables, so a chunk always sees its
cached prefix and itself (and a sequence admitted in the same step may read blocks another sequence of the
batch is filling in this very forward).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from batchgen.kernels import reference


@dataclass
class AttentionMetadata:
    """Flat batch description shared by all layers of one forward.

    Invariants: ``cu_seqlens_q[0] == 0``, ``cu_seqlens_q[-1] == T``; sequences ``0..num_decode_seqs-1`` have
    exactly one query; ``seq_lens[b] >= q_len_b``; ``block_tables[b]`` covers ``seq_lens[b]`` tokens.
    """

    slot_mapping: Tensor  # [T] int64
    num_decode_seqs: int
    seq_lens: Tensor  # [B] int32
    cu_seqlens_q: Tensor  # [B+1] int32
    block_tables: Tensor  # [B, max_blocks] int32
    max_seq_len: int
    max_query_len: int

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs


@dataclass
class ForwardContext:
    """What a model forward needs besides token ids and positions."""

    attn: PagedAttention
    meta: AttentionMetadata
    kv_cache: Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``auto`` to ``triton`` on CUDA and ``torch`` elsewhere; reject triton where it cannot run."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "engine.attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1 to run the Triton "
            "kernels in the interpreter on CPU); use attention_backend=torch or auto on this machine"
        )
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}: use 'auto', 'torch' or 'triton'")
    return backend


class PagedAttention:
    """Stores K/V and computes attention for a packed batch with the chosen backend."""

    def __init__(self, backend: str = "torch") -> None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"unknown attention backend {backend!r}")
        self.backend = backend
        if backend == "triton":
            from batchgen.kernels import triton_ops as ops  # imported lazily: needs triton
        else:
            ops = reference
        self._store_kv = ops.store_kv if backend == "triton" else reference.store_kv_ref
        self._decode = ops.paged_decode_attention if backend == "triton" else reference.paged_decode_attention_ref
        self._prefill = (
            ops.paged_prefill_attention if backend == "triton" else reference.paged_prefill_attention_ref
        )
        self.copy_blocks = ops.copy_blocks if backend == "triton" else reference.copy_blocks_ref

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """``q [T,Hq,D]``, ``k/v [T,Hkv,D]`` → ``[T,Hq,D]``."""
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_seqs
        num_seqs = meta.seq_lens.shape[0]
        if nd == num_seqs:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        if nd == 0:
            return self._prefill(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale
            )
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        cu = meta.cu_seqlens_q[nd:] - nd
        out[nd:] = self._prefill(
            q[nd:], k_cache, v_cache, cu, meta.seq_lens[nd:], meta.block_tables[nd:], scale
        )
        return out
