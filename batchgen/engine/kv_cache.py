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
6. Failure to find memory returns ``None`` and changes nothing; invalid use raises :class:`KVCacheError`.

Cost per call is O(blocks touched by the call), never O(num_blocks): the engine calls
``append_slots`` / ``block_table`` for up to a few hundred sequences every step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from batchgen.engine.block_pool import BlockHash, BlockPool, hash_block_tokens

SeqId = Hashable


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
    """Physical token slots holding a live token (a slot shared by several sequences counts once)."""
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
    num_evictions: int
    """Cached blocks evicted to make room so far."""
    peak_blocks_used: int
    """Most blocks in use at once so far."""

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


@dataclass(slots=True)
class _Seq:
    table: list[int]
    num_tokens: int
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Hashes of this sequence's leading full blocks, as far as they have been computed."""
    num_registered: int = 0
    """Leading blocks already registered in the prefix cache (or taken from it)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of all live sequences over one :class:`BlockPool` (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self._seqs: dict[SeqId, _Seq] = {}
        self._live_slots = 0
        self._logical_tokens = 0
        self._hit_tokens = 0
        self._queried_tokens = 0
        self._cow_copies = 0
        self._peak_used = 0

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
        return list(self._get(seq_id).table)

    def num_tokens(self, seq_id: SeqId) -> int:
        """Live tokens the sequence's table covers (last ``num_tokens`` given to allocate/append_slots)."""
        return self._get(seq_id).num_tokens

    def _get(self, seq_id: SeqId) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            raise KVCacheError(f"unknown or already freed sequence {seq_id!r}")
        return s

    def _match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[BlockHash]]:
        """Longest run of cached full blocks at the start of token_ids, never the last token's block."""
        if not self.enable_prefix_caching or len(token_ids) <= self.block_size:
            return [], []
        bs = self.block_size
        lookup = self.pool.lookup
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            toks = token_ids[start : start + bs]
            h = hash_block_tokens(parent, toks)
            b = lookup(h, parent, toks)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def _blocks_needed(self, cached: list[int], num_tokens: int) -> int:
        rc = self.pool.ref_counts
        revived = sum(1 for b in cached if rc[b] == 0)  # evictable now, so they use up free blocks
        live = max(num_tokens, len(cached) * self.block_size)
        return _cdiv(live, self.block_size) - len(cached) + revived

    # ------------------------------------------------------------- mutations
    def allocate(
        self, seq_id: SeqId, token_ids: Sequence[int], num_tokens: int, *, reserve_blocks: int = 0
    ) -> int | None:
        """Start a sequence: share the longest cached full-block prefix, then allocate the rest.

        The table covers ``max(num_tokens, num_cached_tokens)`` live tokens. Returns the number of
        tokens already cached (a multiple of block_size, at most ``(len(token_ids)-1)//bs*bs``), or
        None, changing nothing, if the pool cannot hold it while keeping ``reserve_blocks`` free
        afterwards (an admission watermark that leaves room for running sequences to grow).
        """
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already allocated")
        if num_tokens < 0:
            raise KVCacheError(f"num_tokens must be >= 0, got {num_tokens}")
        cached, hashes = self._match_prefix(token_ids)
        pool = self.pool
        if self._blocks_needed(cached, num_tokens) + reserve_blocks > pool.num_free_blocks:
            return None
        bs = self.block_size
        rc = pool.ref_counts
        num_cached = len(cached) * bs
        live = max(num_tokens, num_cached)
        revived = sum(1 for b in cached if rc[b] == 0)
        pool.incref(cached)  # revive before allocating so allocation cannot evict them
        table = cached + pool.allocate(_cdiv(live, bs) - len(cached))
        self._seqs[seq_id] = _Seq(table, live, hashes, len(cached))
        self._live_slots += revived * bs + (live - num_cached)
        self._logical_tokens += live
        if self.enable_prefix_caching:
            self._hit_tokens += num_cached
            self._queried_tokens += len(token_ids)
        self._update_peak()
        return num_cached

    def _append_cost(self, s: _Seq, num_tokens: int) -> tuple[int, list[int]]:
        """(blocks needed, logical indices of shared blocks the new tokens would be written into)."""
        old = s.num_tokens
        if num_tokens < old:
            raise KVCacheError(f"append_slots cannot shrink a sequence ({old} -> {num_tokens} tokens)")
        table = s.table
        n = len(table)
        bs = self.block_size
        first = old // bs  # the block holding position `old`, where writing starts
        if first < n:
            rc = self.pool.ref_counts
            cow = [i for i in range(first, n) if rc[table[i]] > 1]
        else:
            cow = []
        return -(-num_tokens // bs) - n + len(cow), cow

    def append_slots(self, seq_id: SeqId, num_tokens: int) -> list[tuple[int, int]] | None:
        """Grow the sequence to ``num_tokens`` live tokens; copy-on-write shared blocks about to be written.

        Returns the ``(src, dst)`` block copies to perform before the forward (empty list if none), or
        None, changing nothing, if the pool cannot supply the blocks.
        """
        s = self._seqs.get(seq_id)
        if s is None:
            raise KVCacheError(f"cannot append to unknown or already freed sequence {seq_id!r}")
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

    def cache_full_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register in the prefix cache every block that is full once ``num_computed_tokens`` are computed.

        ``token_ids`` are the sequence's tokens (at least ``num_computed_tokens`` of them). Call at
        schedule time for the tokens scheduled this step. Hashes are chained from the blocks already
        registered, so each block is hashed once per sequence. No-op without prefix caching.
        """
        s = self._get(seq_id)
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
            parent = hashes[i - 1] if i else None
            if i < len(hashes):
                h = hashes[i]
            else:
                h = hash_block_tokens(parent, toks)
                hashes.append(h)
            pool.cache_block(s.table[i], h, parent, toks)
        s.num_registered = num_full

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (partial last block too; refcount + 1).

        Needs no free block; the first write of either sequence into a shared partial block copies it.
        """
        p = self._get(parent_id)
        if child_id in self._seqs:
            raise KVCacheError(f"cannot fork into {child_id!r}: sequence already exists")
        self.pool.incref(p.table)
        self._seqs[child_id] = _Seq(list(p.table), p.num_tokens, list(p.block_hashes), p.num_registered)
        self._logical_tokens += p.num_tokens

    def free(self, seq_id: SeqId) -> None:
        """Release the sequence's blocks (last to first, so cached tails are evicted before heads)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise KVCacheError(f"cannot free unknown or already freed sequence {seq_id!r}")
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

    def reset_prefix_cache(self) -> int:
        """Drop all cached prefixes (e.g. after weights change); returns the evictable blocks released."""
        for s in self._seqs.values():
            s.num_registered = 0
            s.block_hashes = []
        return self.pool.reset_prefix_cache()

    def _update_peak(self) -> None:
        used = self.pool.num_used_blocks
        if used > self._peak_used:
            self._peak_used = used

    def stats(self) -> KVCacheStats:
        """Current figures (O(1))."""
        pool = self.pool
        used = pool.num_used_blocks
        return KVCacheStats(
            num_blocks=pool.num_blocks,
            block_size=self.block_size,
            num_seqs=len(self._seqs),
            blocks_used=used,
            blocks_free=pool.num_free_blocks,
            blocks_cached=pool.num_cached_blocks,
            live_token_slots=self._live_slots,
            allocated_token_slots=used * self.block_size,
            logical_tokens=self._logical_tokens,
            prefix_hit_tokens=self._hit_tokens,
            prefix_queried_tokens=self._queried_tokens,
            num_cow_copies=self._cow_copies,
            num_evictions=pool.num_evictions,
            peak_blocks_used=self._peak_used,
        )
