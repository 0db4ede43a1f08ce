"""The engine's real :class:`~batchgen.engine.sched.scheduler.Scheduler` and KV cache manager, driven with fake tokens.

No model runs: each step is ``schedule()`` then ``update()`` with one random token per sampled sequence, exactly
what :class:`~batchgen.engine.core.llm_engine.LLMEngine` does around its forward pass. So the figures the block-manager
and memory benchmarks report for batchgen (KV utilization, fragmentation, prefix hits, preemptions,
copy-on-write copies, concurrent sequences) are the scheduler's own (:class:`EngineStats` and the manager's
:class:`KVCacheStats`), with its admission watermark, preemption order, chunked prefill and forks.

Requests are greedy with ``ignore_eos``: every sample generates exactly its ``max_tokens`` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.stats import EngineCounters, EngineStats, StatsCollector
from batchgen.engine.kv.kv_cache import KVCacheManager, KVCacheStats
from batchgen.engine.sched.kinds import make_group
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.sched.sequence import Request
from batchgen.engine.sched.stop import StopRules
from batchgen.engine.worker.step_input import RunnerOutput
from batchgen.sampling_params import SamplingParams


@dataclass
class FakeRequest:
    prompt: list[int]
    max_tokens: int
    n: int = 1


@dataclass
class StepFigures:
    """The state after one step's ``update()``, as the scheduler and its KV cache manager report it."""

    running_seqs: int
    running_requests: int
    waiting_seqs: int
    blocks_used: int
    live_token_slots: int
    logical_tokens: int
    kv_utilization: float
    num_scheduled_seqs: int
    num_batched_tokens: int


@dataclass
class FakeRun:
    stats: EngineStats
    """The scheduler's own running totals at the end."""
    kv: KVCacheStats
    """The KV cache manager's figures at the end (every sequence freed)."""
    steps: list[StepFigures] = field(default_factory=list)
    seq_steps: int = 0
    """Sum over steps of the sequences scheduled."""
    scheduler_s: float = 0.0
    """Time spent in ``schedule()`` + ``update()``."""


def make_scheduler(config: EngineConfig, max_model_len: int) -> Scheduler:
    """A scheduler over a fresh pool of ``config.num_blocks`` blocks (which must be set), no eos token."""
    if config.num_blocks is None:
        raise ValueError("set EngineConfig.num_blocks: the fake runner has no memory to size the pool from")
    kv = KVCacheManager(
        config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
    )
    return Scheduler(config, kv, StopRules.build([], max_model_len))


def make_collector(sched: Scheduler, counters: EngineCounters, max_model_len: int) -> StatsCollector:
    """The engine's stats collector over this scheduler's counters and KV manager."""
    stats = EngineStats(
        num_blocks=sched.kv.num_blocks, block_size=sched.kv.block_size, max_model_len=max_model_len
    )
    return StatsCollector(stats, sched.stats, sched.kv, counters)


def add_requests(
    sched: Scheduler, requests: Sequence[FakeRequest], max_model_len: int, counters: EngineCounters
) -> None:
    """Queue the requests as the engine's ``add_request`` does (ids 0, 1, ...; prompt tokens counted)."""
    for i, r in enumerate(requests):
        params = SamplingParams(n=r.n, temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        request = Request(i, list(r.prompt), params)
        group = make_group(request, request.new_sequence(list(r.prompt), 0), sched.stop)
        why = group.unservable(sched.kv, sched.config.max_num_seqs, sched.stop)
        if why is not None:
            raise ValueError(f"request {i} can never run: {why}")
        sched.add(group)
        counters.num_requests += 1
        counters.prompt_tokens += len(r.prompt)


def run(
    requests: Sequence[FakeRequest],
    config: EngineConfig,
    *,
    max_model_len: int | None = None,
    seed: int = 0,
    vocab_size: int = 32000,
    record: bool = True,
    on_step: Callable[[Scheduler], None] | None = None,
) -> FakeRun:
    """Run every request to completion through a fresh scheduler; ``record`` keeps per-step figures."""
    mml = max_model_len or max(len(r.prompt) + r.max_tokens for r in requests)
    sched = make_scheduler(config, mml)
    counters = EngineCounters()
    collector = make_collector(sched, counters, mml)
    add_requests(sched, requests, mml, counters)
    rng = np.random.default_rng(seed)
    result = FakeRun(collector.stats, sched.kv.stats())
    steps = result.steps
    clock = time.perf_counter
    while sched.has_unfinished():
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        if not out:
            raise RuntimeError("the scheduler made no progress with requests pending (pool too small?)")
        n = len(out.sample_seqs)
        tokens = rng.integers(vocab_size, size=n).tolist()
        t2 = clock()
        sched.update(out, RunnerOutput(tokens, [None] * n))
        collector.collect()
        result.scheduler_s += t1 - t0 + clock() - t2
        result.seq_steps += len(out.seqs)
        if record:
            kvs = sched.kv.stats()
            steps.append(
                StepFigures(
                    running_seqs=sum(len(g.seqs) for g in sched.running),
                    running_requests=len(sched.running),
                    waiting_seqs=sum(len(g.seqs) for g in sched.waiting),
                    blocks_used=kvs.blocks_used,
                    live_token_slots=kvs.live_token_slots,
                    logical_tokens=kvs.logical_tokens,
                    kv_utilization=collector.stats.kv_utilization,
                    num_scheduled_seqs=len(out.seqs),
                    num_batched_tokens=out.num_batched_tokens,
                )
            )
        if on_step is not None:
            on_step(sched)
    result.kv = sched.kv.stats()
    if result.kv.blocks_used or result.kv.num_seqs:
        raise AssertionError(f"blocks leaked after every request finished: {result.kv}")
    return result
