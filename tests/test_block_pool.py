"""Unit tests of the physical block pool: allocation order, refcounts, LRU cache, revival, hashing."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from batchgen.engine.kv.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens


def _fill(pool: BlockPool, blocks: list[int], first_token: int) -> list[bytes]:
    """Register each block as a full block of a chain; returns the hashes."""
    hashes, parent = [], None
    for i, b in enumerate(blocks):
        toks = [first_token + i] * pool.block_size
        h = hash_block_tokens(parent, toks)
        assert pool.cache_block(b, h, parent, toks)
        hashes.append(h)
        parent = h
    return hashes


def test_allocate_free_batch_and_counts():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    assert a == [0, 1, 2]  # block 0 is not reserved
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert pool.allocate(0) == []
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8))
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.free(a) == 3
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_allocate_too_many_changes_nothing():
    pool = BlockPool(4, 2)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_refcount_and_over_free():
    pool = BlockPool(4, 2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_counts[b] == 2
    assert pool.free([b]) == 0
    assert pool.free([b]) == 1
    with pytest.raises(ValueError):
        pool.free([b])
    with pytest.raises(ValueError):
        pool.incref([b])  # free, uncached block: allocate it instead


def test_freed_hashed_blocks_stay_cached_and_evict_lru():
    pool = BlockPool(6, 2)
    a = pool.allocate(2)
    b = pool.allocate(2)
    ha = _fill(pool, a, 10)
    hb = _fill(pool, b, 20)
    pool.free(reversed(a))  # a freed first: a[1] is the oldest, then a[0]
    pool.free(reversed(b))
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 6
    # Two plain free blocks are handed out before any cached block is evicted.
    plain = pool.allocate(2)
    assert set(plain).isdisjoint(a + b) and pool.num_evictions == 0
    assert pool.lookup(ha[0], None, [10, 10]) == a[0]
    # Then cached blocks go in LRU order: a's tail, a's head, b's tail.
    assert pool.allocate(1) == [a[1]]
    assert pool.allocate(1) == [a[0]]
    assert pool.lookup(ha[0], None, [10, 10]) is None
    assert pool.allocate(1) == [b[1]]
    assert pool.lookup(hb[0], None, [20, 20]) == b[0]
    assert pool.num_evictions == 3
    pool.check_invariants()


def test_revival_of_cached_block():
    pool = BlockPool(3, 2)
    (b,) = pool.allocate(1)
    (h,) = _fill(pool, [b], 7)
    pool.free([b])
    assert pool.num_cached_blocks == 1 and pool.ref_counts[b] == 0
    hit = pool.lookup(h, None, [7, 7])
    assert hit == b
    pool.incref([hit])  # revive: leaves the evictable set
    assert pool.ref_counts[b] == 1 and pool.num_cached_blocks == 0 and pool.num_free_blocks == 2
    assert b not in pool.allocate(2)  # cannot be evicted while in use
    pool.check_invariants()


def test_lookup_checks_tokens_and_parent():
    pool = BlockPool(4, 2)
    (b,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(b, h, None, [1, 2])
    assert pool.lookup(h, None, [1, 2]) == b
    assert pool.lookup(h, None, [1, 3]) is None  # a (forced) collision never returns wrong tokens
    assert pool.lookup(h, b"other parent", [1, 2]) is None


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4, 2)
    b1, b2 = pool.allocate(2)
    h = hash_block_tokens(None, [5, 5])
    assert pool.cache_block(b1, h, None, [5, 5])
    assert not pool.cache_block(b2, h, None, [5, 5])
    pool.free([b2])
    assert pool.num_cached_blocks == 0  # the unregistered duplicate is a plain free block
    with pytest.raises(ValueError):
        pool.cache_block(b1, h, None, [5])  # partial blocks are never cached


def test_caching_disabled():
    pool = BlockPool(2, 2, enable_caching=False)
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, hash_block_tokens(None, [1, 1]), None, [1, 1])
    pool.free([b])
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    _fill(pool, a, 3)
    pool.free([a[1]])
    assert pool.reset_prefix_cache() == 1
    assert pool.num_cached_blocks == 0 and not pool.hash_to_block
    pool.check_invariants()


def test_hash_chained_and_stable_across_processes():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4]) and len(h1) == 32
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [1, 2]) != hash_block_tokens(None, [1, 2])
    code = (
        "from batchgen.engine.kv.block_pool import hash_block_tokens as h; print(h(None, [1, 2, 3, 4]).hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": s},
        ).stdout.strip()
        for s in ("1", "2")
    }
    assert outs == {h1.hex()}


def test_longest_lead_finds_the_longest_leading_run_among_settled_blocks():
    pool = BlockPool(8, 4)
    blocks = pool.allocate(4)
    contents = [[1, 2, 3, 4], [1, 2, 9, 9], [1, 5, 5, 5], [7, 7, 7, 7]]
    for b, toks in zip(blocks, contents):
        pool.cache_block(b, hash_block_tokens(None, toks), None, toks)
    # registered in the step being scheduled: not a copy source yet, but reported as pending
    assert pool.longest_lead(None, [1, 2, 3]) == (-1, 0, 3)
    pool.settle()
    assert pool.longest_lead(None, [1, 2, 3]) == (blocks[0], 3, 0)
    assert pool.longest_lead(None, [1, 2, 9, 8]) == (blocks[1], 3, 0)
    block, n, _ = pool.longest_lead(None, [1, 6])
    assert n == 1 and block in blocks[:3]  # any of the three sharing "1"
    assert pool.longest_lead(None, [7, 7]) == (blocks[3], 2, 0)
    assert pool.longest_lead(None, [8]) == (-1, 0, 0)
    assert pool.longest_lead(b"another parent", [1, 2, 3]) == (-1, 0, 0)
    pool.check_invariants()


def test_longest_lead_agrees_with_a_scan_and_forgets_evicted_blocks():
    rng = random.Random(0)
    pool = BlockPool(64, 4)
    for _ in range(300):
        if pool.num_free_blocks == 0 or rng.random() < 0.3:
            used = [b for b in range(64) if pool.ref_counts[b]]
            if used:
                pool.free([rng.choice(used)])
            continue
        (b,) = pool.allocate(1)  # may evict a cached block
        toks = [rng.randrange(3) for _ in range(4)]
        pool.cache_block(b, hash_block_tokens(None, toks), None, toks)
        if rng.random() < 0.5:
            pool.settle()
        query = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]

        def run(b: int, query: list[int] = query) -> int:
            n = 0
            for x, y in zip(pool.cached_tokens(b) or (), query):
                if x != y:
                    break
                n += 1
            return n

        registered = [b for b in range(64) if pool.block_hash[b] is not None]
        fresh = pool._fresh_blocks
        block, n, n_fresh = pool.longest_lead(None, query)
        assert n == max((run(x) for x in registered if x not in fresh), default=0)
        assert n_fresh == max((run(x) for x in registered if x in fresh), default=0)
        assert (block == -1) == (n == 0) and (block == -1 or run(block) == n)
        pool.check_invariants()
