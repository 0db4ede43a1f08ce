"""The schedule simulation that prices a plan, held to the engine's real scheduler: a fake engine runs the
real :class:`Scheduler` and KV cache manager with fake tokens and a known step-time model, so its "wall time"
is exact and independent of the machine's load; the simulation over the same token counts must reproduce it."""

from __future__ import annotations

import random

import pytest

from batchgen.bench.fake_runner import FakeRequest, add_requests, make_scheduler
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.stats import EngineCounters
from batchgen.engine.worker.step_input import RunnerOutput
from batchgen.job.calibrate import StepModel
from batchgen.job.prefix_sim import simulate_prefix_cache
from batchgen.job.schedule_sim import SimRequest, simulate_schedule

MODEL = StepModel((0.004, 2e-5, 3e-4, 1e-5))
"""Seconds per step: 4 ms, 20 us per prefill token, 0.3 ms per sampled sequence, 10 us per 1k context tokens."""


def _fake_engine_seconds(
    reqs: list[FakeRequest], cfg: EngineConfig, model: StepModel
) -> tuple[float, int, int]:
    """The real scheduler over ``reqs``, each step priced by ``model``: (seconds, steps, preemptions)."""
    mml = max(len(r.prompt) + r.max_tokens for r in reqs)
    sched = make_scheduler(cfg, mml)
    add_requests(sched, reqs, mml, EngineCounters())
    rng = random.Random(0)
    t, steps = 0.0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out, "no progress"
        decodes = out.seqs[: out.num_decodes]
        p = sum(s.num_tokens for s in out.seqs[out.num_decodes :])
        k = sum(s.start + s.num_tokens for s in decodes)
        t += model.step_time(p, len(out.sample_seqs), k)
        steps += 1
        n = len(out.sample_seqs)
        sched.update(out, RunnerOutput([rng.randrange(1000) for _ in range(n)], [None] * n))
    return t, steps, sched.stats.num_preemptions


def _sim_requests(
    reqs: list[FakeRequest], block_size: int, outputs: list[int] | None = None
) -> list[SimRequest]:
    cache = simulate_prefix_cache([r.prompt for r in reqs], block_size)
    outs = outputs or [r.max_tokens for r in reqs]
    return [
        SimRequest(len(r.prompt) - c - k, len(r.prompt), o, r.n)
        for r, c, k, o in zip(reqs, cache.cached, cache.copied, outs)
    ]


def _workload(seed: int, rows: int, shared: bool) -> list[FakeRequest]:
    rng = random.Random(seed)
    head = [rng.randrange(1000) for _ in range(40)]
    out = []
    for _ in range(rows):
        body = [rng.randrange(1000) for _ in range(rng.choice([3, 20, 70, 300]))]
        out.append(FakeRequest((head if shared else []) + body, rng.randint(1, 40), rng.choice([1, 1, 1, 3])))
    return out


@pytest.mark.parametrize(
    ("seed", "shared", "engine"),
    [
        (0, False, {"max_num_seqs": 8, "max_num_batched_tokens": 4096}),
        (1, True, {"max_num_seqs": 16, "max_num_batched_tokens": 256}),  # chunked prefills
        (2, True, {"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 32}),
        # KV-bound pools: blocks taken as contexts grow, preemption and recompute when they run out
        (3, False, {"max_num_seqs": 32, "num_blocks": 120}),
        (4, True, {"max_num_seqs": 32, "num_blocks": 100, "max_num_batched_tokens": 256}),
    ],
)
def test_simulation_reproduces_the_scheduler_under_a_known_time_model(
    seed: int, shared: bool, engine: dict
) -> None:
    reqs = _workload(seed, 120, shared)
    cfg = EngineConfig(device="cpu", **{"num_blocks": 4096, **engine})
    actual, steps, preempted = _fake_engine_seconds(reqs, cfg, MODEL)
    pool = cfg.num_blocks * cfg.block_size
    sim = simulate_schedule(
        _sim_requests(reqs, cfg.block_size), MODEL, cfg.max_num_seqs, cfg.max_num_batched_tokens, pool,
        cfg.block_size,
    )  # fmt: skip
    assert sim.seconds == pytest.approx(actual, rel=0.03)
    assert sim.steps == pytest.approx(steps, rel=0.03)
    assert (sim.preemptions > 0) == (preempted > 0)
    assert sim.peak_blocks <= cfg.num_blocks


def test_rows_ending_early_give_their_blocks_back() -> None:
    """Rows that stop (EOS, a stop string) long before ``max_tokens`` free their blocks when they end: given
    the lengths the rows reach, the simulation follows the engine whose rows end there, well below the time
    of rows running to their bound in the same pool (where blocks run out and sequences are preempted)."""
    rng = random.Random(8)
    bound = 200
    reqs = [FakeRequest([rng.randrange(1000) for _ in range(rng.randint(20, 120))], bound) for _ in range(80)]
    natural = [rng.randint(4, 30) for _ in reqs]
    cfg = EngineConfig(device="cpu", max_num_seqs=32, num_blocks=300)
    ended = [FakeRequest(r.prompt, n) for r, n in zip(reqs, natural)]  # the engine's rows ending early
    actual, _steps, preempted = _fake_engine_seconds(ended, cfg, MODEL)
    assert preempted == 0
    pool = cfg.num_blocks * cfg.block_size
    args = (MODEL, cfg.max_num_seqs, cfg.max_num_batched_tokens, pool, cfg.block_size)
    early = simulate_schedule(_sim_requests(reqs, cfg.block_size, natural), *args)
    assert early.seconds == pytest.approx(actual, rel=0.03) and early.preemptions == 0
    full = simulate_schedule(_sim_requests(reqs, cfg.block_size), *args)
    assert full.preemptions > 0 and full.seconds > 3 * early.seconds


def test_decoders_take_blocks_as_they_cross_block_boundaries() -> None:
    """One block per sample each time its context crosses a block boundary, the prompt's full blocks shared
    by a request's samples: the blocks the simulation holds at its peak, by hand."""
    unit = StepModel((1.0, 0.0, 0.0, 0.0))
    # prompt 20 tokens (2 blocks of 16), 30 tokens out: context 49 at the last decode step -> 4 blocks
    one = simulate_schedule([SimRequest(20, 20, 30)], unit, 4, 4096, 16 * 100, 16)
    assert one.peak_blocks == 4 and one.steps == 30
    # 3 samples: the prompt's full block shared, each sample 49 - 16 tokens of its own -> 1 + 3 * 3 blocks
    three = simulate_schedule([SimRequest(20, 20, 30, 3)], unit, 4, 4096, 16 * 100, 16)
    assert three.peak_blocks == 10
    # a pool of 6 blocks holds two such requests' prompts (2 + 2, the watermark 1 left) but not their growth
    two = simulate_schedule([SimRequest(20, 20, 30)] * 2, unit, 4, 4096, 16 * 6, 16)
    assert two.preemptions >= 1 and two.peak_blocks <= 6 and two.steps > 30


def test_output_lengths_from_censored_samples() -> None:
    from batchgen.job.calibrate import OutputLengths

    rng = random.Random(0)
    # natural lengths geometric with mean 20; the calibration stops after 12 tokens (most samples censored)
    natural = [1 + int(rng.expovariate(1 / 19.5)) for _ in range(400)]
    obs = [(n, True) if n <= 12 else (12, False) for n in natural]
    km = OutputLengths.fit(obs)
    for bound in (8, 30, 64):
        truth = sum(min(n, bound) for n in natural) / len(natural)
        assert km.expected(bound) == pytest.approx(truth, rel=0.1)
        qs = km.quantiles([bound] * 400)
        assert sum(qs) / len(qs) == pytest.approx(truth, rel=0.1) and max(qs) <= bound
    # no sample ended over more token positions than the rows' tails span: every row runs to its bound
    assert OutputLengths.fit([(30, False)] * 4).expected(40) == pytest.approx(40)
    # and over fewer (14 positions, a tail of 35 past the horizon at t=5): still the bound, the range wide
    few = OutputLengths.fit([(5, False), (9, False)])
    assert few.horizon == 5 and few.expected(40) == pytest.approx(40) and few.spread(40) > 0.5
    # the least the samples allow (the range's low end): the running ones end just past the horizon
    assert few.at_least().expected(40) == pytest.approx(6)
    assert 8 < km.at_least().expected(64) <= 13 < km.expected(64)
    # dropping the censored samples would bias short; the estimate keeps them
    assert km.expected(64) > 1.3 * OutputLengths.fit([o for o in obs if o[1]]).expected(64)
    assert 0 < km.spread(64) < 0.5


def test_load_widens_the_range() -> None:
    from batchgen.job.calibrate import load_spread

    assert load_spread(1.5, cpus=2) == 0.0 and load_spread(None) == 0.0
    assert 0.2 < load_spread(10.0, cpus=2) <= 0.5
