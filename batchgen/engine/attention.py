"""One attention interface over the paged KV cache, backed by the torch references or the Triton kernels.

A batch is packed: decode sequences (one query token each) come first, then prefill chunks. Every layer first
stores the new tokens' K/V into their slots, then attends through the block tables, so a chunk always sees its
cached prefix and itself (and a sequence admitted in the same step may read blocks another sequence of the
batch is filling in this very forward). The KV cache layout is documented in :mod:`batchgen.kernels`.

Backends: ``torch`` runs :mod:`batchgen.kernels.reference` (the CPU path; also works on CUDA), ``triton`` the
Triton kernels (compiled on CUDA; in Triton's interpreter on CPU, which is only for tests).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from batchgen.kernels import reference, triton_available

logger = logging.getLogger(__name__)


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
    scratch: dict = field(default_factory=dict)
    """Per-forward memo for values derived from this batch alone (e.g. the cascade plan), shared by all layers."""


@dataclass
class ForwardContext:
    """What a model forward needs besides token ids and positions."""

    attn: PagedAttention
    meta: AttentionMetadata
    kv_cache: Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``auto`` to ``triton`` on CUDA (when Triton is installed) and ``torch`` elsewhere; reject triton
    where it cannot run: off CUDA it needs ``TRITON_INTERPRET=1`` (the interpreter, for tests)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}: use 'auto', 'torch' or 'triton'")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        if triton_available():
            return "triton"
        logger.warning("Triton is not installed: using the torch attention backend on CUDA (slower)")
        return "torch"
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "engine.attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1 to run the Triton "
                "kernels in the interpreter on CPU); use attention_backend=torch or auto on this machine"
            )
        if not triton_available():
            raise ValueError("engine.attention_backend=triton needs the triton package: pip install triton")
    return backend


class PagedAttention:
    """Stores K/V and computes attention for a packed batch with the chosen backend (one per engine).

    On CPU the torch backend keeps a :class:`~batchgen.kernels.reference.Workspace` for gathered K/V, reused by
    every layer and step (so one engine must not run two forwards concurrently); on CUDA the caching allocator
    already reuses that memory.
    """

    def __init__(self, backend: str = "torch") -> None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"unknown attention backend {backend!r}: use 'torch' or 'triton'")
        self.backend = backend
        self.workspace = reference.Workspace()
        if backend == "triton":  # imported lazily: needs triton
            from batchgen.kernels.copy_blocks import copy_blocks
            from batchgen.kernels.decode_attention import paged_decode_attention
            from batchgen.kernels.prefill_attention import paged_prefill_attention
            from batchgen.kernels.store_kv import store_kv

            self._store_kv = store_kv
            self._triton_decode = paged_decode_attention
            self._triton_prefill = paged_prefill_attention
            self._copy_blocks = copy_blocks
        else:
            self._store_kv = reference.store_kv_ref
            self._copy_blocks = reference.copy_blocks_ref

    def copy_blocks(self, kv_cache: Tensor, block_mapping: Tensor) -> None:
        """Copy blocks ``block_mapping[:, 0] -> [:, 1]`` (``[N, 2]`` int64, disjoint sets) in all layers."""
        self._copy_blocks(kv_cache, block_mapping)

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
        """``q [T,Hq,D]``, ``k/v [T,Hkv,D]`` → ``[T,Hq,D]``: store k/v at ``meta.slot_mapping``, then attend."""
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_seqs
        num_seqs = meta.seq_lens.shape[0]
        if nd == num_seqs:
            return self._decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len, meta.scratch
            )
        if nd == 0:
            return self._prefill(
                q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, meta
            )
        out = torch.empty_like(q)
        bt, lens = meta.block_tables, meta.seq_lens
        out[:nd] = self._decode(
            q[:nd], k_cache, v_cache, bt[:nd], lens[:nd], scale, meta.max_seq_len, meta.scratch
        )
        cu = meta.cu_seqlens_q[nd:] - nd
        out[nd:] = self._prefill(q[nd:], k_cache, v_cache, cu, lens[nd:], bt[nd:], scale, meta)
        return out

    def _decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        scale: float,
        max_seq_len: int,
        scratch: dict | None = None,
    ) -> Tensor:
        if self.backend == "triton":
            return self._triton_decode(
                q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len
            )
        return reference.paged_decode_attention_ref(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            workspace=self._workspace_for(q),
            plan_cache=scratch,
        )

    def _prefill(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        cu_seqlens_q: Tensor,
        seq_lens: Tensor,
        block_tables: Tensor,
        scale: float,
        meta: AttentionMetadata,
    ) -> Tensor:
        if self.backend == "triton":
            return self._triton_prefill(
                q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                max_query_len=meta.max_query_len,
            )  # fmt: skip
        return reference.paged_prefill_attention_ref(
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, workspace=self._workspace_for(q)
        )

    def _workspace_for(self, q: Tensor) -> reference.Workspace | None:
        return self.workspace if q.device.type == "cpu" else None
