"""Unit tests of the KV cache manager: prefix reuse, LRU, revival, fork + copy-on-write, exhaustion, errors."""

from __future__ import annotations

import pytest

from batchgen.engine.kv.kv_cache import LEAD_PENDING, KVCacheError, KVCacheManager
from batchgen.engine.kv.prefix_reuse import WAIT_FOR_LEAD_MIN_TOKENS

BS = 4


def _prefill(mgr: KVCacheManager, sid, tokens: list[int]) -> int | None:
    """Allocate, 'compute' the prompt and register its full blocks, as the scheduler does."""
    r = mgr.allocate(sid, tokens, len(tokens))
    if r is not None:
        mgr.cache_full_blocks(sid, tokens, len(tokens))
    return r


def test_prefix_reuse_three_and_a_half_blocks():
    mgr = KVCacheManager(32, BS)
    shared = list(range(100, 114))  # 3.5 blocks
    a = shared + [1, 2, 3, 4, 5]
    b = shared + [9, 9, 9, 9, 9]
    assert _prefill(mgr, "a", a) == 0
    assert _prefill(mgr, "b", b) == 3 * BS  # 3 full blocks shared, the partial 4th is not
    ta, tb = mgr.block_table("a"), mgr.block_table("b")
    assert ta[:3] == tb[:3]
    assert ta[3] != tb[3]
    assert all(mgr.pool.ref_counts[x] == 2 for x in ta[:3])
    st = mgr.stats()
    assert st.prefix_hit_tokens == 12 and st.prefix_queried_tokens == len(a) + len(b)
    assert st.blocks_used == 5 + 2  # a: 5 blocks, b: 2 of its own
    assert st.sharing_saved_slots == 12


def test_last_token_block_never_reused():
    mgr = KVCacheManager(16, BS)
    p = list(range(8))  # exactly 2 blocks
    assert _prefill(mgr, "a", p) == 0
    # Same prompt: only 1 block reused, so the last token (in block 2) is recomputed.
    assert _prefill(mgr, "b", p) == BS
    assert mgr.block_table("b")[0] == mgr.block_table("a")[0]
    assert mgr.block_table("b")[1] != mgr.block_table("a")[1]
    assert _prefill(mgr, "c", p + [8]) == 2 * BS


def test_lru_eviction_order_and_revival():
    mgr = KVCacheManager(6, BS)
    pa = [1] * 8 + [0]  # 2 full blocks + 1 partial
    pb = [2] * 8 + [0]
    _prefill(mgr, "a", pa)
    _prefill(mgr, "b", pb)
    ta, tb = mgr.block_table("a"), mgr.block_table("b")
    mgr.free("a")
    mgr.free("b")
    st = mgr.stats()
    assert st.blocks_cached == 4 and st.blocks_free == 6 and st.blocks_used == 0
    # Revival: a's prefix is still cached; the hit takes it out of the evictable set.
    assert _prefill(mgr, "a2", pa) == 8
    assert mgr.block_table("a2")[:2] == ta[:2]
    assert mgr.stats().blocks_cached == 2
    mgr.free("a2")
    # Now LRU order is: b's tail, b's head, a's blocks (freed last). A 4-block request evicts the 2 plain
    # free blocks first, then b's tail and b's head: a's prefix survives.
    assert _prefill(mgr, "c", [3] * 16) == 0
    assert set(mgr.block_table("c")) >= {tb[0], tb[1]}
    assert mgr.stats().num_evictions == 2
    mgr.free("c")
    assert _prefill(mgr, "a3", pa) == 8
    assert _prefill(mgr, "b2", pb) == 0


def test_fork_divergent_writes_copy_on_write_once():
    mgr = KVCacheManager(16, BS)
    prompt = list(range(10))  # 2 full blocks + partial block of 2 tokens
    _prefill(mgr, "p", prompt)
    mgr.fork("p", "c1")
    mgr.fork("p", "c2")
    tp = mgr.block_table("p")
    assert mgr.block_table("c1") == tp and mgr.block_table("c2") == tp
    assert all(mgr.pool.ref_counts[b] == 3 for b in tp)
    free_before = mgr.num_free_blocks
    # Each of the first two writers copies the shared partial block once; the last one owns the original.
    copies_p = mgr.append_slots("p", 11)
    assert len(copies_p) == 1 and copies_p[0][0] == tp[2]
    copies_c1 = mgr.append_slots("c1", 11)
    assert len(copies_c1) == 1 and copies_c1[0][0] == tp[2]
    assert mgr.append_slots("c2", 11) == []
    assert mgr.block_table("c2")[2] == tp[2] and mgr.pool.ref_counts[tp[2]] == 1
    # Subsequent writes never copy again; full prompt blocks stay shared.
    for sid in ("p", "c1", "c2"):
        assert mgr.append_slots(sid, 12) == []
        assert mgr.append_slots(sid, 13) == []  # new block on the boundary, no copy
    assert mgr.stats().num_cow_copies == 2
    assert free_before - mgr.num_free_blocks == 2 + 3
    assert all(mgr.pool.ref_counts[b] == 3 for b in tp[:2])
    for sid in ("p", "c1", "c2"):
        mgr.free(sid)
    assert mgr.num_free_blocks == 16


def test_fork_on_block_boundary_needs_no_copy():
    mgr = KVCacheManager(8, BS)
    _prefill(mgr, "p", list(range(8)))
    mgr.fork("p", "c")
    assert mgr.append_slots("p", 9) == [] and mgr.append_slots("c", 9) == []
    assert mgr.stats().num_cow_copies == 0


def test_exhaustion_and_recovery():
    mgr = KVCacheManager(4, BS, enable_prefix_caching=False)
    assert mgr.allocate("a", list(range(10)), 10) == 0  # 3 blocks
    assert mgr.allocate("b", list(range(10)), 10) is None
    assert "b" not in mgr and mgr.num_free_blocks == 1
    assert mgr.append_slots("a", 12) == []  # fits in the partial block
    assert mgr.append_slots("a", 17) is None and mgr.num_tokens("a") == 12
    assert mgr.append_slots("a", 17) is None
    assert mgr.num_tokens("a") == 12 and len(mgr.block_table("a")) == 3
    assert mgr.allocate("b", [1, 2], 2) == 0  # takes the last block
    assert mgr.append_slots("a", 13) is None
    mgr.free("b")
    assert mgr.append_slots("a", 13) == []
    mgr.free("a")
    assert mgr.num_free_blocks == 4
    assert mgr.allocate("b", list(range(16)), 16) == 0


def test_reserve_blocks_watermark():
    mgr = KVCacheManager(6, BS)
    assert mgr.allocate("a", list(range(8)), 8, reserve_blocks=5) is None
    assert "a" not in mgr and mgr.num_free_blocks == 6
    assert mgr.allocate("a", list(range(8)), 8, reserve_blocks=4) == 0
    assert mgr.num_free_blocks == 4


def test_cow_needs_a_free_block():
    mgr = KVCacheManager(3, BS)
    _prefill(mgr, "p", list(range(6)))  # 2 blocks, second partial
    mgr.fork("p", "c")
    assert mgr.allocate("x", [7], 1) == 0  # last free block
    assert mgr.append_slots("p", 7) is None  # the copy-on-write needs a block
    assert mgr.block_table("p") == mgr.block_table("c")
    mgr.free("x")
    assert len(mgr.append_slots("p", 7)) == 1


def test_chunked_prefill_and_cache_full_blocks():
    mgr = KVCacheManager(16, BS)
    prompt = list(range(20))
    assert mgr.allocate("a", prompt, 6) == 0  # first chunk
    assert len(mgr.block_table("a")) == 2
    mgr.cache_full_blocks("a", prompt, 6)  # block 0 full
    assert mgr.append_slots("a", 20) == []
    mgr.cache_full_blocks("a", prompt, 20)
    assert mgr.allocate("b", prompt + [1], 21) == 20
    assert mgr.allocate("c", prompt[:9], 2) == 8  # table covers the cached prefix at least
    assert mgr.num_tokens("c") == 8


def test_stats_utilization():
    mgr = KVCacheManager(10, BS, enable_prefix_caching=False)
    mgr.allocate("a", [0] * 5, 5)  # 2 blocks, 5 live of 8
    mgr.allocate("b", [0] * 4, 4)  # 1 block, full
    st = mgr.stats()
    assert st.live_token_slots == 9 and st.allocated_token_slots == 12
    assert st.kv_utilization == pytest.approx(0.75)
    assert st.internal_fragmentation == pytest.approx(0.25)
    assert st.peak_blocks_used == 3 and st.num_seqs == 2
    mgr.free("a")
    assert mgr.stats().peak_blocks_used == 3 and mgr.stats().blocks_used == 1


def test_invalid_use_raises():
    mgr = KVCacheManager(8, BS)
    mgr.allocate("a", [1, 2, 3], 3)
    with pytest.raises(KVCacheError, match="already allocated"):
        mgr.allocate("a", [1], 1)
    with pytest.raises(KVCacheError, match="already exists"):
        mgr.fork("a", "a")
    with pytest.raises(KVCacheError, match="shrink"):
        mgr.append_slots("a", 2)
    with pytest.raises(KVCacheError, match="computed"):
        mgr.cache_full_blocks("a", [1, 2, 3, 4, 5], 5)
    mgr.free("a")
    with pytest.raises(KVCacheError, match="already freed"):
        mgr.free("a")
    with pytest.raises(KVCacheError, match="already freed"):
        mgr.append_slots("a", 4)
    with pytest.raises(KVCacheError):
        mgr.block_table("a")
    with pytest.raises(KVCacheError):
        mgr.fork("nope", "b")
    with pytest.raises(KVCacheError):
        mgr.allocate("z", [1], -1)
    assert mgr.num_free_blocks == 8


def test_prefix_ending_inside_a_block_is_copied_once_written():
    mgr = KVCacheManager(32, BS)
    shared = list(range(100, 114))  # 3.5 blocks
    a = shared + [1, 2, 3, 4, 5]
    b = shared + [9, 9, 9, 9, 9]
    assert _prefill(mgr, "a", a) == 0
    # a's 4th block (tokens 12..15: 112, 113, 1, 2) is registered by this step: not written yet
    assert _prefill(mgr, "early", shared + [7]) == 3 * BS
    assert mgr.end_schedule() == []
    free_before = mgr.num_free_blocks
    assert _prefill(mgr, "b", b) == 3 * BS + 2  # 3 shared blocks + 112, 113 copied
    ta, tb = mgr.block_table("a"), mgr.block_table("b")
    assert ta[:3] == tb[:3] and tb[3] != ta[3]
    assert mgr.pool.ref_counts[ta[3]] == 2  # held for the copy until the schedule ends
    assert free_before - mgr.num_free_blocks == 2  # b's blocks 3 and 4
    assert mgr.end_schedule() == [(ta[3], tb[3])]
    assert mgr.pool.ref_counts[ta[3]] == 1
    st = mgr.stats()
    assert st.prefix_hit_tokens == 12 + 14 and st.num_prefix_copies == 1 and st.num_cow_copies == 0
    assert st.live_token_slots == len(a) + 3 + len(b) - 12  # the copied slots are b's own


def test_copy_source_is_held_against_eviction_and_counted_in_the_cost():
    mgr = KVCacheManager(6, BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 2 full blocks + 2 tokens
    _prefill(mgr, "a", a)
    src = mgr.block_table("a")[1]
    mgr.end_schedule()
    mgr.free("a")  # its two full blocks stay cached (evictable)
    b = [1, 2, 3, 4, 5, 6, 0, 0, 0]  # shares block 0, then 5, 6 of block 1
    assert mgr.allocate_cost(b, len(b)) == 3 + 1  # block 0 revived, 2 own blocks, the held source
    assert mgr.allocate("b", b, len(b)) == BS + 2
    copy = (src, mgr.block_table("b")[1])
    # 6 blocks: b holds 3, the copy source 1, 2 are left; the source survives other allocations
    assert mgr.allocate("c", [50] * 8, 8) == 0
    assert mgr.pool.block_hash[src] is not None and mgr.pool.ref_counts[src] == 1
    assert mgr.allocate("d", [60] * 4, 4) is None
    assert mgr.end_schedule() == [copy]
    assert mgr.pool.ref_counts[src] == 0 and mgr.num_free_blocks == 1
    mgr.pool.check_invariants()


def test_a_request_waits_only_for_a_pending_run_much_longer_than_a_written_one():
    mgr = KVCacheManager(32, 8)
    head = list(range(8))
    _prefill(mgr, "b", head + [1, 2, 3, 4, 4, 4, 4, 4, 9])  # block 1 = 1, 2, 3, 4, 4, ...
    mgr.end_schedule()
    # c copies 1, 2, 3 from b; its own block 1 = 1, 2, 3, 5, 6, 7, 8, 9 is registered this step
    assert _prefill(mgr, "c", head + [1, 2, 3, 5, 6, 7, 8, 9, 0]) == 8 + 3
    # d would copy 1, 2, 3, 5 from c (not written yet) against 1, 2, 3 from b: not worth a wait
    assert mgr.allocate("d", head + [1, 2, 3, 5, 0, 0, 0], 15, wait_for_lead=True) == 8 + 3
    # e continues c's run 1, 2, 3, 5, 6, 7, 8 (7 tokens) against b's 3: it waits for c's block...
    e = head + [1, 2, 3, 5, 6, 7, 8, 0, 0]
    assert WAIT_FOR_LEAD_MIN_TOKENS == 4
    assert mgr.allocate("e", e, 17, wait_for_lead=True) == LEAD_PENDING
    assert mgr.allocate("e", e, 17) == 8 + 3  # ...or copies b's shorter run
    assert len(mgr.end_schedule()) == 3  # c, d, e
    assert mgr.allocate("f", e, 17, wait_for_lead=True) == 8 + 7
    assert mgr.end_schedule() == [(mgr.block_table("c")[1], mgr.block_table("f")[1])]
