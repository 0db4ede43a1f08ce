"""Bidirectional attention over a packed batch, registered in transformers' ``AttentionInterface`` as
``batchgen_varlen`` for the encoder path.

An encoder forward gets one row of every token of the batch (``[1, T]``, no padding) with per-sequence
``position_ids``; each layer's attention call lands here with ``query/key/value [1, H, T, D]`` and attends
within each sequence only. transformers builds no mask for an implementation it has no mask function for, so
the sequence boundaries come from :func:`packed`, which sets them for the forward. On the CPU in float32 the
C kernel's paged prefill runs (:mod:`batchgen.kernels.cpu_kernel`, not causal): the queries read in place, the
keys and values copied once into its block layout, no padding. Otherwise the sequences are gathered into a
``[B, H, L, D]`` block (L: the batch's longest; the batches are length-sorted, so little is padding) with a
key-padding mask, and one ``scaled_dot_product_attention`` runs; the padded rows are dropped on the way back.
``sliding_window`` (ModernBERT's local layers; always the torch path; transformers' inclusive flash-attention
convention ``window + 1``) restricts keys to ``|i - j| < sliding_window``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

ATTN_IMPLEMENTATION = "batchgen_varlen"


KERNEL_BLOCK = 16
"""Tokens per block of the paged layout the C kernel reads (each sequence's keys start at a block)."""


@dataclass
class PackedLayout:
    """Where each sequence of a packed batch sits: ``gather [B * L]`` token index (padding points at token 0),
    ``valid [B, L]`` bool, ``unpad [T]`` the padded-layout index of each packed token; for the C kernel, a paged
    layout of the keys: ``block_gather [NB * KERNEL_BLOCK]`` token index of each slot (each sequence's tokens
    from the start of a block on, padding at token 0), ``block_tables [B, max blocks]``, ``seq_lens [B]`` and
    ``cu_seqlens [B + 1]`` (int32)."""

    lengths: list[int]
    gather: Tensor
    valid: Tensor
    unpad: Tensor
    max_len: int
    block_gather: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    cu_seqlens: Tensor

    @classmethod
    def build(cls, lengths: list[int], device: torch.device) -> PackedLayout:
        b, width = len(lengths), max(lengths)
        lens = torch.tensor(lengths, dtype=torch.long)
        starts = torch.cumsum(lens, 0) - lens
        cols = torch.arange(width)
        valid = cols[None, :] < lens[:, None]
        gather = torch.where(valid, starts[:, None] + cols[None, :], torch.zeros((), dtype=torch.long))
        unpad = (torch.arange(b)[:, None] * width + cols[None, :])[valid]
        nblocks = (lens + KERNEL_BLOCK - 1) // KERNEL_BLOCK
        first = torch.cumsum(nblocks, 0) - nblocks
        tables = first[:, None] + torch.arange(int(nblocks.max()))[None, :]
        tables = torch.where(tables < (first + nblocks)[:, None], tables, torch.zeros((), dtype=torch.long))
        slot = torch.arange(int(nblocks.sum()) * KERNEL_BLOCK)
        seq = torch.repeat_interleave(torch.arange(b), nblocks * KERNEL_BLOCK)
        pos = slot - first[seq] * KERNEL_BLOCK
        block_gather = torch.where(pos < lens[seq], starts[seq] + pos, torch.zeros((), dtype=torch.long))
        return cls(
            lengths,
            gather.reshape(-1).to(device),
            valid.to(device),
            unpad.to(device),
            width,
            block_gather.to(device),
            tables.to(torch.int32),
            lens.to(torch.int32),
            torch.cat([starts, lens.sum()[None]]).to(torch.int32),
        )


_LAYOUT: contextvars.ContextVar[PackedLayout | None] = contextvars.ContextVar("batchgen_varlen", default=None)


@contextlib.contextmanager
def packed(layout: PackedLayout) -> Iterator[None]:
    """Attention calls inside this block attend within the sequences of ``layout``."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature; returns ``[1, T, H, D]``."""
    layout = _LAYOUT.get()
    if layout is None:
        raise RuntimeError(
            "batchgen_varlen attention called outside batchgen.pooling.varlen_attention.packed()"
        )
    if sliding_window is None:
        out = _kernel_attention(query, key, value, layout, scaling)
        if out is not None:
            return out, None
    _, h, t, d = query.shape
    b, width = len(layout.lengths), layout.max_len
    dense = b * width == t  # every sequence as long as the longest: no padding, no gather

    def padded(x: Tensor) -> Tensor:  # [1, H, T, D] -> [B, H, L, D]
        # transformers' projections give [1, T, H, D] transposed: one gather of whole tokens along the token
        # axis of [T, H, D], and the kernel takes the [B, H, L, D] strided view as it is
        rows = x[0].transpose(0, 1)
        rows = rows.reshape(t, x.shape[1], d) if dense else rows.index_select(0, layout.gather)
        return rows.view(b, width, x.shape[1], d).transpose(1, 2)

    mask = None if dense else layout.valid[:, None, None, :]
    if sliding_window is not None:
        pos = torch.arange(width, device=query.device)
        band = (pos[:, None] - pos[None, :]).abs() < int(sliding_window)
        mask = band[None, None] if mask is None else mask & band[None, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        padded(query), padded(key), padded(value), attn_mask=mask, scale=scaling
    )  # [B, H, L, D]
    out = out.transpose(1, 2).reshape(b * width, h, d)  # no copy when the kernel wrote [B, L, H, D]
    if not dense:
        out = out.index_select(0, layout.unpad)
    return out[None], None


def _kernel_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout, scaling: float | None
) -> Tensor | None:
    """The C kernel's bidirectional prefill over the packed batch (CPU, float32): the queries read in place, the
    keys and values copied once into its paged layout. ``[1, T, H, D]``, or None where it cannot serve."""
    from batchgen.kernels import cpu_kernel
    from batchgen.kernels.paged_kv import PagedKV

    if query.device.type != "cpu" or not query.dtype == key.dtype == value.dtype == torch.float32:
        return None
    d = query.shape[-1]
    q = query[0].transpose(0, 1)  # [T, H, D]
    scale = d**-0.5 if scaling is None else float(scaling)

    def paged(x: Tensor) -> Tensor:  # [1, Hkv, T, D] -> [NB, KERNEL_BLOCK, Hkv, D]
        rows = x[0].transpose(0, 1).index_select(0, layout.block_gather)
        return rows.view(-1, KERNEL_BLOCK, x.shape[1], d)

    kv = PagedKV(paged(key), paged(value), layout.block_tables, layout.seq_lens)
    res = cpu_kernel.prefill(q, layout.cu_seqlens, kv, scale, causal=False)
    return None if res is None else res[0][None]


def register() -> None:
    """Register ``batchgen_varlen`` with transformers (idempotent); no mask function, so no mask is built."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention)
