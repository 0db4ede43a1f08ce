"""Batched LoRA: one packed batch, each token row under its own adapter slot (or none), in one layer call.

A LoRA-wrapped linear layer computes ``y = x @ W^T`` for every token, then adds, for each token ``t`` whose slot
``s = token_slots[t] >= 0`` and each of the layer's output parts ``i`` (a fused ``qkv_proj`` has three, q/k/v;
a plain ``o_proj`` one)::

    y[t, offsets[i] : offsets[i] + sizes[i]] += (B_i[s] @ (A[s, i] @ x[t])) * scale[s, i]

the PEFT formula ``lora_B(lora_A(x)) * scaling`` per part. A slot's weights are zero-padded to the layer's
``max_rank``: rows ``ranks[s][i]..`` of ``A[s, i]`` and columns of ``B_i[s]`` are zero, and a part the adapter
does not target has rank 0 (adds nothing). Tokens with slot ``-1`` (the base model) keep their values (the
torch path adds exact zeros to their rows).

Three implementations with one semantics:

* :func:`lora_reference`: per token, float64 — the definition; the engine never runs it.
* :func:`add_lora_torch`: batched torch (the CPU path): the tokens of each active slot are laid out as one
  ``[slots, M, in]`` batch (:class:`LoRAPlan`, built once per forward: ``M`` = most tokens of one slot, the
  short slots padded), multiplied by the slots' factors in one batched GEMM for ``A`` (all parts at once, up
  to the largest rank in use), scaled, and one per part for ``B``, each part's rows gathered back into token
  order and added to its columns: a handful of operations per layer whatever the number of adapters (the zero
  padding of ranks and rows adds exact zeros). Prefill-sized segments go slot by slot instead.
* :func:`batchgen.kernels.lora_triton.add_lora_triton`: the CUDA path, a shrink and an expand Triton kernel
  over ``BLOCK_M``-token blocks of one slot each (the same plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

BLOCK_M = 16
"""Tokens per program of the Triton kernels; a plan's blocks never straddle two slots."""


@dataclass
class LoRAWeights:
    """One wrapped linear layer's adapter slots.

    ``a [S, P, R, in]`` (P output parts, R = max rank), ``b`` one ``[S, sizes[i], R]`` per part, ``scale
    [S, P]`` float32 on the device, ``ranks`` the host copy of each slot's real rank per part (0: the part is
    not targeted, or the slot is empty). ``offsets`` / ``sizes``: each part's columns in the layer's output.
    """

    a: Tensor
    b: list[Tensor]
    scale: Tensor
    offsets: list[int]
    sizes: list[int]
    ranks: list[list[int]] = field(default_factory=list)
    col_scale: Tensor | None = None
    """``[S, out]`` each output column's scale (its part's), in the weights' dtype (the torch path's)."""

    def __post_init__(self) -> None:
        if self.col_scale is None:
            cols = [self.scale[:, p : p + 1].expand(-1, n) for p, n in enumerate(self.sizes)]
            self.col_scale = torch.cat(cols, dim=1).to(self.a.dtype).contiguous()

    @classmethod
    def empty(
        cls,
        num_slots: int,
        in_features: int,
        sizes: list[int],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoRAWeights:
        parts = len(sizes)
        offsets = [int(o) for o in np.cumsum([0, *sizes[:-1]])]
        return cls(
            a=torch.zeros(num_slots, parts, max_rank, in_features, dtype=dtype, device=device),
            b=[torch.zeros(num_slots, n, max_rank, dtype=dtype, device=device) for n in sizes],
            scale=torch.zeros(num_slots, parts, dtype=torch.float32, device=device),
            offsets=offsets,
            sizes=list(sizes),
            ranks=[[0] * parts for _ in range(num_slots)],
        )

    @property
    def max_rank(self) -> int:
        return self.a.shape[2]

    def set_slot(self, slot: int, part: int, a: Tensor | None, b: Tensor | None, scale: float) -> None:
        """Write one part of one slot: ``a [r, in]``, ``b [sizes[part], r]`` (None: the part is not targeted)."""
        self.a[slot, part].zero_()
        self.b[part][slot].zero_()
        off, n = self.offsets[part], self.sizes[part]
        if a is None or b is None:
            self.scale[slot, part] = 0.0
            self.col_scale[slot, off : off + n] = 0.0
            self.ranks[slot][part] = 0
            return
        r = a.shape[0]
        self.a[slot, part, :r].copy_(a)
        self.b[part][slot, :, :r].copy_(b)
        self.scale[slot, part] = scale
        self.col_scale[slot, off : off + n] = scale
        self.ranks[slot][part] = r

    def clear_slot(self, slot: int) -> None:
        for part in range(len(self.sizes)):
            self.set_slot(slot, part, None, None, 0.0)


@dataclass
class LoRAPlan:
    """How one forward's tokens split by adapter slot; built once per forward, shared by every layer.

    ``order`` holds the indices of the tokens that have a slot, sorted by slot (stable); ``segments`` are
    ``(slot, start, end)`` ranges of ``order`` (host ints); the Triton kernels read ``block_slot``,
    ``block_start`` and ``block_end`` (one entry per ``BLOCK_M`` tokens of a segment). The torch path reads
    the padded layout: ``pad_index [S, M]`` (segment ``i``'s tokens in row ``i``, padded with token 0),
    ``pad_rows`` (the flat positions of the padding in that layout), ``inverse [T]`` (each token's flat
    position in it; a base-model token's is a padding position, and the layout has one whenever there are
    base tokens) and ``slot_index`` (``[S]`` the segments' slots); the slot-by-slot path reads
    ``order_inverse [T]`` (each token's index in ``order``; a base token's: ``len(order)``)."""

    num_tokens: int
    order: Tensor
    segments: list[tuple[int, int, int]]
    block_slot: Tensor
    block_start: Tensor
    block_end: Tensor
    pad_index: Tensor
    inverse: Tensor
    pad_rows: Tensor
    slot_index: Tensor
    order_inverse: Tensor

    @classmethod
    def build(cls, token_slots: np.ndarray | list[int], device: torch.device) -> LoRAPlan:
        """The plan of per-token slots (host array, -1 = base model)."""
        slots = np.asarray(token_slots, dtype=np.int64)
        idx = np.nonzero(slots >= 0)[0]
        order = idx[np.argsort(slots[idx], kind="stable")]
        segments: list[tuple[int, int, int]] = []
        bs, bstart, bend = [], [], []
        start = 0
        sorted_slots = slots[order]
        for s in np.unique(sorted_slots):
            end = start + int(np.count_nonzero(sorted_slots == s))
            segments.append((int(s), start, end))
            for b0 in range(start, end, BLOCK_M):
                bs.append(int(s))
                bstart.append(b0)
                bend.append(min(b0 + BLOCK_M, end))
            start = end
        order_t = torch.from_numpy(order).to(device)
        lengths = [e - s for _, s, e in segments]
        width = max(lengths, default=0)
        if segments and len(idx) < len(slots) and all(n == width for n in lengths):
            width += 1  # base tokens need a padding row to point at
        pad = np.zeros((len(segments), width), dtype=np.int64)
        inverse = np.zeros(len(slots), dtype=np.int64)
        is_pad = np.ones(len(segments) * width, dtype=bool)
        for i, (_, s0, s1) in enumerate(segments):
            pad[i, : s1 - s0] = order[s0:s1]
            inverse[order[s0:s1]] = np.arange(i * width, i * width + s1 - s0)
            is_pad[i * width : i * width + s1 - s0] = False
        pad_rows = np.nonzero(is_pad)[0]
        if len(pad_rows):
            inverse[slots < 0] = pad_rows[0]
        order_inverse = np.full(len(slots), len(order), dtype=np.int64)
        order_inverse[order] = np.arange(len(order))
        return cls(
            num_tokens=len(slots),
            order=order_t,
            segments=segments,
            block_slot=torch.tensor(bs, dtype=torch.int32, device=device),
            block_start=torch.tensor(bstart, dtype=torch.int32, device=device),
            block_end=torch.tensor(bend, dtype=torch.int32, device=device),
            pad_index=torch.from_numpy(pad).to(device),
            inverse=torch.from_numpy(inverse).to(device),
            pad_rows=torch.from_numpy(pad_rows).to(device),
            slot_index=torch.tensor([s for s, _, _ in segments], dtype=torch.int64, device=device),
            order_inverse=torch.from_numpy(order_inverse).to(device),
        )

    @property
    def empty(self) -> bool:
        return not self.segments

    def to(self, device: torch.device) -> LoRAPlan:
        """The same plan with its tensors on ``device`` (a tensor-parallel worker's copy)."""
        return LoRAPlan(
            num_tokens=self.num_tokens,
            order=self.order.to(device),
            segments=list(self.segments),
            block_slot=self.block_slot.to(device),
            block_start=self.block_start.to(device),
            block_end=self.block_end.to(device),
            pad_index=self.pad_index.to(device),
            inverse=self.inverse.to(device),
            pad_rows=self.pad_rows.to(device),
            slot_index=self.slot_index.to(device),
            order_inverse=self.order_inverse.to(device),
        )


PER_SLOT_MIN_TOKENS = 64
"""Segments this long (prefill) run slot by slot at each slot's own rank: the extra operations are amortised,
and no FLOPs are spent on rank padding. Shorter ones (decode) run batched over the padded layout."""


def add_lora_torch(y: Tensor, x: Tensor, plan: LoRAPlan, w: LoRAWeights) -> Tensor:
    """``y [T, out]`` += each token's adapter delta (module docstring), in place; returns ``y``."""
    if plan.pad_index.shape[1] >= PER_SLOT_MIN_TOKENS:
        return _add_per_slot(y, x, plan, w)
    return _add_batched(y, x, plan, w)


def _add_per_slot(y: Tensor, x: Tensor, plan: LoRAPlan, w: LoRAWeights) -> Tensor:
    """Each slot's tokens times its factors at its real rank per part, the scale applied to ``A @ x``; each
    part's deltas written in ``order``'s order into one buffer (a zero row last, for base tokens) and added to
    the part's columns of ``y`` with one gather: no scatter, no concatenation."""
    total = plan.order.shape[0]
    bufs = [y.new_empty(total + 1, n) for n in w.sizes]
    for buf in bufs:
        buf[total].zero_()
    for (slot, start, end), rows in zip(plan.segments, plan.pad_index):
        ranks = w.ranks[slot]
        xs = x.index_select(0, rows[: end - start]) if any(ranks) else None
        for part, r in enumerate(ranks):
            if xs is None or r == 0:
                bufs[part][start:end].zero_()
                continue
            h = (xs @ w.a[slot, part, :r].t()).mul_(w.col_scale[slot, w.offsets[part]])
            torch.mm(h, w.b[part][slot, :, :r].t(), out=bufs[part][start:end])
    for part, buf in enumerate(bufs):
        off, n = w.offsets[part], w.sizes[part]
        out = y if len(bufs) == 1 else y[:, off : off + n]
        out.add_(buf.index_select(0, plan.order_inverse))
    return y


def _add_batched(y: Tensor, x: Tensor, plan: LoRAPlan, w: LoRAWeights) -> Tensor:
    """All slots at once over the padded layout, at the largest rank in use (zero padding adds zeros). Each
    slot's scale is applied to ``A @ x`` (the narrow intermediate); padding rows of it are zeroed, so every
    token's row of ``B @ (A @ x)`` in the layout is its delta (a base token's: zeros), added to each part's
    columns of ``y`` with one gather: no scatter, no concatenation."""
    slots = [s for s, _, _ in plan.segments]
    r = max((max(w.ranks[s]) for s in slots), default=0)
    if r == 0:
        return y
    num, width = plan.pad_index.shape
    parts = len(w.sizes)
    every = slots == list(range(w.a.shape[0]))
    a = w.a if every else w.a.index_select(0, plan.slot_index)
    xs = x.index_select(0, plan.pad_index.view(-1)).view(num, width, -1)
    h = torch.bmm(xs, a[:, :, :r].reshape(num, parts * r, -1).transpose(1, 2))  # [S, M, parts * r]
    scale = w.scale if every else w.scale.index_select(0, plan.slot_index)
    h.view(num, width, parts, r).mul_(scale.to(h.dtype)[:, None, :, None])
    if plan.pad_rows.shape[0]:
        h.view(num * width, -1).index_fill_(0, plan.pad_rows, 0.0)
    for p in range(parts):
        b = w.b[p] if every else w.b[p].index_select(0, plan.slot_index)
        delta = torch.bmm(h[:, :, p * r : (p + 1) * r], b[:, :, :r].transpose(1, 2))  # [S, M, sizes[p]]
        off, n = w.offsets[p], w.sizes[p]
        out = y if parts == 1 else y[:, off : off + n]
        out.add_(delta.view(num * width, n).index_select(0, plan.inverse))
    return y


def lora_reference(y: Tensor, x: Tensor, token_slots: Tensor, w: LoRAWeights) -> Tensor:
    """The definition, token by token in float64: a new ``y`` (float64) with every token's delta added."""
    out = y.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        for part, size in enumerate(w.sizes):
            a = w.a[s, part].double()
            b = w.b[part][s].double()
            off = w.offsets[part]
            out[t, off : off + size] += (b @ (a @ x[t].double())) * float(w.scale[s, part])
    return out
