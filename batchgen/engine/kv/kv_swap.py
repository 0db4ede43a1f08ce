"""The CPU swap space of the KV cache manager: a refcounted CPU :class:`BlockPool` (no prefix cache) and the
block moves of swap-mode preemption, side by side with the GPU pool (see :mod:`batchgen.engine.kv.kv_cache` for
the rules: a set of sequences goes out together, a block shared with a sequence outside the set stays on the
GPU, a CPU block that held a registered prefix is served again from the prefix cache on swap-in when it can).

Every method takes the GPU pool and the sequences' :class:`BlockTable` objects and returns the live token
slots it added or released on the GPU, so that the manager keeps its figures; this module owns only the CPU
side (its pool, the prefix-cache entry each CPU block came from, its counters).
"""

from __future__ import annotations

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
