"""The torch backend: every paged-attention operation in plain torch. This is the engine's CPU path (and also
runs on CUDA, where the Triton kernels are preferred); its semantics are :mod:`.reference`'s.

Written for speed on the CPU: K/V are gathered once per call with ``index_select`` (optionally into a reusable
:class:`Workspace`, which saves allocating — and page-faulting — tens of MB per layer on CPU), never converted
to float32 as a copy, and attention runs in ``torch.nn.functional.scaled_dot_product_attention`` (the fused CPU
flash kernel: float32 softmax and accumulation, GQA without repeating K/V) on strided views of the gathered
blocks. There is no Python loop per token; prefill loops over sequences only when padding them into one
batch would waste more than it saves (:func:`_padding_buckets`), decode reads a prefix shared by a group of
sequences once for the whole group (cascade attention, :func:`_decode_cascade`), and a decode batch of very
different context lengths runs in groups of similar length so padding never reads over 25% more blocks than
needed (:func:`_decode_groups`).

Attention options (an :class:`.options.AttentionOptions` with a ``sliding_window``, ``softcap`` or ``sinks``;
semantics in :mod:`.reference`) take one general
path, :func:`_prefill_padded` with an explicit mask: a window narrows the keys gathered per sequence to the
blocks its queries can see (blocks before every query's window are not read, nor are their block-table
entries) and goes into SDPA's mask; soft-capping and sinks, which SDPA cannot express, compute the scores
explicitly (:func:`_attend_explicit`). Without options every call runs exactly as it did before they existed.

KV cache layout: see :mod:`batchgen.kernels`. Every query attends to at least one key (``seq_lens >= 1``), so no
softmax row is empty; positions past a sequence's length are masked out and never reach the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernel, cpu_ops
from .kv_cache_dtype import store_rows
from .options import AttentionOptions
from .paged_kv import PagedKV

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
# The CPU flash-attention op behind SDPA, which also returns the log-sum-exp: lets a chunk after a cached
# prefix run as two unmasked calls (prefix, then the causal square) merged exactly, instead of one masked call
# that computes every masked score and reads a mask. Private API: any failure falls back to the masked call.
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class Workspace:
    """Reusable scratch buffers for gathered K/V (one per name; grown by 25 % headroom when too small).

    Not thread-safe: one workspace per engine (``PagedAttention`` owns one). A buffer handed out stays valid
    until the next :meth:`get` of the same name.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        self.cascade: CascadeMemo | None = None
        """The last decode step's kernel-path cascade plan (:func:`_decode_cascade`)."""

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel + numel // 4, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the paged caches at ``slot_mapping`` ``[T]`` (−1 = skip)."""
    if key.shape[0] == 0:
        return
    slots = slot_mapping.long()
    if cpu_ops.store_kv(key, value, k_cache, v_cache, slots):  # float32: one C pass
        return
    store_rows(key, value, k_cache, v_cache, slots)  # rounded into a narrow cache (kv_cache_dtype.py)


def _gather(
    cache: Tensor, block_ids: Tensor, name: str, workspace: Workspace | None
) -> Tensor:  # [n, block_size, Hkv, D]
    """Gather the blocks ``block_ids`` (any int dtype, any shape) of ``cache`` into one contiguous tensor."""
    idx = block_ids.reshape(-1)
    if workspace is None:
        return cache.index_select(0, idx)
    out = workspace.get(name, (idx.numel(), *cache.shape[1:]), cache.dtype, cache.device)
    return torch.index_select(cache, 0, idx, out=out)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool = False) -> Tensor:
    """``q [B,Hq,Q,D]``, ``k/v [B,Hkv,L,D]`` (any strides) → ``[B,Hq,Q,D]`` in float32 accumulation.

    ``mask`` is boolean (True = attend), broadcastable to ``[B,Hq,Q,L]``.
    """
    if q.dtype != k.dtype:  # mixed precision: compute in float32, as the kernels do
        q, k, v = q.float(), k.float(), v.float()
    hq, hkv = q.shape[1], k.shape[1]
    if hq == hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = hq // hkv  # torch < 2.5: repeat K/V per query head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def paged_decode_attention(
    q: Tensor,
    kv: PagedKV,
    options: AttentionOptions,
    *,
    workspace: Workspace | None = None,
    plan_cache: dict | None = None,
    new_kv: cpu_kernel.NewKV | None = None,
) -> Tensor:
    """One query per sequence (the token at position ``kv.seq_lens[b] - 1``) attending to its whole context.

    ``q [B,Hq,D]`` → ``[B,Hq,D]``. Sequences are padded to the longest context (padding keys masked), in
    groups of similar context when one padded batch would read over 25% more blocks than needed
    (:func:`_decode_groups`). With an option set, the general masked path (no cascade). Given a ``workspace``
    (the engine's CPU call) and float32 tensors, the C kernel of :mod:`.cpu_kernel` runs instead (same
    semantics; ``BATCHGEN_CPU_KERNEL=0`` turns it off), through the cascade when shared prefixes save enough
    reads (``cpu_kernel.CASCADE_MIN_SAVED``).

    ``new_kv``: the step's own K/V, not yet in the cache (``kv`` does count them in ``seq_lens``): the C
    kernel writes them in the pass that attends (the cache lines are fetched once); every other path stores
    them first.
    """
    k_cache, v_cache, block_tables, seq_lens = kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return q.new_empty(q.shape)
    # The engine's CPU call (it passes a workspace) goes to the C kernel, which reads blocks in place, unless
    # shared prefixes cut the blocks read enough for the cascade (both halves in C; kernels/cpu_kernel.py).
    kernel = workspace is not None and cpu_kernel.serves(q, k_cache, v_cache)
    if not kernel:
        _store_new(new_kv, kv)
    scale = options.scale
    block_size = k_cache.shape[1]
    lens = seq_lens.to(q.device)
    if options.plain and batch >= 2 * _CASCADE_MIN_GROUP:
        min_saved = cpu_kernel.CASCADE_MIN_SAVED if kernel else _CASCADE_MIN_SAVED
        out = _decode_cascade(q, kv, scale, workspace, plan_cache, min_saved, kernel, new_kv)
        if out is not None:
            return out
    if kernel:
        out = cpu_kernel.decode(q, kv, options, new_kv)
        if out is not None:
            return out
    _store_new(new_kv, kv)
    if not options.plain:
        cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        return _prefill_padded(q, cu, kv, options, workspace)
    plan = _decode_plan(block_tables, lens, block_size, plan_cache)
    if len(plan.groups) == 1:
        _, _, ids, max_len, mask = plan.groups[0]
        return _decode_padded(q, k_cache, v_cache, ids, max_len, mask, scale, workspace)
    qs = q.index_select(0, plan.order)  # sequences sorted by group: every group is a slice
    out = torch.empty_like(qs)
    for start, end, ids, max_len, mask in plan.groups:
        out[start:end] = _decode_padded(qs[start:end], k_cache, v_cache, ids, max_len, mask, scale, workspace)
    return out.index_select(0, plan.inverse)


def _store_new(new_kv: cpu_kernel.NewKV | None, kv: PagedKV) -> None:
    """Store ``new_kv`` in ``kv``'s caches unless a kernel already has."""
    if new_kv is not None and not new_kv.written:
        store_kv(new_kv.key, new_kv.value, kv.k_cache, kv.v_cache, new_kv.slots)
        new_kv.written = True


_DECODE_PAD_SLACK = 1.25
"""A decode group is padded to its longest context: it may read at most this many times its members' blocks."""


def _decode_groups(lens: list[int], block_size: int) -> list[list[int]] | None:
    """Sequences grouped by context length, longest first, so that padding each group to its longest context
    reads at most :data:`_DECODE_PAD_SLACK` times the blocks its members need; None when the whole batch
    already does (one padded call)."""
    blocks = [(n + block_size - 1) // block_size for n in lens]
    if max(blocks) * len(blocks) <= _DECODE_PAD_SLACK * sum(blocks):
        return None
    groups: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for b in sorted(range(len(lens)), key=blocks.__getitem__, reverse=True):
        if cur and blocks[cur[0]] * (len(cur) + 1) > _DECODE_PAD_SLACK * (total + blocks[b]):
            groups.append(cur)
            cur, total = [], 0
        cur.append(b)
        total += blocks[b]
    groups.append(cur)
    return groups


@dataclass
class _DecodePlan:
    """How a decode batch is attended, the same for every layer of a forward: ``groups`` of
    ``(start, end, block ids, max_len, padding mask or None)`` over the batch reordered by ``order`` (the
    identity, and one group, when the batch is attended in one padded call); ``inverse`` undoes ``order``."""

    groups: list[tuple[int, int, Tensor, int, Tensor | None]]
    order: Tensor | None = None
    inverse: Tensor | None = None


def _decode_plan(block_tables: Tensor, lens: Tensor, block_size: int, plan_cache: dict | None) -> _DecodePlan:
    """The batch's :class:`_DecodePlan` (computed once per forward when ``plan_cache`` is given)."""
    if plan_cache is not None and "decode_plan" in plan_cache:
        return plan_cache["decode_plan"]
    lens_list = lens.tolist()
    grouping = _decode_groups(lens_list, block_size)
    if grouping is None:
        plan = _DecodePlan([(0, len(lens_list), *_padding(block_tables, lens, lens_list, block_size))])
    else:
        flat = [b for g in grouping for b in g]
        order = torch.tensor(flat, device=lens.device)
        tables, lens_sorted = block_tables[order.to(block_tables.device)], lens[order]
        groups, start = [], 0
        for g in grouping:
            end = start + len(g)
            sub = _padding(tables[start:end], lens_sorted[start:end], [lens_list[b] for b in g], block_size)
            groups.append((start, end, *sub))
            start = end
        plan = _DecodePlan(groups, order, torch.argsort(order))
    if plan_cache is not None:
        plan_cache["decode_plan"] = plan
    return plan


def _padding(
    block_tables: Tensor, lens: Tensor, lens_list: list[int], block_size: int
) -> tuple[Tensor, int, Tensor | None]:
    """(block ids ``[B, blocks]``, max_len, boolean mask ``[B,1,1,max_len]`` or None) of a padded batch."""
    max_len, min_len = max(lens_list), min(lens_list)
    ids = block_tables[:, : (max_len + block_size - 1) // block_size]
    mask = None
    if min_len != max_len:
        pos = torch.arange(max_len, device=lens.device)
        mask = (pos[None, :] < lens[:, None]).view(len(lens_list), 1, 1, max_len)
    return ids, max_len, mask


def _decode_padded(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    ids: Tensor,
    max_len: int,
    mask: Tensor | None,
    scale: float,
    workspace: Workspace | None,
) -> Tensor:
    """Decode attention of a batch padded to ``max_len`` keys (``mask``: the real ones): one gather of the
    blocks ``ids``, one SDPA call. The ``group`` query heads of a KV head attend as ``group`` queries of that
    head (GQA without repeating K/V, and faster on the CPU than SDPA's ``enable_gqa``)."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    shape = (batch, ids.shape[1] * block_size, num_kv_heads, head_dim)
    # [B, L, Hkv, D] -> strided [B, Hkv, L, D] views: no copy beyond the gather itself.
    k = _gather(k_cache, ids, "k", workspace).view(shape)[:, :max_len].transpose(1, 2)
    v = _gather(v_cache, ids, "v", workspace).view(shape)[:, :max_len].transpose(1, 2)
    if q.dtype == k.dtype:
        qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    else:
        out = _sdpa(q.unsqueeze(2), k, v, mask, scale)  # [B, Hq, 1, D]
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


_CASCADE_MIN_GROUP = 4  # sequences that must share a prefix before it is read once for all of them
_CASCADE_MIN_SAVED = 0.25  # share of the blocks read that cascade must save (against the padded torch path)


def _shared_prefixes(
    block_tables: Tensor, visible: Tensor, block_size: int
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Groups of >= _CASCADE_MIN_GROUP sequences whose block tables start with the same physical blocks.

    ``visible[B]``: the keys every query of a sequence sees (decode: its length - 1; prefill: its context
    before the chunk); a shared prefix holds only whole blocks of those, so every query sees all of it and every
    sequence keeps at least its own last key. Sequences that see no whole block share nothing. Returns
    ``start[B]`` (leading blocks each sequence shares with its group, 0 if none) and the groups, in the order of
    their first block id, as ``(sequence indices in increasing order, shared block ids)``. Computed on the host
    in a few array operations for the whole batch (it runs once per step on the engine's critical path)."""
    device = block_tables.device
    full = (visible // block_size).cpu().numpy()
    start = np.zeros(block_tables.shape[0], dtype=np.int64)
    groups: list[tuple[Tensor, Tensor]] = []
    cand = np.flatnonzero(full > 0)
    if cand.size >= _CASCADE_MIN_GROUP:
        tables = block_tables.cpu().numpy()
        _, group_of, counts = np.unique(tables[cand, 0], return_inverse=True, return_counts=True)
        big = counts[group_of] >= _CASCADE_MIN_GROUP
        cand, group_of = cand[big], group_of[big]
    if cand.size >= _CASCADE_MIN_GROUP:
        present, first = np.unique(group_of, return_index=True)
        leader = np.zeros(counts.size, dtype=np.int64)
        leader[present] = cand[first]
        limit = np.full(counts.size, tables.shape[1], dtype=np.int64)
        np.minimum.at(limit, group_of, full[cand])  # every member sees the prefix
        lim = limit[group_of]
        width = int(lim.max())
        differs = tables[cand, :width] != tables[leader[group_of], :width]
        differs |= np.arange(width)[None, :] >= lim[:, None]
        # the leading blocks each member shares with its group's leader
        common = np.where(differs.any(1), differs.argmax(1), width)
        shared = np.full(counts.size, width, dtype=np.int64)
        np.minimum.at(shared, group_of, common)
        for g in present[shared[present] > 0]:
            idx = cand[group_of == g]
            start[idx] = shared[g]
            blocks = tables[leader[g], : shared[g]].copy()
            groups.append((torch.from_numpy(idx).to(device), torch.from_numpy(blocks).to(device)))
    return torch.from_numpy(start).to(device), groups


def _run_or_ids(ids: Tensor) -> Tensor | slice:
    """``ids`` as a slice when they are consecutive block ids (then the blocks are read in place, without a
    copy), else unchanged."""
    if ids.device.type != "cpu" or not ids.numel():
        return ids
    a = ids.numpy()
    if int(a[-1]) - int(a[0]) == a.size - 1 and bool((np.diff(a) == 1).all()):
        return slice(int(a[0]), int(a[0]) + a.size)
    return ids


def _read_blocks(cache: Tensor, blocks: Tensor | slice) -> Tensor:
    """The blocks ``blocks`` (ids, or a slice of consecutive ones) of ``cache``, ``[n, block_size, Hkv, D]``."""
    return cache[blocks] if isinstance(blocks, slice) else cache.index_select(0, blocks)


@dataclass
class CascadePlan:
    """One forward's cascade grouping (it depends only on the batch, so every layer shares it).

    ``groups``: (sequence indices, the group's shared prefix block ids, or a slice of consecutive ones);
    ``starts``: each sequence's first key position of its own suffix ``[B]`` (0 outside groups); for the torch
    suffix path, ``ids`` (suffix block ids ``[B, S]``) and ``mask`` (additive, ``[B,1,1,S*block_size]``), None
    when the C kernel reads the suffixes in place; ``prefix``: the groups as the C kernel's prefix half takes
    them (with the kernel only)."""

    groups: list[tuple[Tensor, Tensor | slice]]
    starts: Tensor
    ids: Tensor | None
    mask: Tensor | None
    prefix: cpu_kernel.PrefixGroups | None = None


def _cascade_plan(
    block_tables: Tensor,
    lens: Tensor,
    block_size: int,
    dtype: torch.dtype,
    min_saved: float = _CASCADE_MIN_SAVED,
    kernel: bool = False,
) -> CascadePlan | None:
    """The plan, or None when sharing would not pay (saves under ``min_saved`` of the blocks read).
    ``kernel``: both halves will run in the C kernel (no suffix gather to plan), and a group goes through the
    cascade only when it saves at least ``cpu_kernel.CASCADE_MIN_GROUP_BLOCKS`` block reads; its sequences are
    read whole otherwise."""
    start, groups = _shared_prefixes(block_tables, lens - 1, block_size)
    if kernel:
        small = [g for g in groups if (g[0].numel() - 1) * g[1].numel() < cpu_kernel.CASCADE_MIN_GROUP_BLOCKS]
        for idx, _ in small:
            start[idx] = 0
        groups = [g for g in groups if not any(g is x for x in small)]
    if not groups:
        return None
    total_blocks = (lens + block_size - 1) // block_size
    saved = sum((idx.numel() - 1) * blocks.numel() for idx, blocks in groups)
    if saved < min_saved * int(total_blocks.sum()):  # too few blocks saved: not worth it
        return None
    starts = (start * block_size).to(torch.int32)
    if kernel:  # (the groups' blocks are read by the C kernel; as ids only where it refuses the call)
        return CascadePlan(groups, starts, None, None, cpu_kernel.PrefixGroups.build(groups))
    groups = [(idx, _run_or_ids(blocks)) for idx, blocks in groups]
    batch = block_tables.shape[0]
    num_suffix = int((total_blocks - start).max())
    arange = torch.arange(num_suffix, device=block_tables.device)
    cols = (start[:, None] + arange[None, :]).clamp_(max=block_tables.shape[1] - 1)
    ids = block_tables.gather(1, cols)
    pos = (
        start[:, None] * block_size
        + torch.arange(num_suffix * block_size, device=block_tables.device)[None, :]
    )
    mask = torch.zeros(batch, 1, 1, pos.shape[1], dtype=dtype, device=block_tables.device)
    mask.masked_fill_((pos >= lens[:, None]).view(batch, 1, 1, -1), float("-inf"))
    return CascadePlan(groups, starts, ids, mask)


@dataclass
class CascadeMemo:
    """A kernel-path cascade plan kept from one decode step to the next (:attr:`Workspace.cascade`), with what
    it was computed from: the batch's first block per row, and ``held`` ``[B, W]``, each row's shared prefix
    blocks (-1 past them); without a plan, the whole blocks each row saw (``seen``)."""

    first: np.ndarray
    held: np.ndarray
    seen: np.ndarray | None
    min_saved: float
    plan: CascadePlan | None

    @classmethod
    def of(
        cls, tables: np.ndarray, seen: np.ndarray, min_saved: float, plan: CascadePlan | None
    ) -> CascadeMemo:
        width = max((int(ids.numel()) for _, ids in plan.groups), default=0) if plan is not None else 0
        held = np.full((tables.shape[0], width), -1, dtype=tables.dtype)
        for idx, ids in plan.groups if plan is not None else ():
            held[idx.numpy(), : ids.numel()] = ids.numpy()
        return cls(tables[:, 0].copy(), held, None if plan is not None else seen.copy(), min_saved, plan)

    def fits(self, tables: np.ndarray, seen: np.ndarray, min_saved: float) -> bool:
        """Whether the plan is this batch's: the same rows (first blocks), each still holding its group's prefix
        blocks (its own blocks appended since do not change the groups; a row that joins a group waits for the
        batch to change), and, where there was no plan, no row seeing a new whole block (one could make
        sharing pay)."""
        if min_saved != self.min_saved or tables.shape[0] != self.first.shape[0] or not tables.shape[1]:
            return False
        if not np.array_equal(tables[:, 0], self.first):
            return False
        if self.seen is not None:
            return np.array_equal(seen, self.seen)
        width = self.held.shape[1]
        if width > tables.shape[1]:
            return False
        head = tables[:, :width]
        return bool(((head == self.held) | (self.held < 0)).all())


def _decode_cascade(
    q: Tensor,
    kv: PagedKV,
    scale: float,
    workspace: Workspace | None,
    plan_cache: dict | None = None,
    min_saved: float = _CASCADE_MIN_SAVED,
    kernel: bool = False,
    new_kv: cpu_kernel.NewKV | None = None,
) -> Tensor | None:
    """Decode attention that reads a prefix shared by a group of sequences once for the whole group.

    Each sequence attends to its own suffix (``kernel``: the C kernel, reading the suffix blocks in place;
    else one batched SDPA call over gathered suffix blocks) and, if in a group, to the group's shared prefix
    (``kernel``: one C call for every group, merging in place; else one CPU flash call per group with the
    group's queries stacked); the two partial results are merged by their log-sum-exps (cascade attention).
    Same result as the plain path up to float rounding; ``None`` when nothing is shared enough to pay off or
    the CPU flash op is unavailable. ``plan_cache`` (a dict living for one forward) lets
    all layers share the grouping.
    """
    k_cache, v_cache = kv.k_cache, kv.v_cache
    if _CPU_FLASH_WITH_LSE is None or q.device.type != "cpu" or (q.dtype != k_cache.dtype and not kernel):
        return None
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kv.num_kv_heads
    group = num_q_heads // num_kv_heads
    key = "decode_cascade_kernel" if kernel else "decode_cascade"
    if plan_cache is not None and key in plan_cache:
        plan = plan_cache[key]
    else:
        lens = kv.seq_lens.to(q.device).long()
        if kernel and workspace is not None and q.device.type == "cpu":  # decode steps of the same batch
            tables, seen = kv.block_tables.numpy(), ((lens - 1) // kv.block_size).numpy()
            memo = workspace.cascade
            if memo is not None and memo.fits(tables, seen, min_saved):
                plan = memo.plan
            else:
                plan = _cascade_plan(kv.block_tables, lens, kv.block_size, q.dtype, min_saved, kernel)
                workspace.cascade = CascadeMemo.of(tables, seen, min_saved, plan)
        else:
            plan = _cascade_plan(kv.block_tables, lens, kv.block_size, q.dtype, min_saved, kernel)
        if plan_cache is not None:
            plan_cache[key] = plan
    if plan is None:
        return None
    if kernel and plan.prefix is not None:  # both halves in C: suffixes in place, each prefix once per group
        res = cpu_kernel.decode_suffix(q, kv, scale, plan.starts, new_kv)
        if res is not None and cpu_kernel.merge_prefix(q, kv, scale, plan.prefix, *res):
            return res[0].to(q.dtype)
    _store_new(new_kv, kv)
    if q.dtype != k_cache.dtype:  # the flash op takes one dtype: the plain path widens a narrow cache
        return None
    # The `group` query heads of one kv head act as `group` queries of that head: GQA without repeating K/V.
    qg = q.view(batch, num_kv_heads, group, head_dim)
    try:
        suffix = _cascade_suffix(qg, q, kv, scale, plan, workspace, kernel)
        if suffix is None:
            return None
        out, lse = suffix
        for idx, blocks in plan.groups:
            n = idx.numel()
            pk = _read_blocks(k_cache, blocks).view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
            pv = _read_blocks(v_cache, blocks).view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
            pq = qg[idx].transpose(0, 1).reshape(1, num_kv_heads, n * group, head_dim)
            po, plse = _CPU_FLASH_WITH_LSE(pq, pk, pv, 0.0, False, attn_mask=None, scale=scale)[:2]
            po = po.float().view(num_kv_heads, n, group, head_dim).transpose(0, 1)
            plse = plse.view(num_kv_heads, n, group).transpose(0, 1)
            out[idx] = _merge_by_lse(out[idx], lse[idx], po, plse)
    except (RuntimeError, TypeError):  # a torch whose CPU flash op refuses these inputs
        return None
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def _cascade_suffix(
    qg: Tensor,
    q: Tensor,
    kv: PagedKV,
    scale: float,
    plan: CascadePlan,
    workspace: Workspace | None,
    kernel: bool,
) -> tuple[Tensor, Tensor] | None:
    """Every sequence over its own suffix: ``(out [B,Hkv,G,D] float32, lse [B,Hkv,G])``."""
    batch, num_kv_heads, group, head_dim = qg.shape
    if kernel:
        res = cpu_kernel.decode_suffix(q, kv, scale, plan.starts)
        if res is None:
            return None
        out, lse = res
        return out.view(batch, num_kv_heads, group, head_dim), lse.view(batch, num_kv_heads, group)
    assert plan.ids is not None
    shape = (batch, plan.ids.shape[1] * kv.block_size, num_kv_heads, head_dim)
    k = _gather(kv.k_cache, plan.ids, "k", workspace).view(shape).transpose(1, 2)
    v = _gather(kv.v_cache, plan.ids, "v", workspace).view(shape).transpose(1, 2)
    out, lse = _CPU_FLASH_WITH_LSE(qg, k, v, 0.0, False, attn_mask=plan.mask, scale=scale)[:2]
    return out.float(), lse


def paged_prefill_attention(
    q: Tensor,
    cu_seqlens_q: Tensor,
    kv: PagedKV,
    options: AttentionOptions,
    *,
    workspace: Workspace | None = None,
    key_end: Tensor | None = None,
) -> Tensor:
    """Variable-length query chunks attending causally to their cached context plus themselves.

    Sequence ``b`` owns queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` at absolute positions
    ``kv.seq_lens[b] - q_len_b .. kv.seq_lens[b] - 1``; a query at position ``p`` attends to keys ``0..p``,
    all read from the paged cache (the new tokens' K/V must already be stored). ``q [T,Hq,D]`` → ``[T,Hq,D]``.
    Given a ``workspace`` (the engine's CPU call), chunks of sequences that share a cached prefix attend to it
    once per group (:func:`_prefill_cascade`).

    ``key_end [T]`` (int64, absolute positions): query ``t`` at position ``p`` attends to keys
    ``< max(p + 1, key_end[t])`` instead (a window still bounds them from below): a token inside a span of
    its own chunk that attends bidirectionally sees the whole span. ``key_end[t] <= kv.seq_lens[b]``.
    """
    total = q.shape[0]
    batch = cu_seqlens_q.numel() - 1
    if total == 0 or batch == 0:
        return q.new_empty(q.shape)
    if key_end is not None:  # spans seen bidirectionally: the masked path, whatever the options
        return _prefill_padded(q, cu_seqlens_q, kv, options, workspace, key_end)
    plain = options.plain
    cu = cu_seqlens_q.tolist()
    lens = kv.seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(batch)]
    if plain and workspace is not None:  # the engine's call: the C kernel where it serves
        if batch >= _CASCADE_MIN_GROUP:
            out = _prefill_cascade(q, cu, q_lens, lens, kv, options)
            if out is not None:
                return out
        res = cpu_kernel.prefill(q, cu_seqlens_q, kv, options.scale)
        if res is not None:
            return res[0].to(q.dtype)
    return _prefill_ordinary(q, cu_seqlens_q, cu, q_lens, lens, kv, options, workspace)


def _prefill_ordinary(
    q: Tensor,
    cu_seqlens_q: Tensor,
    cu: list[int],
    q_lens: list[int],
    lens: list[int],
    kv: PagedKV,
    options: AttentionOptions,
    workspace: Workspace | None,
) -> Tensor:
    """:func:`paged_prefill_attention` without the cascade: sequences bucketed by :func:`_padding_buckets`,
    a bucket of one run alone, the others padded."""
    batch, plain = len(q_lens), options.plain
    buckets = _padding_buckets(q_lens, lens)
    if len(buckets) == 1 and len(buckets[0]) == batch and (batch > 1 or not plain):
        return _prefill_padded(q, cu_seqlens_q, kv, options, workspace)
    out = torch.empty_like(q)
    for bucket in buckets:
        if len(bucket) == 1 and plain:
            b = bucket[0]
            s, e = cu[b], cu[b + 1]
            out[s:e] = _prefill_one(
                q[s:e], kv.k_cache, kv.v_cache, lens[b], kv.block_tables[b], options.scale, workspace
            )
            continue
        rows, tokens, sub_cu_q = _subset(bucket, cu, q_lens, q.device)
        out[tokens] = _prefill_padded(q[tokens], sub_cu_q, kv.select(rows), options, workspace)
    return out


def _prefill_cascade(
    q: Tensor,
    cu: list[int],
    q_lens: list[int],
    lens: list[int],
    kv: PagedKV,
    options: AttentionOptions,
) -> Tensor | None:
    """Prefill chunks of sequences that share a cached prefix, with that prefix attended once per group and
    each sequence's own keys after it attended as an ordinary prefill, all by the C kernel; the halves merged
    by their log-sum-exps. Sequences outside the groups take the ordinary path. None when the kernel cannot
    serve the call or no group shares enough (under ``cpu_kernel.CASCADE_MIN_SAVED`` of the query x key
    work)."""
    if not cpu_kernel.serves(q, kv.k_cache, kv.v_cache):
        return None
    block_size = kv.block_size
    visible = torch.tensor([n - m for n, m in zip(lens, q_lens)])
    start, groups = _shared_prefixes(kv.block_tables, visible, block_size)
    if not groups:
        return None
    start_list = start.tolist()
    shared = sum(q_lens[b] * start_list[b] * block_size for b in range(len(lens)))
    if shared < cpu_kernel.CASCADE_MIN_SAVED * sum(m * n for m, n in zip(q_lens, lens)):
        return None
    members = [b for b in range(len(lens)) if start_list[b] > 0 and q_lens[b] > 0]
    others = [b for b in range(len(lens)) if start_list[b] == 0 and q_lens[b] > 0]
    out = torch.empty_like(q)
    if others:
        rows, tokens, sub_cu = _subset(others, cu, q_lens, q.device)
        res = cpu_kernel.prefill(q[tokens], sub_cu, kv.select(rows), options.scale)
        if res is None:
            return None
        out[tokens] = res[0].to(q.dtype)
    rows, tokens, sub_cu = _subset(members, cu, q_lens, q.device)
    suffix_kv = _after_prefix(kv, rows, start[rows.to(start.device)])
    qm = q[tokens]
    res = cpu_kernel.prefill(qm, sub_cu, suffix_kv, options.scale, with_lse=True)
    if res is None:
        return None
    part, part_lse = res  # [Tm, Hq, D], [Tm, Hq] float32
    # The prefix half, token by token: each member token (numbered within qm) is a query row of its group.
    local = dict(zip(tokens.tolist(), range(tokens.numel())))
    rows_of = [
        [local[t] for b in idx.tolist() if q_lens[b] > 0 for t in range(cu[b], cu[b + 1])]
        for idx, _ in groups
    ]
    prefix_groups = cpu_kernel.PrefixGroups.build(
        [(torch.tensor(r, dtype=torch.long), blocks) for r, (_, blocks) in zip(rows_of, groups)]
    )
    if not cpu_kernel.merge_prefix(qm, kv, options.scale, prefix_groups, part, part_lse):
        return None
    out[tokens] = part.to(q.dtype)
    return out


def _after_prefix(kv: PagedKV, rows: Tensor, skip: Tensor) -> PagedKV:
    """Sequences ``rows`` of ``kv`` without their first ``skip[i]`` blocks: block tables shifted past them,
    lengths shortened by them (query positions shift alike, so causality is unchanged)."""
    tables, width = kv.block_tables, kv.block_tables.shape[1]
    skip = skip.to(tables.device)
    cols = (skip[:, None] + torch.arange(width, device=tables.device)[None, :]).clamp_(max=width - 1)
    lens = kv.seq_lens[rows.to(kv.seq_lens.device)] - (skip * kv.block_size).to(kv.seq_lens.device).int()
    return PagedKV(kv.k_cache, kv.v_cache, tables[rows.to(tables.device)].gather(1, cols), lens)


def _subset(
    seqs: list[int], cu: list[int], q_lens: list[int], device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(sequence indices, their token indices in the packed queries, their cu_seqlens) for a subset, on
    ``device``."""
    rows = torch.tensor(seqs, dtype=torch.long, device=device)
    tokens = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in seqs]).to(device)
    sub = [0]
    for b in seqs:
        sub.append(sub[-1] + q_lens[b])
    return rows, tokens, torch.tensor(sub, dtype=torch.int32, device=device)


_CALL_OVERHEAD = 2048
"""One more attention call's fixed cost, in query x key pairs (tuned on the benchmark model, 8 heads of 64:
about 0.1 ms of the CPU flash op)."""


def _padding_buckets(q_lens: list[int], lens: list[int]) -> list[list[int]]:
    """Group sequences (longest chunks first) so that padding a group to its longest chunk and context at most
    doubles the work of each member; a group of one runs unpadded. Empty chunks are left out.

    A member's work alone is what its own call computes: its chunk x its context, less the half of the chunk's
    causal square the flash op skips unmasked, plus one call's fixed cost (`_CALL_OVERHEAD`). In a padded
    group every member costs the group's longest chunk x longest context, masked: a fresh prompt there costs
    its whole square, so long fresh prompts run alone and short ones together."""
    order = sorted(
        (b for b in range(len(q_lens)) if q_lens[b] > 0), key=lambda b: (q_lens[b], lens[b]), reverse=True
    )
    buckets: list[list[int]] = []
    cur: list[int] = []
    max_q = max_len = least = 0  # least: the smallest work alone in the group
    for b in order:
        work = q_lens[b] * lens[b] - q_lens[b] * q_lens[b] // 2 + _CALL_OVERHEAD
        mq, ml = max(max_q, q_lens[b]), max(max_len, lens[b])
        if cur and mq * ml <= 2 * min(least, work):
            cur.append(b)
            max_q, max_len, least = mq, ml, min(least, work)
            continue
        if cur:
            buckets.append(cur)
        cur, max_q, max_len, least = [b], q_lens[b], lens[b], work
    if cur:
        buckets.append(cur)
    return buckets


def _prefill_one(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_len: int,
    block_table: Tensor,
    scale: float,
    workspace: Workspace | None,
) -> Tensor:
    """One sequence: ``q [n,Hq,D]`` at positions ``seq_len-n .. seq_len-1`` → ``[n,Hq,D]``."""
    n, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:num_blocks]
    shape = (1, num_blocks * block_size, num_kv_heads, head_dim)
    k = _gather(k_cache, ids, "k", workspace).view(shape)[:, :seq_len].transpose(1, 2)
    v = _gather(v_cache, ids, "v", workspace).view(shape)[:, :seq_len].transpose(1, 2)
    qb = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    ctx = seq_len - n
    if ctx == 0:  # square causal: SDPA's own (top-left aligned) causal mask is exact and skips masked tiles
        out = _sdpa(qb, k, v, None, scale, causal=True)
    else:
        out = _prefix_then_causal(qb, k, v, ctx, scale)
        if out is None:
            q_pos = ctx + torch.arange(n, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            out = _sdpa(qb, k, v, mask, scale)
    return out[0].transpose(0, 1).to(q.dtype)


def _prefix_then_causal(q: Tensor, k: Tensor, v: Tensor, ctx: int, scale: float) -> Tensor | None:
    """``q [1,Hq,n,D]`` at positions ``ctx..ctx+n-1`` over ``k/v [1,Hkv,ctx+n,D]``: attention to the prefix
    (no mask) and to the new tokens (causal square) merged by their log-sum-exps, in float32. ``None`` when
    the CPU flash op is unavailable or refuses the inputs."""
    if _CPU_FLASH_WITH_LSE is None or q.device.type != "cpu" or q.dtype != k.dtype:
        return None
    try:
        o1, lse1 = _CPU_FLASH_WITH_LSE(
            q, k[:, :, :ctx], v[:, :, :ctx], 0.0, False, attn_mask=None, scale=scale
        )[:2]
        o2, lse2 = _CPU_FLASH_WITH_LSE(
            q, k[:, :, ctx:], v[:, :, ctx:], 0.0, True, attn_mask=None, scale=scale
        )[:2]
    except (RuntimeError, TypeError):  # e.g. a torch without GQA support in the op
        return None
    return _merge_by_lse(o1, lse1, o2, lse2)


def _merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Combine two softmax-normalised attention outputs over disjoint key sets, ``o [..., D]`` with their
    log-sum-exps ``lse [...]``, into the attention over the union (float32)."""
    m = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - m).unsqueeze(-1)
    w2 = torch.exp(lse2 - m).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


def _prefill_padded(
    q: Tensor,
    cu_seqlens_q: Tensor,
    kv: PagedKV,
    options: AttentionOptions,
    workspace: Workspace | None,
    key_end: Tensor | None = None,
) -> Tensor:
    """All sequences at once, queries padded to the longest chunk and keys to the longest context (with a
    window: to the longest span of blocks any query of a sequence can see, starting at the first such block).
    ``key_end``: as in :func:`paged_prefill_attention`."""
    sliding_window = options.sliding_window
    total, num_q_heads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    block_size, num_kv_heads, block_tables = kv.block_size, kv.num_kv_heads, kv.block_tables
    device = q.device
    cu = cu_seqlens_q.to(device).long()
    q_lens = cu[1:] - cu[:-1]
    lens = kv.seq_lens.to(device).long()
    max_q, max_len = int(q_lens.max()), int(lens.max())
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
    idx_in_seq = torch.arange(total, device=device) - cu[:-1][seq_of_token]
    qp = q.new_zeros(batch, max_q, num_q_heads, head_dim)
    qp[seq_of_token, idx_in_seq] = q
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, Q]
    if sliding_window is None:
        num_blocks = (max_len + block_size - 1) // block_size
        ids = block_tables[:, :num_blocks]
        num_keys = max_len
        k_pos = torch.arange(max_len, device=device)[None, :]  # [1, L]
    else:
        # Sequence b's keys start at the block holding the first key its first query sees.
        first = (lens - q_lens - sliding_window + 1).clamp(min=0) // block_size  # [B]
        num_blocks = int(((lens + block_size - 1) // block_size - first).max())
        cols = first[:, None] + torch.arange(num_blocks, device=device)[None, :]
        ids = block_tables.gather(1, cols.clamp(max=block_tables.shape[1] - 1).to(block_tables.device))
        num_keys = num_blocks * block_size
        k_pos = first[:, None] * block_size + torch.arange(num_keys, device=device)[None, :]  # [B, L]
        # Padding query rows take the last real query's keys (under a window their own could be none).
        q_pos = torch.minimum(q_pos, lens[:, None] - 1)
    shape = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    k = _gather(kv.k_cache, ids, "k", workspace).view(shape)[:, :num_keys].transpose(1, 2)
    v = _gather(kv.v_cache, ids, "v", workspace).view(shape)[:, :num_keys].transpose(1, 2)
    # Padding query rows (past q_len) sit at positions >= seq_len: they still see keys 0..seq_len-1, so no row
    # is empty; they are dropped below.
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] < lens[:, None, None])
    if key_end is not None:  # each query's keys end at its own bound (never past its sequence's length)
        end = torch.zeros(batch, max_q, dtype=torch.long, device=device)
        end[seq_of_token, idx_in_seq] = key_end.to(device).long()
        mask |= k_pos[:, None, :] < torch.minimum(end, lens[:, None])[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    if options.softcap is None and options.sinks is None:
        out = _sdpa(qp.transpose(1, 2), k, v, mask[:, None], options.scale)  # [B, Hq, Q, D]
    else:
        out = _attend_explicit(qp.transpose(1, 2), k, v, mask[:, None], options)
    return out.transpose(1, 2)[seq_of_token, idx_in_seq].to(q.dtype)


_EXPLICIT_SCORES_ELEMENTS = 16 << 20  # float32 scores per query chunk in _attend_explicit (64 MB)


def _attend_explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, options: AttentionOptions) -> Tensor:
    """What SDPA cannot do: ``q [B,Hq,Q,D]`` over ``k/v [B,Hkv,L,D]`` (any strides) with ``mask [B,1,Q,L]``
    (True = attend), logits soft-capped and/or a sink logit per head (``sinks [Hq]``), in float32 →
    ``[B,Hq,Q,D]`` float32. Queries go in chunks of at most ``_EXPLICIT_SCORES_ELEMENTS`` scores."""
    scale, softcap, sinks = options.scale, options.softcap, options.sinks
    batch, num_q_heads, num_q, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    kt, vf = k.float().transpose(-1, -2), v.float()  # [B, Hkv, D, L], [B, Hkv, L, D]
    qg = q.float().view(batch, num_kv_heads, group, num_q, head_dim)
    sink = None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1, 1).to(q.device)
    out = torch.empty(batch, num_kv_heads, group, num_q, head_dim, dtype=torch.float32, device=q.device)
    step = max(1, _EXPLICIT_SCORES_ELEMENTS // max(1, batch * num_q_heads * num_keys))
    for i in range(0, num_q, step):
        n = min(step, num_q - i)
        qi = qg[:, :, :, i : i + n].reshape(batch, num_kv_heads, group * n, head_dim)
        s = (qi @ kt).view(batch, num_kv_heads, group, n, num_keys) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask[:, :, None, i : i + n], float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.expand(batch, -1, -1, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :num_keys].reshape(batch, num_kv_heads, group * n, num_keys)
        out[:, :, :, i : i + n] = (p @ vf).view(batch, num_kv_heads, group, n, head_dim)
    return out.view(batch, num_q_heads, num_q, head_dim)


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy physical blocks ``block_mapping[:, 0] -> block_mapping[:, 1]`` in every layer, K and V.

    All sources are read before any destination is written (a block may not be both a source and a
    destination of the same call in the Triton kernel, so callers keep the two sets disjoint).
    """
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(kv_cache.device)
    dst = block_mapping[:, 1].long().to(kv_cache.device)
    kv_cache[:, :, dst] = kv_cache[:, :, src]
