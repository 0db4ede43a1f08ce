"""Swapping, in one place: the CPU swap space of swap-mode preemption — its block bookkeeping
(:class:`SwapSpace`, composed by the KV cache manager) and the tensor copies between it and the KV cache
(:class:`BlockSwapper`, owned by the model runner).

**Bookkeeping** (:class:`SwapSpace`): a refcounted CPU :class:`BlockPool` (no prefix cache) and the block
moves of swap-mode preemption, side by side with the GPU pool (see :mod:`batchgen.engine.kv.kv_cache` for the
rules: a set of sequences goes out together, a block shared with a sequence outside the set stays on the GPU,
a CPU block that held a registered prefix is served again from the prefix cache on swap-in when it can).
Every method takes the GPU pool and the sequences' :class:`BlockTable` objects and returns the live token
slots it added or released on the GPU, so that the manager keeps its figures; it owns only the CPU side (its
pool, the prefix-cache entry each CPU block came from, its counters).

**Copies** (:class:`BlockSwapper`): the CPU pool is one tensor
``[num_cpu_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block-major, so that one block (K and
V of every layer) is one contiguous span and a batch of blocks gathered from the KV cache (``kv_cache[:, :,
ids]`` moved to the front) is one contiguous tensor. On CUDA the pool is pinned.

* **CPU device**: both copies are one batched tensor index copy (``index_select`` + ``index_copy_``).
* **CUDA**: copies run on a side stream. A swap-out gathers the blocks into one contiguous GPU tensor (a
  batched ``index_select``), after which the compute stream may overwrite the source blocks (it waits on an
  event recorded right after the gather), then copies it without blocking into pinned staging memory while the
  forward runs; the staged blocks are scattered into the pool (a CPU ``index_copy_``) when
  :meth:`BlockSwapper.flush` is called (before the next swap-in and at the start of the next step). A swap-in
  gathers the CPU blocks into pinned staging memory, copies them to the GPU and scatters them into the KV
  cache (``index_copy_``) on the side stream after the compute stream's earlier work; the compute stream
  waits for it before the forward.

Copies go in chunks of at most ``CHUNK_BYTES`` (bounded temporary GPU and pinned memory, which the memory
profile does not account for). Ordering within a step (the runner's job): swap-outs, then swap-ins, then
copy-on-write copies, then the forward, because blocks freed by a preemption may be handed out again in the
same step.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from batchgen.engine.kv.block_pool import BlockHash, BlockPool
from batchgen.engine.kv.block_table import BlockTable

CacheEntry = tuple[BlockHash, BlockHash | None, tuple[int, ...]]


class SwapSpace:
    """CPU blocks for swapped-out sequences; refcounts equal the table entries pointing at each block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_caching=False)
        self.block_size = block_size
        self._cache_entry: dict[int, CacheEntry] = {}
        self.num_swapped_seqs = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def swap_out(self, gpu: BlockPool, seqs: list[BlockTable]) -> tuple[list[tuple[int, int]], int] | None:
        """Move the blocks only these sequences reference to CPU blocks (once each); all or nothing.
        Returns the ``(gpu_block, cpu_block)`` copies and the GPU live slots released, or None (no room)."""
        refs: dict[int, int] = {}  # block -> references from this set (first-seen order)
        for s in seqs:
            for b in s.table:
                refs[b] = refs.get(b, 0) + 1
        rc = gpu.ref_counts
        exclusive = [b for b, n in refs.items() if rc[b] == n]
        cpu = self.pool
        if len(exclusive) > cpu.num_free_blocks:
            return None
        to_cpu = dict(zip(exclusive, cpu.allocate(len(exclusive))))
        for b, c in to_cpu.items():
            if refs[b] > 1:
                cpu.incref([c] * (refs[b] - 1))
            entry = gpu.cache_entry(b)
            if entry is not None:
                self._cache_entry[c] = entry
        released = 0
        for s in seqs:
            table = s.table
            for i in range(len(table) - 1, -1, -1):  # tails first into the LRU queue, as in free()
                c = to_cpu.get(table[i])
                if c is None:
                    continue  # shared with a sequence outside the set: stays on the GPU
                if gpu.free((table[i],)):
                    released += s.live_in_block(i, self.block_size)
                table[i] = ~c
            s.swapped = True
        self.num_swapped_seqs += len(seqs)
        self.num_swapped_out_blocks += len(exclusive)
        return list(to_cpu.items()), released

    def free(self, gpu: BlockPool, s: BlockTable) -> int:
        """Release a swapped sequence's blocks on both pools; returns the GPU live slots released."""
        released = 0
        for i in range(len(s.table) - 1, -1, -1):
            b = s.table[i]
            if b >= 0:
                if gpu.free((b,)):
                    released += s.live_in_block(i, self.block_size)
            else:
                self._release(~b)
        self.num_swapped_seqs -= 1
        return released

    def _release(self, c: int) -> None:
        if self.pool.free((c,)):
            self._cache_entry.pop(c, None)

    def _plan_in(
        self, gpu: BlockPool, seqs: list[BlockTable], caching: bool
    ) -> tuple[dict[int, int], dict[int, int]]:
        """(CPU block -> references from these sequences, CPU block -> GPU block serving it from the prefix
        cache)."""
        refs: dict[int, int] = {}
        for s in seqs:
            for e in s.table:
                if e < 0:
                    refs[~e] = refs.get(~e, 0) + 1
        hits: dict[int, int] = {}
        if caching:
            for c in refs:
                entry = self._cache_entry.get(c)
                if entry is not None:
                    b = gpu.lookup(entry[0], entry[1], entry[2])
                    if b is not None:
                        hits[c] = b
        return refs, hits

    def swap_in_cost(self, gpu: BlockPool, seqs: list[BlockTable], caching: bool) -> int:
        """Free GPU blocks :meth:`swap_in` would take now (cached blocks it revives included)."""
        refs, hits = self._plan_in(gpu, seqs, caching)
        rc = gpu.ref_counts
        return len(refs) - sum(1 for b in hits.values() if rc[b] > 0)

    def swap_in(
        self, gpu: BlockPool, seqs: list[BlockTable], caching: bool
    ) -> tuple[list[tuple[int, int]], int] | None:
        """Map each CPU block back to one GPU block; all or nothing. Returns the ``(cpu_block, gpu_block)``
        copies and the GPU live slots added, or None (the GPU pool lacks free blocks)."""
        if self.swap_in_cost(gpu, seqs, caching) > gpu.num_free_blocks:
            return None
        refs, hits = self._plan_in(gpu, seqs, caching)
        rc = gpu.ref_counts
        to_gpu: dict[int, int] = {}
        revived: set[int] = set()
        for c, b in hits.items():  # revive first so that allocation cannot evict them
            if rc[b] == 0:
                revived.add(b)
            gpu.incref([b] * refs[c])
            to_gpu[c] = b
        copy_from = [c for c in refs if c not in hits]
        copies = list(zip(copy_from, gpu.allocate(len(copy_from))))
        for c, b in copies:
            to_gpu[c] = b
            if refs[c] > 1:
                gpu.incref([b] * (refs[c] - 1))
            entry = self._cache_entry.get(c)
            if entry is not None:
                gpu.cache_block(b, *entry)
        fresh = revived | {b for _, b in copies}
        added = 0
        for s in seqs:
            table = s.table
            for i, e in enumerate(table):
                if e < 0:
                    b = to_gpu[~e]
                    table[i] = b
                    if b in fresh:
                        fresh.discard(b)  # count each new physical block's live slots once
                        added += s.live_in_block(i, self.block_size)
                    self._release(~e)
            s.swapped = False
        self.num_swapped_seqs -= len(seqs)
        self.num_swapped_in_blocks += len(copies)
        return copies, added


CHUNK_BYTES = 64 << 20
"""Most bytes of KV blocks moved by one batched copy (temporary gather buffers are this big at most)."""


class BlockSwapper:
    """Owns the CPU swap pool of one engine and performs swap-out / swap-in block copies."""

    def __init__(self, kv_cache: Tensor, num_cpu_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        num_layers, _, _, block_size, heads, head_dim = kv_cache.shape
        self.block_shape = (num_layers, 2, block_size, heads, head_dim)
        shape = (num_cpu_blocks, *self.block_shape)
        dtype = kv_cache.dtype
        block_bytes = math.prod(self.block_shape) * kv_cache.element_size()
        self.chunk_blocks = max(1, CHUNK_BYTES // block_bytes)
        if self.device.type == "cuda":
            self.cpu_cache = torch.empty(shape, dtype=dtype, pin_memory=True)
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device=self.device)
        else:
            # calloc'd by numpy: pages are only touched when blocks are swapped into them.
            itemsize = torch.tensor([], dtype=dtype).element_size()
            raw = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
            self.cpu_cache = torch.from_numpy(raw).view(dtype).view(shape)
            self.stream = None
        self._pending: list[tuple[torch.cuda.Event, Tensor, Tensor, Tensor]] = []
        self._staged_in: list[tuple[torch.cuda.Event, Tensor]] = []  # pinned buffers of swap-ins in flight

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_cache.shape[0]

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy GPU blocks ``mapping[i][0]`` into CPU blocks ``mapping[i][1]``."""
        for i in range(0, len(mapping), self.chunk_blocks):
            self._swap_out(mapping[i : i + self.chunk_blocks])

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy CPU blocks ``mapping[i][0]`` into GPU blocks ``mapping[i][1]`` (done before the forward)."""
        for i in range(0, len(mapping), self.chunk_blocks):
            self._swap_in(mapping[i : i + self.chunk_blocks])

    def _swap_out(self, mapping: list[tuple[int, int]]) -> None:
        src = torch.tensor([g for g, _ in mapping], dtype=torch.long)
        dst = torch.tensor([c for _, c in mapping], dtype=torch.long)
        kv = self.kv_cache
        if self.stream is None:
            self.cpu_cache.index_copy_(0, dst, kv.index_select(2, src).movedim(2, 0))
            return
        main = torch.cuda.current_stream(self.device)
        side = self.stream
        side.wait_stream(main)  # the forwards that wrote these blocks
        with torch.cuda.stream(side):
            gathered = kv.index_select(2, src.to(self.device, non_blocking=True)).movedim(2, 0).contiguous()
            gathered_ready = torch.cuda.Event()
            gathered_ready.record(side)
            staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        main.wait_event(gathered_ready)  # only then may the compute stream reuse the source blocks
        self._pending.append((copied, staging, dst, gathered))

    def flush(self) -> None:
        """Finish pending swap-outs: wait for their device-to-host copies and scatter them into the pool."""
        for copied, staging, dst, _gathered in self._pending:
            copied.synchronize()
            self.cpu_cache.index_copy_(0, dst, staging)
        self._pending.clear()
        for done, _staging in self._staged_in:
            done.synchronize()
        self._staged_in.clear()

    def _swap_in(self, mapping: list[tuple[int, int]]) -> None:
        src = torch.tensor([c for c, _ in mapping], dtype=torch.long)
        dst = torch.tensor([g for _, g in mapping], dtype=torch.long)
        kv = self.kv_cache
        if self.stream is None:
            kv.index_copy_(2, dst, self.cpu_cache.index_select(0, src).movedim(0, 2))
            return
        self.flush()
        staging = torch.empty((len(mapping), *self.block_shape), dtype=kv.dtype, pin_memory=True)
        torch.index_select(self.cpu_cache, 0, src, out=staging)
        main = torch.cuda.current_stream(self.device)
        side = self.stream
        side.wait_stream(main)  # earlier readers/writers of the destination blocks
        with torch.cuda.stream(side):
            blocks = staging.to(self.device, non_blocking=True)
            kv.index_copy_(2, dst.to(self.device, non_blocking=True), blocks.movedim(0, 2))
            done = torch.cuda.Event()
            done.record(side)
        main.wait_stream(side)
        self._staged_in.append((done, staging))  # keep the pinned buffer until the copy is done
