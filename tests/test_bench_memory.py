"""The memory benchmark (``python -m batchgen.bench.memory --small``): it runs, its figures are sane, and its
batchgen figures are the engine scheduler's own (driven here by hand, so the two cannot drift apart)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batchgen.bench import memory
from batchgen.bench.fake_runner import FakeRequest
from batchgen.bench.memory import FirstFitContiguousKV
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.stats import EngineCounters, EngineStats, StatsCollector
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.kinds import make_group
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.sched.sequence import Request
from batchgen.engine.sched.stop import StopRules
from batchgen.engine.worker.step_input import RunnerOutput
from batchgen.sampling_params import SamplingParams


def test_first_fit_extents_merge_back():
    kv = FirstFitContiguousKV(100)
    a = kv.admit(FakeRequest([1] * 10, 20))  # 30 slots
    b = kv.admit(FakeRequest([1] * 10, 20, n=2))  # 2 x 30
    assert a is not None and b is not None
    assert kv.admit(FakeRequest([1] * 10, 10)) is None  # 10 free, needs 20
    assert kv.external(FakeRequest([1] * 10, 10)) == 10
    for e in b + a:
        kv.release(e)
    assert kv.starts == [0] and kv.lengths == [100] and kv.reserved == 0


def test_memory_bench_small(tmp_path, capsys):
    results = memory.main(["--small", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| KV memory utilization" in out and "Block-size sweep" in out
    for wl in ("fixed", "sharegpt"):
        rs = [r for r in results if r.workload == wl]
        assert {r.scenario for r in rs} == {"unique", "prefix", "fork"}
        for r in rs:
            parts = r.live_share + r.internal_fragmentation + r.external_fragmentation + r.idle_free
            assert parts == pytest.approx(1.0)
            assert 0.0 < r.kv_utilization <= 1.0 and r.memory_bound_steps > 0
            if r.system.startswith("contiguous"):
                assert r.sharing_saved == 0.0 and r.preemptions == 0
        contig = next(r for r in rs if r.scenario == "unique" and r.system == memory.CONTIGUOUS)
        paged = next(r for r in rs if r.scenario == "unique" and r.system == "paged bs=16")
        assert paged.kv_utilization > contig.kv_utilization + 0.2
        assert paged.fragmentation < contig.fragmentation / 2
        assert paged.mean_concurrent_requests > 1.5 * contig.mean_concurrent_requests
        prefix = next(r for r in rs if r.scenario == "prefix" and r.system == "paged bs=16")
        no_cache = next(
            r for r in rs if r.scenario == "prefix" and r.system == "paged bs=16, no prefix cache"
        )
        assert prefix.sharing_saved > 0.2 and prefix.prefix_hit_rate > 0.3 and no_cache.sharing_saved == 0.0
        assert prefix.mean_concurrent_requests > no_cache.mean_concurrent_requests
        fork = next(r for r in rs if r.scenario == "fork" and r.system == "paged bs=16")
        assert fork.sharing_saved > 0.1
        # smaller blocks never waste more of their reservation
        utils = [
            next(r for r in rs if r.scenario == "unique" and r.system == f"paged bs={bs}").kv_utilization
            for bs in (8, 64)
        ]
        assert utils[0] > utils[1]
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["config"]["kv_bytes_per_token"] == 819_200 and len(data["results"]) == len(results)


def test_memory_bench_charts(tmp_path):
    pytest.importorskip("matplotlib", reason="charts need the bench extra (matplotlib)")
    memory.main(["--small", "--workloads", "fixed", "--requests", "16", "--out", str(tmp_path)])
    assert (tmp_path / "memory_fixed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _drive_scheduler_by_hand(config: EngineConfig, requests: list[FakeRequest], mml: int, seed: int):
    """The engine's loop with the model replaced by random tokens, written out here on purpose."""
    kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
    sched = Scheduler(config, kv, StopRules.build([], mml))
    collector = StatsCollector(EngineStats(), sched.stats, kv, EngineCounters())
    for i, r in enumerate(requests):
        params = SamplingParams(n=r.n, temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        req = Request(i, list(r.prompt), params)
        sched.add(make_group(req, req.new_sequence(list(r.prompt), 0), sched.stop))
    rng = np.random.default_rng(seed)
    per_step = []
    while sched.has_unfinished():
        out = sched.schedule()
        n = len(out.sample_seqs)
        sched.update(out, RunnerOutput(rng.integers(memory.VOCAB, size=n).tolist(), [None] * n))
        st = collector.collect()
        per_step.append(
            (
                st.kv_blocks_used * config.block_size,
                st.kv_utilization,
                st.running_seqs,
                len(sched.running),
                st.waiting_seqs > 0,
            )
        )
    return collector.stats, per_step


@pytest.mark.parametrize(
    "workload, scenario, capacity",  # capacity in token slots: memory-bound, with preemptions
    [
        ("fixed", "unique", 1500),
        ("fixed", "prefix", 1500),
        ("fixed", "fork", 1500),
        ("sharegpt", "fork", 600),
    ],
)
def test_paged_figures_are_the_schedulers(workload, scenario, capacity):
    make = memory.fixed_workload if workload == "fixed" else memory.sharegpt_workload
    wl = make(24, 8, seed=3)
    requests = wl.scenarios[scenario]
    config = memory.engine_config(capacity, 16, True, max_num_seqs=64, budget=None)
    res = memory.run_paged(
        config, requests, capacity, 3, wl.max_model_len, workload="w", scenario=scenario, system="s"
    )

    stats, steps = _drive_scheduler_by_hand(config, requests, wl.max_model_len, seed=3)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    bound = [s for s in steps if s[4]]
    assert bound and stats.num_preemptions, "the workload must be memory-bound for this test to mean much"
    assert res.steps == stats.num_steps == len(steps)
    assert res.preemptions == stats.num_preemptions
    assert res.cow_copies == stats.num_cow_copies
    assert res.prefix_hit_rate == pytest.approx(stats.prompt_tokens_cached / prompt_tokens)
    assert res.max_concurrent_seqs == stats.peak_running_seqs
    assert res.max_concurrent_requests == max(s[3] for s in steps)
    assert res.memory_bound_steps == len(bound)
    assert res.mean_concurrent_seqs == pytest.approx(sum(s[2] for s in bound) / len(bound))
    reserved = sum(s[0] for s in bound)
    live = sum(s[0] * s[1] for s in bound)
    assert res.kv_utilization == pytest.approx(live / reserved)
