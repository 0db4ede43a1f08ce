"""The KV figures the report prints stay true: the manager's incremental live-slot counter equals a recount over
the block tables after every schedule, and fragmentation stays within [0, 1], through prefix hits, partial-block
copies, preemption (recompute and swap) and forks."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.kv.kv_cache import KVCacheManager

BS = 8


def _check(mgr: KVCacheManager) -> None:
    st = mgr.stats()
    assert st.live_token_slots == mgr.recount_live_slots()
    assert 0 <= st.live_token_slots <= st.allocated_token_slots
    assert 0.0 <= st.internal_fragmentation <= 1.0


def test_a_copied_run_and_a_hit_on_the_same_evictable_block_keep_the_count() -> None:
    """One schedule copies the run of an evictable cached block (its source held until end_schedule) while
    another sequence shares that whole block: the block's slots are counted once, and freed once."""
    mgr = KVCacheManager(16, BS)
    first = list(range(1, 17)) + [99]
    mgr.allocate("a", first, len(first))
    mgr.cache_full_blocks("a", first, len(first))
    mgr.end_schedule()
    mgr.free("a")  # blocks 0 and 1 stay cached, evictable
    _check(mgr)
    copy = list(range(1, 9)) + [
        9,
        10,
        11,
        12,
        50,
        51,
        52,
        53,
        54,
    ]  # block 0 shared, 9..12 copied from block 1
    hit = list(range(1, 17)) + [77]  # blocks 0 and 1 shared
    assert mgr.allocate("b", copy, len(copy)) == 12
    assert mgr.allocate("c", hit, len(hit)) == 16
    assert mgr.end_schedule()  # the copy runs
    _check(mgr)
    mgr.free("c")
    _check(mgr)
    mgr.free("b")
    _check(mgr)
    assert mgr.stats().live_token_slots == 0


def test_a_held_source_whose_sequence_ends_in_the_schedule_is_released_once() -> None:
    mgr = KVCacheManager(16, BS)
    first = list(range(1, 17)) + [99]
    mgr.allocate("a", first, len(first))
    mgr.cache_full_blocks("a", first, len(first))
    mgr.end_schedule()
    copy = list(range(1, 9)) + [9, 10, 11, 50, 51]
    assert mgr.allocate("b", copy, len(copy)) == 11  # holds a's block 1 as the copy's source
    mgr.free("a")  # a ends (or is preempted) before the schedule ends
    mgr.end_schedule()
    _check(mgr)
    mgr.free("b")
    _check(mgr)
    assert mgr.stats().live_token_slots == 0


@pytest.mark.parametrize("mode,blocks", [("recompute", 64), ("recompute", 16), ("swap", 16)])
def test_counter_equals_recount_through_an_engine_run(llama_ckpt: str, mode: str, blocks: int, monkeypatch):
    """Prompts sharing a prefix that ends inside a block, in two rounds (the second finds the first's blocks
    evictable: one admission shares a whole cached block that another copies a run of, in one schedule),
    several samples per prompt, and (16 blocks) a pool small enough to preempt: after every schedule the counter
    equals the recount."""
    checked = []
    end_schedule = KVCacheManager.end_schedule

    def checking(self: KVCacheManager):
        copies = end_schedule(self)
        _check(self)
        checked.append(1)
        return copies

    monkeypatch.setattr(KVCacheManager, "end_schedule", checking)
    base = "Summarise the report on river levels in spring and autumn"
    prompts = [base + t for t in (" item one two three four five six seven", " item", " it", " items")] * 3
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0.8, seed=i, n=1 + i % 3) for i in range(12)]
    llm = LLM(
        llama_ckpt, num_blocks=blocks, block_size=BS, max_num_seqs=8, preemption_mode=mode, num_swap_blocks=64
    )
    for _ in range(2):
        llm.generate(prompts, params, use_tqdm=False)
    st = llm.engine.stats
    assert checked
    assert st.prompt_tokens_cached > 0 and st.prompt_tokens_copied > 0
    assert (st.num_preemptions > 0) == (blocks == 16)
    assert 0.0 <= st.peak_kv_fragmentation <= 1.0
