"""The block-manager benchmark (``python -m batchgen.bench.block_manager``): the allocator designs it compares
behave as free lists, it runs end to end at a tiny size, and its simulated-workload figures are the engine
scheduler's own (driven here by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from batchgen.bench import block_manager
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.stats import EngineCounters, EngineStats, StatsCollector
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.kinds import make_group
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.sched.sequence import Request
from batchgen.engine.sched.stop import StopRules
from batchgen.engine.worker.step_input import RunnerOutput
from batchgen.sampling_params import SamplingParams


@pytest.mark.parametrize("name", list(block_manager.ALLOCATORS))
def test_allocators_hand_out_distinct_blocks_and_take_them_back(name):
    a = block_manager.ALLOCATORS[name](64)
    first = a.allocate(16) + a.allocate(1)
    assert len(set(first)) == 17 and all(0 <= b < 64 for b in first)
    a.free(first)
    assert len(set(a.allocate(64))) == 64


def test_block_manager_bench_runs(capsys):
    figures = block_manager.main(["--repeats", "1", "--ops", "64", "--requests", "24"])
    out = capsys.readouterr().out
    assert (
        "## Allocate + free throughput" in out and "sha256 (used)" in out and "## Simulated workload" in out
    )
    assert figures["requests"] == 24 and figures["steps"] > 0
    assert 0.0 < figures["mean KV utilization"] <= 1.0


def test_simulated_workload_figures_are_the_schedulers():
    kwargs = dict(num_requests=40, num_blocks=160, block_size=16, max_num_seqs=32, max_num_batched_tokens=512)
    figures = block_manager.simulate(**kwargs, seed=1)

    # the same workload through the engine's scheduler, driven by hand as the engine drives it
    config = EngineConfig(block_size=16, num_blocks=160, max_num_seqs=32, max_num_batched_tokens=512)
    kv = KVCacheManager(160, 16)
    reqs = block_manager.workload(40, seed=1)
    mml = max(len(r.prompt) + r.max_tokens for r in reqs)
    sched = Scheduler(config, kv, StopRules.build([], mml))
    collector = StatsCollector(EngineStats(), sched.stats, kv, EngineCounters())
    for i, r in enumerate(reqs):
        req = Request(
            i, r.prompt, SamplingParams(n=r.n, temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        )
        sched.add(make_group(req, req.new_sequence(list(r.prompt), 0), sched.stop))
    rng = np.random.default_rng(1)
    utilization, running = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        n = len(out.sample_seqs)
        sched.update(out, RunnerOutput(rng.integers(32000, size=n).tolist(), [None] * n))
        st = collector.collect()
        utilization.append(st.kv_utilization)
        running.append(st.running_seqs)
    assert st.num_preemptions > 0, "the pool should be small enough to preempt"
    assert figures["steps"] == st.num_steps
    assert figures["preemptions"] == st.num_preemptions
    assert figures["copy-on-write copies"] == st.num_cow_copies
    assert figures["prefix hit rate (prompt tokens)"] == pytest.approx(
        st.prompt_tokens_cached / sum(len(r.prompt) for r in reqs)
    )
    assert figures["peak running sequences"] == st.peak_running_seqs
    assert figures["peak blocks used"] == kv.stats().peak_blocks_used
    assert figures["cached-block evictions"] == kv.stats().num_evictions
    assert figures["mean KV utilization"] == pytest.approx(float(np.mean(utilization)))
    assert figures["mean running sequences"] == pytest.approx(float(np.mean(running)))
