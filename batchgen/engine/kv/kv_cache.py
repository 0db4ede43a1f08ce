"""Per-sequence block tables over a :class:`BlockPool`: prefix reuse, growth, fork, copy-on-write.

Every sequence has a block table (logical block ``i`` → physical block id) covering its *live tokens*:
the ``num_tokens`` last passed to :meth:`KVCacheManager.allocate` / :meth:`KVCacheManager.append_slots`
(tokens whose K/V are in the cache or about to be written this step). The table always has exactly
``ceil(num_tokens / block_size)`` entries, so blocks are only allocated on block boundaries.

Invariants (documented here, checked after every step by ``tests/test_kv_cache_properties.py``):

1. For every block, ``ref_count`` equals the number of block-table entries (over all sequences)
   pointing at it; no block is both free (or evictable) and referenced.
2. A write lands only on a block with ``ref_count == 1``: :meth:`append_slots` copies any shared block
   that the new tokens would be written into (copy-on-write), repoints the writer's table and returns the
   ``(src, dst)`` copies the model runner must perform *before* the forward pass.
3. When every sequence has been freed, every block is back in the pool (free or cached-evictable).
4. A prefix-cache hit never returns a block whose tokens differ from the request's (the pool stores the
   token ids and parent hash of every cached block and compares them on lookup).
5. Only full blocks are ever shared through the prefix cache, and never the block holding the last
   token of the request: at most ``(len(token_ids) - 1) // block_size`` blocks are reused, so the last
   prompt token is always recomputed (its logits are needed).
6. A prefix that ends inside a block is reused by copying (see "Partial blocks" below): the copy's source is
   a registered block written by an earlier step's forward (never one registered by the step being
   scheduled), held by a reference until :meth:`KVCacheManager.end_schedule` so that nothing evicts or
   rewrites it before the copy runs.
7. Failure to find memory returns ``None`` and changes nothing; invalid use raises :class:`KVCacheError`.

**Partial blocks**: a prefix that ends inside a block is reused by copying
(:mod:`batchgen.engine.kv.prefix_reuse`, what an admission reuses of the prefix cache).

**Swapping** (``num_cpu_blocks > 0``): :meth:`KVCacheManager.swap_out` moves a set of sequences (a preempted
unit: every sequence of a request group) to a second, CPU :class:`BlockPool` without caching. Each
block referenced *only* by the set is copied once to one CPU block (shared blocks inside the set, e.g. the
common history of a group's sequences, are copied once and the CPU block's refcount counts the set's references) and its GPU
block is freed; a block that a sequence outside the set also references stays on the GPU, still referenced by
the swapped sequence (it cannot be freed anyway, and full blocks are never written again). A swapped
sequence's table entries are GPU block ids (``>= 0``) or ``~cpu_block_id`` (``< 0``). :meth:`swap_in` maps
each distinct CPU block back to one GPU block: a block that held a registered prefix is served again from the
prefix cache when the cache still holds that prefix (no copy), else copied into a fresh block that is
registered again. Refcounts on both pools equal the number of table entries pointing at each block. The
``(src, dst)`` lists returned must be executed in the order swap-outs → swap-ins → copy-on-write copies, all
before the forward: a block freed by a swap-out may be handed out again in the same step, and a copy may
read a block just swapped in.

Cost per call is O(blocks touched by the call), never O(num_blocks): the engine calls
``append_slots`` / ``block_table`` for up to a few hundred sequences every step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from batchgen.engine.kv.block_pool import BlockHash, BlockPool, hash_block_tokens
from batchgen.engine.kv.block_table import BlockTable
from batchgen.engine.kv.prefix_reuse import PrefixReuse
from batchgen.engine.kv.swap import SwapSpace

SeqId = Hashable

LEAD_PENDING = -1
"""What :meth:`KVCacheManager.allocate` returns, changing nothing, for a sequence that should wait a step for a
prefix block the step being scheduled computes (``wait_for_lead``): unlike a pool too full to hold it, this
holds back only sequences sharing that prefix, so the scheduler admits the ones behind it meanwhile."""


class KVCacheError(Exception):
    """Invalid use of the KV cache manager (unknown or already freed sequence, duplicate id, ...)."""


@dataclass
class KVCacheStats:
    """Snapshot of the block manager, the KV figures of the job report."""

    num_blocks: int
    block_size: int
    num_seqs: int
    blocks_used: int
    """Blocks referenced by at least one sequence."""
    blocks_free: int
    """Blocks that can be handed out now (plain free + cached evictable)."""
    blocks_cached: int
    """Evictable blocks still holding a cached prefix (included in ``blocks_free``)."""
    live_token_slots: int
    """Physical token slots holding a live token (a slot shared by several sequences counts once; a partial
    copy's source held until ``end_schedule`` counts whole). Invariant: ``0 <= live_token_slots <=
    allocated_token_slots``, and after ``end_schedule`` it equals a recount over the block tables
    (:meth:`KVCacheManager.recount_live_slots`)."""
    allocated_token_slots: int
    """``blocks_used * block_size``."""
    logical_tokens: int
    """Sum of live tokens over sequences (counts shared tokens once per sequence)."""
    prefix_hit_tokens: int
    """Prompt tokens served from the prefix cache by successful ``allocate`` calls."""
    prefix_queried_tokens: int
    """Prompt tokens passed to successful ``allocate`` calls (with prefix caching on)."""
    num_cow_copies: int
    """Blocks copied on write so far."""
    num_prefix_copies: int
    """Blocks copied to reuse a cached prefix that ends inside a block, so far (module docstring)."""
    num_evictions: int
    """Cached blocks evicted to make room so far."""
    peak_blocks_used: int
    """Most blocks in use at once so far."""
    num_swapped_seqs: int = 0
    """Sequences whose blocks are (partly) in CPU memory (not counted in ``num_seqs``/``logical_tokens``)."""
    cpu_blocks: int = 0
    """Size of the CPU swap pool (0: swapping off)."""
    cpu_blocks_used: int = 0
    """CPU blocks holding swapped-out KV."""
    num_swapped_out_blocks: int = 0
    """GPU blocks copied to CPU memory so far."""
    num_swapped_in_blocks: int = 0
    """CPU blocks copied back to GPU blocks so far (prefix-cache hits on swap-in are not copies)."""

    @property
    def kv_utilization(self) -> float:
        """Live token slots ÷ allocated token slots (1.0 when nothing is allocated)."""
        return self.live_token_slots / self.allocated_token_slots if self.allocated_token_slots else 1.0

    @property
    def internal_fragmentation(self) -> float:
        """Share of allocated slots not holding a live token (empty tails of last blocks)."""
        return 1.0 - self.kv_utilization

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix-cache hit tokens ÷ queried tokens (0.0 before any query)."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def sharing_saved_slots(self) -> int:
        """Token slots saved by sharing blocks (prefix cache + forks): logical − physical live tokens."""
        return self.logical_tokens - self.live_token_slots


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of all live sequences over one :class:`BlockPool` (see the module docstring)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_cpu_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching=enable_prefix_caching)
        # CPU swap space, side by side with the GPU pool (the prefix cache lives on the GPU pool only).
        self.swap_space = SwapSpace(num_cpu_blocks, block_size) if num_cpu_blocks > 0 else None
        self._seqs: dict[SeqId, BlockTable] = {}
        self._live_slots = 0
        self._logical_tokens = 0
        self._cow_copies = 0
        self._peak_used = 0
        self.reuse = PrefixReuse(self.pool, enable_prefix_caching)
        """What admissions reuse of the prefix cache: the matches, the step's partial-block copies, hit figures."""

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available for allocation, evictable cached blocks included."""
        return self.pool.num_free_blocks

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's block table (logical block i → physical block id)."""
        return list(self._get_resident(seq_id).table)

    def raw_table(self, seq_id: SeqId) -> list[int]:
        """The table as stored, swapped sequences included (entries ``< 0`` are CPU blocks ``~entry``)."""
        return list(self._get(seq_id).table)

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._get(seq_id).swapped

    @property
    def cpu_pool(self) -> BlockPool | None:
        """The swap space's CPU block pool (None: swapping off)."""
        return self.swap_space.pool if self.swap_space is not None else None

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks if self.cpu_pool is not None else 0

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks if self.cpu_pool is not None else 0

    def num_tokens(self, seq_id: SeqId) -> int:
        """Live tokens the sequence's table covers (last ``num_tokens`` given to allocate/append_slots)."""
        return self._get(seq_id).num_tokens

    def _get(self, seq_id: SeqId) -> BlockTable:
        s = self._seqs.get(seq_id)
        if s is None:
            raise KVCacheError(f"unknown or already freed sequence {seq_id!r}")
        return s

    def _get_resident(self, seq_id: SeqId) -> BlockTable:
        s = self._get(seq_id)
        if s.swapped:
            raise KVCacheError(f"sequence {seq_id!r} is swapped out; swap it in first")
        return s

    def allocate_cost(self, token_ids: Sequence[int], num_tokens: int, root: BlockHash | None = None) -> int:
        """Free blocks :meth:`allocate` would take for this sequence now (prefix hits counted); changes nothing."""
        return self.reuse.blocks_needed(self.reuse.match(token_ids, root), num_tokens)

    # ------------------------------------------------------------- mutations
    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_tokens: int,
        *,
        reserve_blocks: int = 0,
        root: BlockHash | None = None,
        wait_for_lead: bool = False,
    ) -> int | None:
        """Start a sequence: share the longest cached full-block prefix, copy the run of a cached block that
        continues it (:mod:`~batchgen.engine.kv.prefix_reuse`, "Partial blocks"), then allocate the rest.

        The table covers ``max(num_tokens, num_cached_tokens)`` live tokens. Returns the number of tokens
        already cached (at most ``len(token_ids) - 1``); None, changing nothing, if the pool cannot hold it
        while keeping ``reserve_blocks`` free afterwards (an admission watermark that leaves room for running
        sequences to grow); :data:`LEAD_PENDING`, changing nothing, if ``wait_for_lead`` and a run to copy that
        is being computed by the step being scheduled continues the prompt ``WAIT_FOR_LEAD_MIN_TOKENS`` further
        than any written one. ``root`` keys
        the sequence's prefix-cache hash chain (the key of the weights its request runs under, e.g. an adapter's; None: the base model).
        """
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already allocated")
        if num_tokens < 0:
            raise KVCacheError(f"num_tokens must be >= 0, got {num_tokens}")
        reuse = self.reuse
        match = reuse.match(token_ids, root)
        if wait_for_lead and reuse.should_wait(match):
            return LEAD_PENDING
        pool = self.pool
        if reuse.blocks_needed(match, num_tokens) + reserve_blocks > pool.num_free_blocks:
            return None
        bs = self.block_size
        cached = match.blocks
        shared = len(cached) * bs
        live = max(num_tokens, shared + match.lead_tokens)
        revived = reuse.hold(match)  # before allocating, so allocation cannot evict them
        table = cached + pool.allocate(_cdiv(live, bs) - len(cached))
        reused = reuse.admitted(match, table, len(token_ids))
        self._seqs[seq_id] = BlockTable(table, live, match.hashes, len(cached), root=root)
        self._live_slots += revived * bs + (live - shared)
        self._logical_tokens += live
        self._update_peak()
        return reused

    def end_schedule(self) -> list[tuple[int, int]]:
        """The step being scheduled is planned: returns the ``(src, dst)`` block copies that :meth:`allocate`
        made for partial prefixes since the last call (to run before the step's forward, with its copies on
        write); see :meth:`PrefixReuse.end_schedule`. The scheduler calls it once at the end of each schedule."""
        copies, released = self.reuse.end_schedule()
        self._live_slots -= (
            released * self.block_size
        )  # held sources counted live since allocate revived them
        return copies

    def _append_cost(self, s: BlockTable, num_tokens: int) -> tuple[int, list[int]]:
        """(blocks needed, logical indices of shared blocks the new tokens would be written into)."""
        if num_tokens < s.num_tokens:
            raise KVCacheError(
                f"append_slots cannot shrink a sequence ({s.num_tokens} -> {num_tokens} tokens)"
            )
        return s.write_cost(num_tokens, self.block_size, self.pool.ref_counts)

    def append_cost(self, targets: Sequence[tuple[SeqId, int]]) -> int:
        """Free blocks that growing each ``(seq_id, num_tokens)`` in turn with :meth:`append_slots` would take:
        new blocks plus copies on write, where a block shared only by ``c`` of these sequences is copied
        ``c - 1`` times (the last writer finds it exclusive). Changes nothing."""
        rc = self.pool.ref_counts
        grow = 0
        writers: dict[int, int] = {}
        for sid, n in targets:
            s = self._get_resident(sid)
            need, cow = self._append_cost(s, n)
            grow += need - len(cow)
            for i in cow:
                b = s.table[i]
                writers[b] = writers.get(b, 0) + 1
        return grow + sum(c - (rc[b] == c) for b, c in writers.items())

    def append_slots(self, seq_id: SeqId, num_tokens: int) -> list[tuple[int, int]] | None:
        """Grow the sequence to ``num_tokens`` live tokens; copy-on-write shared blocks about to be written.

        Returns the ``(src, dst)`` block copies to perform before the forward (empty list if none), or
        None, changing nothing, if the pool cannot supply the blocks.
        """
        s = self._seqs.get(seq_id)
        if s is None:
            raise KVCacheError(f"cannot append to unknown or already freed sequence {seq_id!r}")
        if s.swapped:
            raise KVCacheError(f"cannot append to swapped-out sequence {seq_id!r}")
        old = s.num_tokens
        if num_tokens == old:
            return []
        need, cow = self._append_cost(s, num_tokens)
        added = num_tokens - old
        if need == 0:  # fast path: the tokens fit in an exclusive partial block
            s.num_tokens = num_tokens
            self._live_slots += added
            self._logical_tokens += added
            return []
        pool = self.pool
        if need > pool.num_free_blocks:
            return None
        bs = self.block_size
        table = s.table
        copies: list[tuple[int, int]] = []
        if cow:
            for i, dst in zip(cow, pool.allocate(len(cow))):
                src = table[i]
                pool.free((src,))  # ref_count > 1, so it stays in use by the other sequences
                table[i] = dst
                copies.append((src, dst))
                self._live_slots += min(bs, old - i * bs)  # the copied live slots now exist twice
            self._cow_copies += len(cow)
        grow = -(-num_tokens // bs) - len(table)
        if grow > 0:
            table.extend(pool.allocate(grow))
        s.num_tokens = num_tokens
        self._live_slots += added
        self._logical_tokens += added
        self._update_peak()
        return copies

    def append_one(
        self, seq_id: SeqId, token_ids: Sequence[int], defer_last: bool = False
    ) -> list[int] | None:
        """Decode fast path: ``append_slots(seq_id, len(token_ids))`` then ``cache_full_blocks(seq_id,
        token_ids, len(token_ids))`` for a resident sequence growing by one token that fits in its exclusive
        last block (no new block, no copy on write): O(1), hashing only when the token fills its block.
        ``defer_last``: the last token is not known yet (a placeholder): hash only the
        blocks before it (a later call, or :meth:`cache_full_blocks`, hashes its block once it is known).

        Returns a copy of the sequence's block table, or None, changing nothing, when the general path is
        needed.
        """
        s = self._seqs.get(seq_id)
        num_tokens = len(token_ids)
        if s is None or s.swapped or num_tokens != s.num_tokens + 1:
            return None
        table = s.table
        bs = self.block_size
        # The token's slot must be in the last block (what append_slots would check for copies on write).
        if (num_tokens - 1) // bs != len(table) - 1 or self.pool.ref_counts[table[-1]] != 1:
            return None
        s.num_tokens = num_tokens
        self._live_slots += 1
        self._logical_tokens += 1
        known = num_tokens - 1 if defer_last else num_tokens
        if self.enable_prefix_caching and known // bs > s.num_registered:
            self.cache_full_blocks(seq_id, token_ids, known)
        return table[:]

    def cache_full_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register in the prefix cache every block that is full once ``num_computed_tokens`` are computed.

        ``token_ids`` are the sequence's tokens (at least ``num_computed_tokens`` of them). Call at
        schedule time for the tokens scheduled this step. Hashes are chained from the blocks already
        registered, so each block is hashed once per sequence. No-op without prefix caching.
        """
        s = self._get_resident(seq_id)
        if not self.enable_prefix_caching:
            return
        if num_computed_tokens > s.num_tokens:
            raise KVCacheError(
                f"sequence {seq_id!r}: {num_computed_tokens} computed tokens but only {s.num_tokens} allocated"
            )
        if num_computed_tokens > len(token_ids):
            raise KVCacheError(
                f"sequence {seq_id!r}: {num_computed_tokens} computed tokens but {len(token_ids)} token ids given"
            )
        bs = self.block_size
        num_full = num_computed_tokens // bs
        if num_full <= s.num_registered:
            return
        hashes = s.block_hashes
        pool = self.pool
        for i in range(s.num_registered, num_full):
            toks = token_ids[i * bs : (i + 1) * bs]
            parent = hashes[i - 1] if i else s.root
            if i < len(hashes):
                h = hashes[i]
            else:
                h = hash_block_tokens(parent, toks)
                hashes.append(h)
            pool.cache_block(s.table[i], h, parent, toks)
        s.num_registered = num_full

    def cache_resolved_block(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        """A placeholder that completed its block just became a known token: register the
        block in the prefix cache if it is allocated (the step scheduled meanwhile computes it)."""
        n = len(token_ids)
        if self.enable_prefix_caching and self._get(seq_id).num_tokens >= n:
            self.cache_full_blocks(seq_id, token_ids, n)

    def fork(self, parent_id: SeqId, child_id: SeqId, num_tokens: int | None = None) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (partial last block too; refcount + 1).

        Needs no free block; the first write of either sequence into a shared partial block copies it.
        With ``num_tokens`` (a multiple of block_size, at most the parent's live tokens) the child shares only
        the parent's first ``num_tokens // block_size`` (full) blocks and has ``num_tokens`` live tokens: a
        sequence that shares a prefix with the parent and continues differently (a group's sequences resumed
        after a preemption). Its next :meth:`append_slots` allocates fresh blocks (no copy).
        """
        p = self._get_resident(parent_id)
        if child_id in self._seqs:
            raise KVCacheError(f"cannot fork into {child_id!r}: sequence already exists")
        if num_tokens is None or num_tokens == p.num_tokens:
            table, n = list(p.table), p.num_tokens
            hashes, registered = list(p.block_hashes), p.num_registered
        else:
            if num_tokens < 0 or num_tokens > p.num_tokens or num_tokens % self.block_size:
                raise KVCacheError(
                    f"fork of {num_tokens} tokens: must be a multiple of block_size ({self.block_size}) and at "
                    f"most the parent's {p.num_tokens} tokens"
                )
            nb = num_tokens // self.block_size
            table, n = p.table[:nb], num_tokens
            hashes, registered = p.block_hashes[:nb], min(p.num_registered, nb)
        self.pool.incref(table)
        self._seqs[child_id] = BlockTable(table, n, hashes, registered, root=p.root)
        self._logical_tokens += n

    def free(self, seq_id: SeqId) -> None:
        """Release the sequence's blocks (last to first, so cached tails are evicted before heads)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise KVCacheError(f"cannot free unknown or already freed sequence {seq_id!r}")
        if s.swapped:
            assert self.swap_space is not None
            self._live_slots -= self.swap_space.free(self.pool, s)
            return
        table = s.table
        self._logical_tokens -= s.num_tokens
        if not table:
            return
        pool = self.pool
        bs = self.block_size
        last_freed = pool.ref_counts[table[-1]] == 1
        freed = pool.free(reversed(table))
        if last_freed:
            self._live_slots -= (freed - 1) * bs + (s.num_tokens - (len(table) - 1) * bs)
        else:
            self._live_slots -= freed * bs

    # ------------------------------------------------------------------ swapping
    def swap_out(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]] | None:
        """Move these sequences' KV to CPU blocks (see the module docstring); all or nothing.

        Returns the ``(gpu_block, cpu_block)`` copies to perform before any freed GPU block is written again,
        or None, changing nothing, when swapping is off or the CPU pool lacks free blocks.
        """
        if self.swap_space is None:
            return None
        seqs = [self._get_resident(sid) for sid in seq_ids]
        if len({id(s) for s in seqs}) != len(seqs):
            raise KVCacheError("swap_out: a sequence is listed twice")
        moved = self.swap_space.swap_out(self.pool, seqs)
        if moved is None:
            return None
        copies, released = moved
        self._live_slots -= released
        self._logical_tokens -= sum(s.num_tokens for s in seqs)
        return copies

    def _get_swapped(self, seq_ids: Sequence[SeqId]) -> list[BlockTable]:
        seqs = [self._get(sid) for sid in seq_ids]
        for sid, s in zip(seq_ids, seqs):
            if not s.swapped:
                raise KVCacheError(f"sequence {sid!r} is not swapped out")
        return seqs

    def swap_in_cost(self, seq_ids: Sequence[SeqId]) -> int:
        """Free GPU blocks :meth:`swap_in` would take now (cached blocks it revives included)."""
        assert self.swap_space is not None
        seqs = [self._get(sid) for sid in seq_ids]
        return self.swap_space.swap_in_cost(self.pool, seqs, self.enable_prefix_caching)

    def swap_in(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int]] | None:
        """Bring swapped sequences back to GPU blocks; all or nothing.

        Returns the ``(cpu_block, gpu_block)`` copies to perform before the forward, or None, changing
        nothing, when the GPU pool lacks free blocks.
        """
        seqs = self._get_swapped(seq_ids)
        assert self.swap_space is not None
        moved = self.swap_space.swap_in(self.pool, seqs, self.enable_prefix_caching)
        if moved is None:
            return None
        copies, added = moved
        self._live_slots += added
        self._logical_tokens += sum(s.num_tokens for s in seqs)
        self._update_peak()
        return copies

    def reset_prefix_cache(self) -> int:
        """Drop all cached prefixes (e.g. after weights change); returns the evictable blocks released."""
        for s in self._seqs.values():
            s.num_registered = 0
            s.block_hashes = []
        return self.pool.reset_prefix_cache()

    def recount_live_slots(self) -> int:
        """Live token slots counted from the block tables (O(tokens)): what ``stats().live_token_slots`` keeps
        incrementally, once the schedule's partial-copy sources are released (:meth:`end_schedule`)."""
        bs = self.block_size
        full: set[int] = set()
        tails: dict[int, int] = {}
        for s in self._seqs.values():
            for i, b in enumerate(s.table):
                if b < 0:
                    continue  # a CPU block of a swapped sequence
                n = s.live_in_block(i, bs)
                if n >= bs:
                    full.add(b)
                else:
                    tails[b] = max(tails.get(b, 0), n)
        return len(full) * bs + sum(n for b, n in tails.items() if b not in full)

    def _update_peak(self) -> None:
        used = self.pool.num_used_blocks
        if used > self._peak_used:
            self._peak_used = used

    def stats(self) -> KVCacheStats:
        """Current figures (O(1))."""
        pool, sw = self.pool, self.swap_space
        used = pool.num_used_blocks
        return KVCacheStats(
            num_blocks=pool.num_blocks,
            block_size=self.block_size,
            num_seqs=len(self._seqs) - (sw.num_swapped_seqs if sw else 0),
            blocks_used=used,
            blocks_free=pool.num_free_blocks,
            blocks_cached=pool.num_cached_blocks,
            live_token_slots=self._live_slots,
            allocated_token_slots=used * self.block_size,
            logical_tokens=self._logical_tokens,
            prefix_hit_tokens=self.reuse.hit_tokens,
            prefix_queried_tokens=self.reuse.queried_tokens,
            num_cow_copies=self._cow_copies,
            num_prefix_copies=self.reuse.num_copies,
            num_evictions=pool.num_evictions,
            peak_blocks_used=self._peak_used,
            num_swapped_seqs=sw.num_swapped_seqs if sw else 0,
            cpu_blocks=self.num_cpu_blocks,
            cpu_blocks_used=sw.pool.num_used_blocks if sw else 0,
            num_swapped_out_blocks=sw.num_swapped_out_blocks if sw else 0,
            num_swapped_in_blocks=sw.num_swapped_in_blocks if sw else 0,
        )
