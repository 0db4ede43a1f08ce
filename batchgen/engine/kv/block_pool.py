"""Physical KV-cache blocks: O(1) allocation, reference counts and the prefix cache.

A :class:`BlockPool` owns ``num_blocks`` physical blocks of ``block_size`` token slots (K and V of every
layer live at the same block id in the engine's one ``kv_cache`` tensor). Every block id, 0 included, is
usable: nothing is reserved (padding entries of a block table may say 0 because they are never read).

Each block is in exactly one of three states:

* **in use**: ``ref_count > 0``; referenced by that many block-table entries of live sequences.
* **free**: ``ref_count == 0`` and no content hash; sits on the free stack.
* **cached** (evictable): ``ref_count == 0`` but holds a full block whose content hash is registered;
  sits in an LRU queue. It counts as free (it is handed out when memory is needed, oldest first), and a
  prefix-cache hit on it *revives* it (it leaves the LRU queue and becomes in use again).

Allocation takes free blocks first and only then evicts cached blocks in LRU order, so cached prefixes
survive as long as memory allows. Allocation of ``k`` blocks and freeing are O(k): the free stack is a
Python list (slice pop / append) and the LRU queue an ``OrderedDict`` (O(1) append, pop-oldest and
removal of any block). ``python -m batchgen.bench.block_manager`` measures this against a doubly linked
free list and a bitmap; the list+OrderedDict queue was the fastest.

Content hashes are chained, ``H_i = sha256(H_{i-1} || tokens_i as little-endian int64)``, so a block's hash
identifies the whole prefix up to and including it, and it is identical in every process and on every
machine (unlike Python's salted ``hash()`` of str/bytes). SHA-256 was measured cheaper than BLAKE2b here
(about 1 µs per 16-token block). Each registered block also stores its parent hash and token ids, and a
lookup compares them, so a lookup can never return a block whose tokens differ from the request's.

Invariants (checked by ``tests/test_kv_cache_properties.py``):

* a block with ``ref_count > 0`` is neither on the free stack nor in the LRU queue;
* a block with ``ref_count == 0`` is on the free stack (no hash) or in the LRU queue (hash), never both;
* ``block_hash[b] is not None`` ⇔ ``hash_to_block[block_hash[b]] == b``;
* ``num_free_blocks == len(free stack) + len(LRU queue)``.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a full block and all blocks before it."""

_ROOT_HASH: BlockHash = b"batchgen-kv-root"  # parent of the first block of every sequence
_STRUCTS: dict[int, struct.Struct] = {}


class NoFreeBlocksError(RuntimeError):
    """The pool was asked for more blocks than it has free (callers should check first)."""


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained content hash of one full block: stable across processes, platforms and runs."""
    n = len(token_ids)
    packer = _STRUCTS.get(n)
    if packer is None:
        packer = _STRUCTS[n] = struct.Struct(f"<{n}q")
    return hashlib.sha256((parent_hash or _ROOT_HASH) + packer.pack(*token_ids)).digest()


class BlockPool:
    """Fixed set of physical blocks with reference counts, a free stack and an LRU prefix cache.

    ``enable_caching=False`` makes freed blocks plain free blocks (``cache_block`` is then a no-op).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts: list[int] = [0] * num_blocks
        # Free blocks without cached content; popped from the end, so block 0 is handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks with ref_count 0, oldest (next to evict) first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_parent: list[BlockHash | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        # Registered blocks by parent hash, each list sorted by token ids: the block sharing the longest
        # leading run of tokens with any query is next to the query in that order (see `longest_lead`).
        # `_fresh` holds the blocks registered since the last `settle()` (their K/V are written by the forward
        # of the step being scheduled, so nothing may copy them before it); `settle()` moves them to `_settled`.
        self._settled: dict[BlockHash | None, list[tuple[tuple[int, ...], int]]] = {}
        self._fresh: dict[BlockHash | None, list[tuple[tuple[int, ...], int]]] = {}
        self._fresh_blocks: set[int] = set()
        self.num_evictions = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable blocks (ref_count 0) that still hold a registered prefix."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_count > 0."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    # ------------------------------------------------------- allocate / free
    def allocate(self, k: int) -> list[int]:
        """Take ``k`` blocks (ref_count 1 each): free ones first, then evict cached ones oldest first.

        Raises :class:`NoFreeBlocksError` (changing nothing) when fewer than ``k`` are free.
        """
        free = self._free
        n = len(free)
        if k <= n:
            if k <= 0:
                return []
            blocks = free[n - k :]
            del free[n - k :]
            blocks.reverse()  # stack top first
        else:
            if k > n + len(self._evictable):
                raise NoFreeBlocksError(f"asked for {k} blocks, {self.num_free_blocks} free")
            blocks = free[::-1]
            free.clear()
            evictable = self._evictable
            for _ in range(k - n):
                b = evictable.popitem(last=False)[0]
                self._evict(b)
                blocks.append(b)
        rc = self.ref_counts
        for b in blocks:
            rc[b] = 1
        return blocks

    def _evict(self, b: int) -> None:
        _unindex(
            self._fresh if b in self._fresh_blocks else self._settled,
            self._block_parent[b],
            (self._block_tokens[b], b),
        )  # type: ignore[arg-type]
        self._fresh_blocks.discard(b)
        del self.hash_to_block[self.block_hash[b]]  # type: ignore[arg-type]
        self.block_hash[b] = None
        self._block_parent[b] = None
        self._block_tokens[b] = None
        self.num_evictions += 1

    def free(self, blocks: Iterable[int]) -> int:
        """Drop one reference from each block; returns how many reached ref_count 0.

        A block reaching 0 goes to the LRU tail if it holds a cached prefix, else back on the free
        stack. Pass a sequence's blocks last-to-first so its tail blocks are evicted before its head.
        """
        rc = self.ref_counts
        freed = 0
        for b in blocks:
            c = rc[b] - 1
            if c < 0:
                raise ValueError(f"block {b} freed more often than referenced")
            rc[b] = c
            if c == 0:
                freed += 1
                if self.block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        return freed

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block; a cached block with ref_count 0 is revived."""
        rc = self.ref_counts
        for b in blocks:
            if rc[b] == 0:
                if self.block_hash[b] is None:
                    raise ValueError(f"block {b} is free; allocate it instead of incref")
                del self._evictable[b]
            rc[b] += 1

    # ------------------------------------------------------------ prefix cache
    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> int | None:
        """Block holding exactly these tokens after this parent, or None. Touches nothing."""
        b = self.hash_to_block.get(block_hash)
        if b is None:
            return None
        if self._block_parent[b] != parent_hash or self._block_tokens[b] != tuple(token_ids):
            return None  # hash collision: never return a block whose tokens differ
        return b

    def cache_block(
        self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> bool:
        """Register a full, in-use block under its content hash; returns whether it is now registered.

        A block already registered is left alone; if another block already holds this hash (two
        sequences computed the same prefix at once) the new block stays unregistered and is freed
        normally later.
        """
        if not self.enable_caching:
            return False
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks can be cached: got {len(token_ids)} tokens")
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        current = self.block_hash[block_id]
        if current is not None:
            return current == block_hash
        if block_hash in self.hash_to_block:
            return False
        tokens = tuple(token_ids)
        self.hash_to_block[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self._block_parent[block_id] = parent_hash
        self._block_tokens[block_id] = tokens
        insort(self._fresh.setdefault(parent_hash, []), (tokens, block_id))
        self._fresh_blocks.add(block_id)
        return True

    def longest_lead(self, parent_hash: BlockHash | None, token_ids: Sequence[int]) -> tuple[int, int, int]:
        """``(block, n, n_fresh)``: a registered block after this parent, written by an earlier step's forward,
        whose first ``n`` tokens equal the first ``n`` of ``token_ids``, ``n`` as large as any such block has it
        (``(-1, 0, ...)`` when none shares even one token); ``n_fresh``: the same length over the blocks
        registered since the last :meth:`settle` (not written before this step's forward). Touches nothing;
        O(log siblings)."""
        query = tuple(token_ids)
        block, n = _longest_lead(self._settled.get(parent_hash), query)
        return block, n, _longest_lead(self._fresh.get(parent_hash), query)[1]

    def settle(self) -> None:
        """The step being scheduled is planned: every block registered so far is written before any later
        step's block copies run."""
        for parent, fresh in self._fresh.items():
            settled = self._settled.setdefault(parent, [])
            for entry in fresh:
                insort(settled, entry)
        self._fresh.clear()
        self._fresh_blocks.clear()

    def cached_tokens(self, block_id: int) -> tuple[int, ...] | None:
        """Token ids registered for a block (None if it has no hash)."""
        return self._block_tokens[block_id]

    def cache_entry(self, block_id: int) -> tuple[BlockHash, BlockHash | None, tuple[int, ...]] | None:
        """``(hash, parent_hash, token_ids)`` a block is registered under, or None (to re-register its content
        elsewhere, e.g. after a swap to CPU memory and back)."""
        h = self.block_hash[block_id]
        if h is None:
            return None
        return h, self._block_parent[block_id], self._block_tokens[block_id]  # type: ignore[return-value]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix: evictable blocks become free; in-use blocks lose their hash.

        Returns how many evictable blocks were released.
        """
        released = len(self._evictable)
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self.hash_to_block.clear()
        self._settled.clear()
        self._fresh.clear()
        self._fresh_blocks.clear()
        self.block_hash = [None] * self.num_blocks
        self._block_parent = [None] * self.num_blocks
        self._block_tokens = [None] * self.num_blocks
        return released

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """O(num_blocks) consistency check for tests; raises AssertionError on any violation."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free stack twice"
        evictable = set(self._evictable)
        assert not free & evictable, "a block is both free and cached-evictable"
        for b in range(self.num_blocks):
            rc = self.ref_counts[b]
            h = self.block_hash[b]
            assert rc >= 0, f"block {b} has negative ref_count"
            if rc > 0:
                assert b not in free and b not in evictable, f"block {b} is referenced and free"
            else:
                assert (b in free) != (b in evictable), f"block {b} with ref_count 0 is lost or doubled"
                assert (b in evictable) == (h is not None), f"block {b}: cached state disagrees with hash"
            if h is not None:
                assert self.hash_to_block.get(h) == b, f"block {b}: hash map out of sync"
        assert len(self.hash_to_block) == sum(h is not None for h in self.block_hash)
        indexed = [
            (b, p) for index in (self._settled, self._fresh) for p, sib in index.items() for _, b in sib
        ]
        assert sorted(indexed) == sorted(
            (b, self._block_parent[b]) for b in range(self.num_blocks) if self.block_hash[b] is not None
        ), "sibling index out of sync with the registered blocks"
        for index in (self._settled, self._fresh):
            for siblings in index.values():
                assert siblings and siblings == sorted(siblings), "sibling list empty or out of order"
        assert self._fresh_blocks == {b for sib in self._fresh.values() for _, b in sib}, (
            "fresh set out of sync"
        )


def _unindex(
    index: dict[BlockHash | None, list[tuple[tuple[int, ...], int]]],
    parent: BlockHash | None,
    entry: tuple[tuple[int, ...], int],
) -> None:
    siblings = index[parent]
    del siblings[bisect_left(siblings, entry)]
    if not siblings:
        del index[parent]


def _longest_lead(
    siblings: list[tuple[tuple[int, ...], int]] | None, query: tuple[int, ...]
) -> tuple[int, int]:
    """``(block, n)``: the block of ``siblings`` (sorted by tokens) sharing the longest leading run ``n`` with
    ``query`` (``(-1, 0)``: none shares a token). The longest common leading run of a query with a set of
    sequences sorted lexicographically is reached at one of the query's two neighbours in that order, so only
    those two are compared."""
    if not siblings:
        return -1, 0
    i = bisect_left(siblings, (query,))
    best, best_n = -1, 0
    for tokens, b in siblings[max(0, i - 1) : i + 1]:
        n = 0
        for x, y in zip(tokens, query):
            if x != y:
                break
            n += 1
        if n > best_n:
            best, best_n = b, n
    return best, best_n
