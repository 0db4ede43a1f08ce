"""Bidirectional attention over a packed batch, registered in transformers' ``AttentionInterface`` as
``batchgen_varlen`` for the encoder path.

An encoder forward gets one row of every token of the batch (``[1, T]``, no padding) with per-sequence
``position_ids``; each layer's attention call lands here with ``query/key/value [1, H, T, D]`` and attends
within each sequence only. transformers builds no mask for an implementation it has no mask function for, so
the sequence boundaries come from :func:`packed`, which sets them for the forward. Inside the call the
sequences are gathered into a ``[B, H, L, D]`` block (L: the batch's longest; the batches are length-sorted, so
little is padding) with a key-padding mask, and one ``scaled_dot_product_attention`` runs; the padded rows are
dropped on the way back. ``sliding_window`` (ModernBERT's local layers, transformers' inclusive flash-attention
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


@dataclass
class PackedLayout:
    """Where each sequence of a packed batch sits: ``gather [B * L]`` token index (padding points at token 0),
    ``valid [B, L]`` bool, ``unpad [T]`` the padded-layout index of each packed token."""

    lengths: list[int]
    gather: Tensor
    valid: Tensor
    unpad: Tensor
    max_len: int

    @classmethod
    def build(cls, lengths: list[int], device: torch.device) -> PackedLayout:
        b, width = len(lengths), max(lengths)
        lens = torch.tensor(lengths, dtype=torch.long)
        starts = torch.cumsum(lens, 0) - lens
        cols = torch.arange(width)
        valid = cols[None, :] < lens[:, None]
        gather = torch.where(valid, starts[:, None] + cols[None, :], torch.zeros((), dtype=torch.long))
        unpad = (torch.arange(b)[:, None] * width + cols[None, :])[valid]
        return cls(lengths, gather.reshape(-1).to(device), valid.to(device), unpad.to(device), width)


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


def register() -> None:
    """Register ``batchgen_varlen`` with transformers (idempotent); no mask function, so no mask is built."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention)
