"""One attention interface over the paged KV cache, backed by the torch backend or the Triton kernels.

A batch is packed: decode sequences (one query token each) come first, then prefill chunks. Every layer first
stores the new tokens' K/V into their slots, then attends through the block tables, so a chunk always sees its
cached prefix and itself (and a sequence admitted in the same step may read blocks another sequence of the
batch is filling in this very forward). The KV cache layout is documented in :mod:`batchgen.kernels`.

Backends implement :class:`AttentionBackend` (four operations); :func:`resolve_backend` picks one by name for a
device and :class:`PagedAttention` builds it once: ``torch`` (:class:`TorchBackend`, :mod:`batchgen.kernels.
torch_backend`: the CPU path, also works on CUDA) or ``triton`` (:class:`TritonBackend`: the Triton kernels,
compiled on CUDA; in Triton's interpreter on CPU, which is only for tests).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from batchgen.kernels import cpu_kernel, torch_backend, triton_available
from batchgen.kernels.lora import LoRAPlan
from batchgen.kernels.options import AttentionOptions  # re-exported: models build one per layer
from batchgen.kernels.paged_kv import PagedKV

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
    key_end: Tensor | None = None
    """[T] int64 or None (causal): token ``t`` at position ``p`` attends to keys ``< max(p + 1, key_end[t])``.
    A model whose tokens attend bidirectionally within a span of a prefill chunk (Gemma 3's image tokens) sets
    it to the span's end for the span's tokens; a chunk never ends inside such a span (the scheduler keeps
    it whole), so every key a token sees is stored by this forward or cached before it."""
    scratch: dict = field(default_factory=dict)
    """Per-forward memo for values derived from this batch alone (e.g. the cascade plan), shared by all layers."""

    @classmethod
    def for_sequences(
        cls, seqs: list[tuple[list[int], int, int]], num_decode_seqs: int, block_size: int
    ) -> AttentionMetadata:
        """The metadata of ``seqs``, each ``(block_table, num_cached_tokens, num_new_tokens)``, decodes first:
        the new tokens' slots follow the block tables, and the tables are zero-padded to the longest."""
        slots, seq_lens, cu = [], [], [0]
        tables = torch.zeros(len(seqs), max(len(t) for t, _, _ in seqs), dtype=torch.int32)
        for i, (table, start, n) in enumerate(seqs):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_seqs=num_decode_seqs,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            block_tables=tables,
            max_seq_len=max(seq_lens),
            max_query_len=max(n for _, _, n in seqs),
        )


@dataclass
class ForwardContext:
    """What a model forward needs besides token ids and positions."""

    attn: PagedAttention
    meta: AttentionMetadata
    kv_cache: Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    lora: LoRAPlan | None = None
    """Each token's LoRA adapter slot (:mod:`batchgen.models.lora`); None: the base model for every token."""
    rope_positions: Tensor | None = None
    """``[S, T]`` position ids of a model whose positions are not the cache positions (multimodal RoPE), from
    its feature's per-token input; None: the cache positions."""


class AttentionBackend(Protocol):
    """The four paged-cache operations a backend provides (semantics: :mod:`batchgen.kernels.reference`).

    ``decode`` gets one query per sequence (``q [B, Hq, D]``), ``prefill`` packed chunks (``q [T, Hq, D]``
    delimited by ``cu_seqlens_q``); both read the new tokens' K/V from the cache through a
    :class:`~batchgen.kernels.paged_kv.PagedKV` (``store_kv`` ran first).
    ``max_seq_len`` / ``max_query_len`` bound ``kv.seq_lens`` / the chunk lengths (saves device syncs);
    ``scratch`` lives for one forward, shared by its layers. ``options``: the layer's
    :class:`AttentionOptions` (scale, and ``sliding_window``, ``softcap``, ``sinks``).
    """

    name: str

    def store_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
    ) -> None: ...

    def decode(
        self, q: Tensor, kv: PagedKV, options: AttentionOptions, *, max_seq_len: int, scratch: dict
    ) -> Tensor: ...

    def store_and_decode(
        self,
        q: Tensor,
        key: Tensor,
        value: Tensor,
        slot_mapping: Tensor,
        kv: PagedKV,
        options: AttentionOptions,
        *,
        max_seq_len: int,
        scratch: dict,
    ) -> Tensor:
        """``store_kv`` of the step's ``key``/``value`` (one per sequence), then ``decode``: the same result,
        in one pass where the backend can (the CPU's C kernel writes each row as it attends)."""
        ...

    def prefill(
        self, q: Tensor, cu_seqlens_q: Tensor, kv: PagedKV, options: AttentionOptions, *, max_query_len: int
    ) -> Tensor: ...

    def copy_blocks(self, kv_cache: Tensor, block_mapping: Tensor) -> None: ...


class TorchBackend:
    """:mod:`batchgen.kernels.torch_backend`. On CPU it keeps a :class:`~batchgen.kernels.Workspace` for gathered
    K/V, reused by every layer and step (so one engine must not run two forwards concurrently); on CUDA the
    caching allocator already reuses that memory."""

    name = "torch"
    store_kv = staticmethod(torch_backend.store_kv)
    copy_blocks = staticmethod(torch_backend.copy_blocks)

    def __init__(self) -> None:
        self.workspace = torch_backend.Workspace()

    def decode(
        self, q: Tensor, kv: PagedKV, options: AttentionOptions, *, max_seq_len: int, scratch: dict
    ) -> Tensor:
        workspace = self._workspace_for(q)
        return torch_backend.paged_decode_attention(q, kv, options, workspace=workspace, plan_cache=scratch)

    def store_and_decode(
        self,
        q: Tensor,
        key: Tensor,
        value: Tensor,
        slot_mapping: Tensor,
        kv: PagedKV,
        options: AttentionOptions,
        *,
        max_seq_len: int,
        scratch: dict,
    ) -> Tensor:
        workspace = self._workspace_for(q)
        new_kv = cpu_kernel.NewKV(key, value, slot_mapping.long())
        return torch_backend.paged_decode_attention(
            q, kv, options, workspace=workspace, plan_cache=scratch, new_kv=new_kv
        )

    def prefill(
        self, q: Tensor, cu_seqlens_q: Tensor, kv: PagedKV, options: AttentionOptions, *, max_query_len: int
    ) -> Tensor:
        workspace = self._workspace_for(q)
        return torch_backend.paged_prefill_attention(q, cu_seqlens_q, kv, options, workspace=workspace)

    def _workspace_for(self, q: Tensor) -> torch_backend.Workspace | None:
        return self.workspace if q.device.type == "cpu" else None


class TritonBackend:
    """The Triton kernels (imported on construction: they need triton)."""

    name = "triton"

    def __init__(self) -> None:
        from batchgen.kernels import copy_blocks, decode_attention, prefill_attention, store_kv

        self.store_kv = store_kv.store_kv
        self.copy_blocks = copy_blocks.copy_blocks
        self._decode = decode_attention.paged_decode_attention
        self._prefill = prefill_attention.paged_prefill_attention

    def decode(
        self, q: Tensor, kv: PagedKV, options: AttentionOptions, *, max_seq_len: int, scratch: dict
    ) -> Tensor:
        return self._decode(q, kv, options, max_seq_len=max_seq_len)

    def store_and_decode(
        self,
        q: Tensor,
        key: Tensor,
        value: Tensor,
        slot_mapping: Tensor,
        kv: PagedKV,
        options: AttentionOptions,
        *,
        max_seq_len: int,
        scratch: dict,
    ) -> Tensor:
        self.store_kv(key, value, kv.k_cache, kv.v_cache, slot_mapping)
        return self.decode(q, kv, options, max_seq_len=max_seq_len, scratch=scratch)

    def prefill(
        self, q: Tensor, cu_seqlens_q: Tensor, kv: PagedKV, options: AttentionOptions, *, max_query_len: int
    ) -> Tensor:
        return self._prefill(q, cu_seqlens_q, kv, options, max_query_len=max_query_len)


BACKENDS: dict[str, type[TorchBackend] | type[TritonBackend]] = {
    "torch": TorchBackend,
    "triton": TritonBackend,
}


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``auto`` to ``triton`` on CUDA (when Triton is installed) and ``torch`` elsewhere; reject triton
    where it cannot run: off CUDA it needs ``TRITON_INTERPRET=1`` (the interpreter, for tests)."""
    if backend not in ("auto", *BACKENDS):
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


@dataclass(frozen=True)
class KVScales:
    """One layer's fp8 KV-cache scales (vLLM's ``k_scale`` / ``v_scale``): ``[Hkv]`` float32 (a per-tensor scale
    repeated). The cache holds ``k / k_scale`` and ``v / v_scale`` rounded to fp8; attention reads them as
    ``k_scale * k_cached``. The scales are folded around the backend instead of into its kernels:
    ``q · (s k_c) = (s q) · k_c`` and ``Σ p (s v_c) = s Σ p v_c`` per head, so every backend's KV read is the
    plain widening it already does. Only fp8 caches use them (vLLM's rule): any other cache stores K/V as they
    are."""

    k: Tensor
    v: Tensor

    @classmethod
    def of(cls, k: Tensor, v: Tensor, num_kv_heads: int) -> KVScales:
        """Per-tensor (one value) or per-head (``num_kv_heads`` values, any shape) scales, as ``[Hkv]``."""
        out = []
        for name, s in (("k_scale", k), ("v_scale", v)):
            s = s.detach().float().reshape(-1)
            if s.numel() == 1:
                s = s.expand(num_kv_heads)
            if s.numel() != num_kv_heads or not bool((s > 0).all()) or not bool(s.isfinite().all()):
                raise ValueError(
                    f"{name} must be one positive scale or one per KV head ({num_kv_heads}), got {tuple(s.shape)}"
                )
            out.append(s.contiguous())
        return cls(*out)


class PagedAttention:
    """Stores K/V and computes attention for a packed batch (one per engine) with one backend, given by name
    (``"torch"``, ``"triton"``: see :func:`resolve_backend`) or as an :class:`AttentionBackend` object.
    ``backend`` is its name, ``impl`` the backend object."""

    def __init__(self, backend: str | AttentionBackend = "torch") -> None:
        if isinstance(backend, str):
            if backend not in BACKENDS:
                raise ValueError(f"unknown attention backend {backend!r}: use 'torch' or 'triton'")
            backend = BACKENDS[backend]()
        self.impl: AttentionBackend = backend
        self.backend: str = backend.name

    def copy_blocks(self, kv_cache: Tensor, block_mapping: Tensor) -> None:
        """Copy blocks ``block_mapping[:, 0] -> [:, 1]`` (``[N, 2]`` int64, disjoint sets) in all layers."""
        self.impl.copy_blocks(kv_cache, block_mapping)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        options: AttentionOptions,
        kv_scales: KVScales | None = None,
    ) -> Tensor:
        """``q [T,Hq,D]``, ``k/v [T,Hkv,D]`` → ``[T,Hq,D]``: store k/v at ``meta.slot_mapping``, then attend.
        `kv_scales`: the layer's fp8 KV-cache scales (:class:`KVScales`; used with an fp8 cache only).

        ``options`` (semantics: :mod:`batchgen.kernels.reference`), per call so each layer passes its own: the
        scale; ``sliding_window`` — a query at position ``p`` sees keys ``p - sliding_window < k <= p`` (itself
        and the ``sliding_window - 1`` before it: transformers' convention); ``softcap`` — logits become
        ``softcap * tanh(logits / softcap)`` (Gemma 2); ``sinks [Hq]`` — one extra logit per head in the
        softmax denominator (gpt-oss). None = plain causal attention, exactly as without them.
        """
        if kv_scales is not None and k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            group = q.shape[1] // k.shape[1]
            ks, vs = kv_scales.k.to(q.device)[:, None], kv_scales.v.to(q.device)[:, None]
            q = q * ks.repeat_interleave(group, dim=0)
            out = self.forward(q, k / ks, v / vs, k_cache, v_cache, meta, options)
            return out.mul_(vs.repeat_interleave(group, dim=0))
        impl = self.impl
        nd = meta.num_decode_seqs
        kv = PagedKV(k_cache, v_cache, meta.block_tables, meta.seq_lens)
        decode = dict(max_seq_len=meta.max_seq_len, scratch=meta.scratch)
        if nd == meta.seq_lens.shape[0]:
            return impl.store_and_decode(q, k, v, meta.slot_mapping, kv, options, **decode)
        impl.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        prefill = impl.prefill if meta.key_end is None else self._prefill_spans(meta.key_end[nd:])
        if nd == 0:
            return prefill(q, meta.cu_seqlens_q, kv, options, max_query_len=meta.max_query_len)
        out = torch.empty_like(q)
        out[:nd] = impl.decode(q[:nd], kv.select(slice(None, nd)), options, **decode)
        cu = meta.cu_seqlens_q[nd:] - nd
        out[nd:] = prefill(q[nd:], cu, kv.select(slice(nd, None)), options, max_query_len=meta.max_query_len)
        return out

    def _prefill_spans(self, key_end: Tensor):
        """The prefill of a step whose chunks hold bidirectional spans (``AttentionMetadata.key_end``): the
        torch backend's masked path, on any device (the C and Triton kernels are causal only)."""
        workspace = getattr(self.impl, "workspace", None)

        def prefill(q: Tensor, cu: Tensor, kv: PagedKV, options: AttentionOptions, *, max_query_len: int):
            ws = workspace if q.device.type == "cpu" else None
            return torch_backend.paged_prefill_attention(q, cu, kv, options, workspace=ws, key_end=key_end)

        return prefill
