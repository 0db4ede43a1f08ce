"""Scheduler unit tests with no model: the scheduler and KV cache manager alone, driven step by step.

Each test builds sequences of known length, calls ``schedule()``, checks what it decided, and feeds the
step back with ``update()`` (a fixed token for every sampled sequence), like the engine does.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.kinds import make_group
from batchgen.engine.sched.output import SchedulerOutput
from batchgen.engine.sched.request_group import RequestGroup
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.sched.sequence import Request, SequenceStatus
from batchgen.engine.sched.stop import StopRules
from batchgen.engine.worker.step_input import RunnerOutput
from batchgen.sampling_params import SamplingParams

BS = 4
EOS = 999


def make_scheduler(num_blocks: int = 64, **config) -> Scheduler:
    cfg = EngineConfig(block_size=8, **config)  # EngineConfig only allows 8..64; the manager uses BS
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=config.get("enable_prefix_caching", True))
    return Scheduler(cfg, kv, StopRules.build([EOS], max_model_len=1000))


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 100, first_token: int = 0, n: int = 1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    request = Request(rid, [first_token + i for i in range(prompt_len)], params)
    seq = request.new_sequence(list(request.prompt_token_ids), 0)
    sched.add(make_group(request, seq, sched.stop))
    return seq


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    n = len(out.sample_seqs)
    return out, sched.update(out, RunnerOutput([token] * n, [None] * n))


def scheduled(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.seq.request.request_id, s.start, s.num_tokens) for s in out.seqs]


def test_token_budget_chunks_prefill_across_steps():
    sched = make_scheduler(max_num_batched_tokens=10)
    seq = add(sched, "a", 25)
    progress = []
    for _ in range(3):
        out, _ = step(sched)
        progress.append(scheduled(out))
        assert out.num_batched_tokens <= 10
    assert progress == [[("a", 0, 10)], [("a", 10, 10)], [("a", 20, 5)]]
    assert out.sample_seqs == [seq]  # only the chunk that completes the prompt samples
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 25
    out, _ = step(sched)
    assert scheduled(out) == [("a", 25, 1)]


def test_budget_shared_between_decodes_and_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=8)
    add(sched, "a", 3)
    step(sched)
    add(sched, "b", 20, first_token=100)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 3, 1), ("b", 0, 7)]


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", 3, first_token=10 * i)
    out, _ = step(sched)
    assert [r for r, _, _ in scheduled(out)] == ["r0", "r1"]
    assert len(sched.waiting) == 2


def test_decodes_come_first_in_the_batch():
    sched = make_scheduler(max_num_batched_tokens=64)
    add(sched, "long", 30)
    add(sched, "short", 2, first_token=100)
    step(sched)  # both prefilled, both sampled
    add(sched, "new", 5, first_token=200)
    out, _ = step(sched)
    assert scheduled(out) == [("long", 30, 1), ("short", 2, 1), ("new", 0, 5)]
    assert out.num_decodes == 2


def test_watermark_counts_prefix_cache_hits():
    # 9 blocks: watermark is max(1, 9 // 100) = 1 free block kept while something runs.
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=100)
    add(sched, "a", 17)  # 5 blocks, 4 of them full and cached once computed
    step(sched)
    # b (5 blocks) shares a's 16-token prefix, so it needs 1 new block: admitted, although 4 free blocks
    # minus the watermark could not hold all 5 of its blocks without counting the hits.
    add(sched, "b", 20)
    add(sched, "c", 24, first_token=500)  # 6 blocks: does not fit beside a and b with the watermark
    out, _ = step(sched)
    assert [r for r, _, _ in scheduled(out)] == ["a", "b"]
    assert sched.waiting[0].request.request_id == "c"
    assert sched.stats.prompt_tokens_cached == 16
    assert sched.kv.num_free_blocks >= sched.watermark_blocks


def test_preemption_picks_most_recently_admitted_and_resumes():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=100)
    a = add(sched, "a", 8, max_tokens=16)  # 2 blocks each at first, 6 each at the end: 12 > 8
    b = add(sched, "b", 8, max_tokens=16, first_token=100)
    step(sched)
    assert a.status is b.status is SequenceStatus.RUNNING
    preempted_at = None
    for i in range(12):
        out, _ = step(sched)
        if b.status is SequenceStatus.WAITING and preempted_at is None:
            preempted_at = i
            assert a.status is SequenceStatus.RUNNING  # the older one keeps running
            assert b.num_computed_tokens == 0 and b.num_output_tokens > 0  # keeps its tokens
            assert sched.waiting[0].seqs == [b]
    assert preempted_at is not None and sched.stats.num_preemptions >= 1
    # Run to the end: b comes back, recomputes its prompt + output, and finishes with all 16 tokens.
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 16
    assert a.finish_reason == b.finish_reason == "length"
    assert sched.kv.stats().blocks_used == 0


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=100)
    a = add(sched, "a", 8, max_tokens=8)
    b = add(sched, "b", 8, max_tokens=8, first_token=100)
    step(sched)
    out, _ = step(sched)  # both need a third block: only one is free after the first grows
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert [r for r, _, _ in scheduled(out)] == ["a"]


def test_fork_at_prompt_completion_shares_blocks():
    sched = make_scheduler()
    seq = add(sched, "a", 6, n=3, max_tokens=2)
    out, _ = step(sched)
    assert len(out.sample_seqs) == 3 and out.sample_rows == [0, 0, 0]
    tables = [sched.kv.block_table(s.seq_id) for s in seq.request.seqs]
    assert tables[0] == tables[1] == tables[2]
    out, done = step(sched)
    assert out.num_decodes == 3 and len(out.copies) == 2  # copy-on-write of the shared partial block
    assert done == [seq.request] and seq.request.is_finished
    assert sched.kv.stats().blocks_used == 0


def test_stop_rules_finish_and_free():
    sched = make_scheduler()
    seq = add(sched, "a", 5)
    _, done = step(sched, token=EOS)
    assert done == [seq.request] and seq.finish_reason == "stop"
    assert not sched.has_unfinished() and sched.kv.stats().blocks_used == 0


@pytest.mark.parametrize("cap", [1, 3])
def test_unservable_request_is_reported(cap):
    sched = make_scheduler(num_blocks=cap)

    def why(prompt_len: int) -> str | None:
        request = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=1))
        group = make_group(request, request.new_sequence(list(request.prompt_token_ids), 0), sched.stop)
        return group.unservable(sched.kv, sched.config.max_num_seqs, sched.stop)

    assert why(4 * cap) is not None
    assert why(2) is None


# ------------------------------------------------------------------------------ beam groups and swapping
# A fake model for the scheduler alone: next-token log-probabilities are a fixed function of the tokens so far,
# so a run's results do not depend on batching, preemption or swapping, only on the scheduler being right.
V = 48


def fake_logprobs(tokens: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(bytes(str(tokens), "ascii")))
    return torch.log_softmax(torch.randn(V, generator=g) * 3, dim=-1)


def add_beam(
    sched: Scheduler, rid: str, prompt_len: int, k: int, max_tokens: int, first_token: int = 0, **kw
):
    params = SamplingParams(max_tokens=max_tokens, beam_width=k, n=k, **kw)
    request = Request(rid, [(first_token + i) % V for i in range(prompt_len)], params)
    sched.add(make_group(request, request.new_sequence(list(request.prompt_token_ids), 0), sched.stop))
    return request


def fake_step(sched: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    completing = {s.seq.seq_id for s in out.seqs if s.completes}
    for s in out.seqs:  # a beam group samples as a whole or not at all
        beam = s.seq.request.ranked
        if beam is not None and s.completes:
            assert all(b.seq_id in completing for b in beam.beams), "a beam group sampled in part"
    tokens = [int(fake_logprobs(s.token_ids).argmax()) for s in out.sample_seqs]
    scores = None
    if out.score_rows:
        scores = torch.stack([fake_logprobs(out.seqs[r].seq.token_ids) for r in out.score_rows])
    done = sched.update(out, RunnerOutput(tokens, [None] * len(tokens), scores=scores))
    check_units(sched)
    return out, done


def check_units(sched: Scheduler) -> None:
    """Every beam group is in one state; refcounts match the tables (swapped ones included)."""
    for group in [*sched.running, *sched.waiting, *sched.swapped]:
        assert group.seqs and all(s.group is group for s in group.seqs)
        assert len({s.status for s in group.seqs}) == 1, "a group is split across states"
    kv = sched.kv
    kv.pool.check_invariants()
    refs: dict[int, int] = {}
    for sid in kv._seqs:
        for b in kv.raw_table(sid):
            if b >= 0:
                refs[b] = refs.get(b, 0) + 1
    assert all(kv.pool.ref_counts[b] == refs.get(b, 0) for b in range(kv.num_blocks))


def run_all(sched: Scheduler, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        fake_step(sched)
    raise AssertionError("did not finish")


def results(requests: list[Request]) -> list[list[list[int]]]:
    out = []
    for r in requests:
        if r.ranked is not None:
            out.append([h.token_ids for h in r.ranked.results()])
        else:
            out.append([s.output_token_ids for s in r.seqs])
    return out


def test_beam_group_forks_share_blocks_and_copy_only_the_partial_block():
    sched = make_scheduler(num_blocks=64)
    request = add_beam(sched, "b", 10, k=4, max_tokens=6, ignore_eos=True)  # 3 blocks, the last holds 2
    out, _ = fake_step(sched)
    assert out.score_rows == [0] and out.sample_rows == []
    beams = request.ranked.beams
    assert len(beams) == 4 and all(b.status is SequenceStatus.RUNNING for b in beams)
    tables = [sched.kv.block_table(b.seq_id) for b in beams]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert sched.kv.stats().blocks_used == 3  # 12 logical blocks, 3 physical
    out, _ = fake_step(sched)
    assert out.num_decodes == 4 and len(out.score_rows) == 4
    assert len(out.copies) == 3  # the shared partial block: copied for 3 beams, written in place by the 4th
    assert {src for src, _ in out.copies} == {tables[0][2]}
    run_all(sched)
    assert request.num_finished == 4 and len(request.ranked.results()) == 4
    assert [len(h.token_ids) for h in request.ranked.results()] == [6] * 4
    assert sched.kv.stats().blocks_used == 0 and not sched.running


def _mixed_workload(sched: Scheduler) -> list[Request]:
    reqs = []
    for i in range(3):
        reqs.append(add_beam(sched, f"b{i}", 9 + 5 * i, k=2 + 2 * (i % 2), max_tokens=14, first_token=7 * i))
    for i in range(4):
        seq = add(sched, f"g{i}", 6 + 3 * i, max_tokens=12, first_token=3 + 5 * i)
        reqs.append(seq.request)
    return reqs


@pytest.mark.parametrize(
    "mode,num_blocks,cpu_blocks",
    [("recompute", 24, 0), ("swap", 24, 64), ("swap", 22, 6)],
    ids=["recompute", "swap", "swap-cpu-full"],
)
def test_beam_groups_and_sequences_survive_preemption(mode: str, num_blocks: int, cpu_blocks: int):
    ref_sched = make_scheduler(num_blocks=512)
    ref = results(_run(ref_sched))
    cfg = {"preemption_mode": mode, "max_num_batched_tokens": 64}
    sched = Scheduler(
        EngineConfig(block_size=8, **cfg),
        KVCacheManager(num_blocks, BS, num_cpu_blocks=cpu_blocks),
        StopRules.build([EOS], max_model_len=1000),
    )
    got = results(_run(sched))
    assert got == ref
    st = sched.stats
    assert st.num_preemptions > 0
    if mode == "swap":
        assert st.num_swapped_out_blocks > 0 and st.num_swapped_in_blocks > 0
    else:
        assert st.num_swapped_out_blocks == 0
    assert sched.kv.stats().blocks_used == 0 and sched.kv.num_free_cpu_blocks == cpu_blocks


def _run(sched: Scheduler) -> list[Request]:
    reqs = _mixed_workload(sched)
    run_all(sched)
    return reqs


def test_swap_fallback_to_recompute_when_cpu_pool_is_full():
    sched = Scheduler(
        EngineConfig(block_size=8, preemption_mode="swap", max_num_batched_tokens=64),
        KVCacheManager(16, BS, num_cpu_blocks=6),
        StopRules.build([EOS], max_model_len=1000),
    )
    for i in range(4):
        add(sched, f"r{i}", 8, max_tokens=20, first_token=10 * i)
    saw_swapped = saw_recomputed = False
    while sched.has_unfinished():
        fake_step(sched)
        saw_swapped |= bool(sched.swapped)
        saw_recomputed |= any(s.num_output_tokens > 0 for g in sched.waiting for s in g.seqs)
        assert sched.kv.stats().cpu_blocks_used <= 6
    assert saw_swapped and saw_recomputed
    assert sched.stats.num_swapped_in_blocks == sched.stats.num_swapped_out_blocks > 0


def test_swapped_unit_that_cannot_fit_while_nothing_runs_is_recomputed():
    """Blocks other swapped sequences keep on the GPU (shared with a sequence swapped later) can leave too little
    room for a swapped unit even with nothing running: it is recomputed instead of waiting forever."""
    sched = Scheduler(
        EngineConfig(block_size=8, preemption_mode="swap"),
        KVCacheManager(6, BS, num_cpu_blocks=16),
        StopRules.build([EOS], max_model_len=1000),
    )
    kv = sched.kv

    def swapped_seq(rid: str, prompt_len: int, first: int):
        seq = add(sched, rid, prompt_len, max_tokens=4, first_token=first)
        sched.waiting.pop()
        seq.token_ids.append(1)  # one token generated: the next step is a decode
        kv.allocate(seq.seq_id, seq.token_ids, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        return seq

    def swap(seq):
        assert kv.swap_out([seq.seq_id]) is not None
        seq.status = SequenceStatus.SWAPPED
        sched.swapped.append(seq.group)

    big = swapped_seq("big", 15, 0)  # 4 blocks
    swap(big)
    a = swapped_seq("a", 8, 100)  # 3 blocks
    # Another request sharing all of a's blocks (as prefix-cache hits would).
    b = Request("b", list(a.request.prompt_token_ids), a.request.params).new_sequence(list(a.token_ids), 0)
    RequestGroup(b.request, b)
    b.num_computed_tokens = a.num_computed_tokens
    kv.fork(a.seq_id, b.seq_id)
    swap(a)
    swap(b)
    # a's blocks stayed on the GPU for b, then b's (shared) ones too: 3 of 6 blocks held, big needs 4 + 1.
    assert kv.stats().blocks_used == 3 and kv.swap_in_cost([big.seq_id]) == 4
    out, _ = fake_step(sched)
    assert big.status is SequenceStatus.WAITING and big.num_computed_tokens == 0
    assert {s.seq.seq_id for s in out.seqs} == {a.seq_id, b.seq_id}
    run_all(sched)
    assert big.num_output_tokens == a.num_output_tokens == b.num_output_tokens == 4
    assert kv.stats().blocks_used == 0 and kv.num_free_cpu_blocks == 16


def test_a_prefix_ending_inside_a_block_waits_a_step_then_is_copied():
    cfg = EngineConfig(block_size=8)
    sched = Scheduler(cfg, KVCacheManager(64, 8), StopRules.build([EOS], max_model_len=1000))
    a = add(sched, "a", 20)  # tokens 0..19: blocks [0..7] [8..15] [16..19]
    prompt = list(range(14)) + [50, 51, 52, 53]  # shares a's first block and 8..13 of its second
    request = Request("b", prompt, SamplingParams(max_tokens=5, temperature=0.0))
    b = request.new_sequence(list(prompt), 0)
    sched.add(make_group(request, b, sched.stop))
    out, _ = step(sched)
    # b would copy 8..13 from a's second block, which this step computes: b waits
    assert scheduled(out) == [("a", 0, 20)] and out.copies == []
    out, _ = step(sched)
    assert scheduled(out) == [("a", 20, 1), ("b", 14, 4)]
    ta, tb = sched.kv.block_table(a.seq_id), sched.kv.block_table(b.seq_id)
    assert tb[0] == ta[0] and out.copies == [(ta[1], tb[1])]
    assert request.num_cached_tokens == 8 and sched.stats.prompt_tokens_copied == 6
    assert sched.stats.num_cow_copies == 0


def test_groups_behind_one_waiting_for_its_lead_are_admitted_meanwhile():
    cfg = EngineConfig(block_size=8)
    sched = Scheduler(cfg, KVCacheManager(64, 8), StopRules.build([EOS], max_model_len=1000))
    add(sched, "a", 20)  # tokens 0..19
    prompt = list(range(14)) + [50, 51, 52, 53]  # would copy 8..13 from the block a computes this step
    request = Request("b", prompt, SamplingParams(max_tokens=5, temperature=0.0))
    sched.add(make_group(request, request.new_sequence(list(prompt), 0), sched.stop))
    add(sched, "c", 12, first_token=100)  # shares nothing: not held back by b
    add(sched, "d", 12, first_token=200)
    out, _ = step(sched)
    assert scheduled(out) == [("a", 0, 20), ("c", 0, 12), ("d", 0, 12)]
    assert [g.request.request_id for g in sched.waiting] == ["b"]
    out, _ = step(sched)  # b's turn comes first: it copies the run a wrote
    assert ("b", 14, 4) in scheduled(out) and len(out.copies) == 1
    assert request.num_cached_tokens == 8 and sched.stats.prompt_tokens_copied == 6


def test_a_group_waiting_for_its_lead_keeps_its_seat():
    """Groups admitted past one waiting for its lead never take its seat: it runs in the next step, before any
    later group that would otherwise have filled the sequence cap."""
    cfg = EngineConfig(block_size=8, max_num_seqs=3)
    sched = Scheduler(cfg, KVCacheManager(64, 8), StopRules.build([EOS], max_model_len=1000))
    add(sched, "a", 20)
    prompt = list(range(14)) + [50, 51, 52, 53]
    request = Request("b", prompt, SamplingParams(max_tokens=5, temperature=0.0))
    sched.add(make_group(request, request.new_sequence(list(prompt), 0), sched.stop))
    for rid, first in (("c", 100), ("d", 200), ("e", 300)):
        add(sched, rid, 12, first_token=first)
    out, _ = step(sched)
    assert [r for r, _, _ in scheduled(out)] == ["a", "c"]  # b's seat is kept: d and e wait
    out, _ = step(sched)
    assert [r for r, _, _ in scheduled(out)] == ["a", "c", "b"]
