"""The calibration's estimators without a model: output lengths from censored samples, the stratified order, the
step-time fit. A calibration is mimicked by a stream of rows fed at a concurrency, one token per running row a
step, stopped after a few steps (the rows still running censored)."""

from __future__ import annotations

import math
import random

import pytest

from batchgen.job.calibrate import (
    CalibrationRow,
    OutputLengths,
    fit_step_model,
    strata_order,
    tail_estimate,
)
from batchgen.job.schedule_sim import SimRequest, simulate_schedule


def _stream(lengths: list[int], bound: int, batch: int, steps: int) -> list[tuple[int, bool]]:
    """(tokens, ended) per row of a calibration feeding ``lengths`` in order at ``batch`` rows at once for
    ``steps`` steps; a row reaching ``bound`` is censored, as are the rows running at the end."""
    obs: list[tuple[int, bool]] = []
    running: list[list[int]] = []
    i = 0
    for _ in range(steps):
        while len(running) < batch and i < len(lengths):
            running.append([min(lengths[i], bound), 0, lengths[i] <= bound])
            i += 1
        for r in running:
            r[1] += 1
        obs += [(r[1], bool(r[2])) for r in running if r[1] >= r[0]]
        running = [r for r in running if r[1] < r[0]]
    return obs + [(r[1], False) for r in running]


def _geometric(rng: random.Random, h: float) -> int:
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - h))


def _poisson_mean(f, lam: float) -> float:  # noqa: ANN001
    return sum(f(d) * math.exp(-lam) * lam**d / math.factorial(d) for d in range(80))


def test_the_tail_estimate_is_unbiased_where_the_plug_in_rate_errs_long() -> None:
    # ends seen over X watched token positions: d ~ Poisson(h X); the target E[min(G, m)] for G geometric
    for h, x, m in ((0.0125, 384, 90), (0.06, 192, 60), (0.02, 100, 100)):
        truth = (1 - (1 - h) ** m) / h
        got = _poisson_mean(lambda d: tail_estimate(d, x, m), h * x)  # noqa: B023
        assert got == pytest.approx(truth, rel=0.02)

        def plug_in(d: int) -> float:
            return m if d == 0 else (1 - (1 - d / x) ** m) / (d / x)  # noqa: B023

        assert _poisson_mean(plug_in, h * x) > 1.02 * truth  # the mean length is convex in the rate
    # no end seen: the bound, however few positions were watched; fewer than the tail spans, ends seen: the rate
    assert tail_estimate(0, 14, 35) == 35 and tail_estimate(0, 500, 35) == 35
    assert tail_estimate(3, 14, 35) == pytest.approx((1 - (1 - 3 / 14) ** 35) / (3 / 14))
    assert tail_estimate(0, 500, 35) == 35


@pytest.mark.parametrize(
    ("hazard", "bound", "batch", "steps"), [(0.0125, 96, 48, 8), (0.06, 64, 24, 8), (0.03, 32, 16, 12)]
)
def test_output_lengths_from_a_short_calibration_do_not_err_long(
    hazard: float, bound: int, batch: int, steps: int
) -> None:
    rng = random.Random(3)
    errors = []
    for _ in range(150):
        job = [_geometric(rng, hazard) for _ in range(400)]
        truth = sum(min(n, bound) for n in job) / len(job)
        est = OutputLengths.fit(_stream(job, bound, batch, steps))
        errors.append(est.expected(bound) / truth - 1)
        q = est.quantiles([bound] * 200)
        assert max(q) <= bound and sum(q) / len(q) == pytest.approx(est.expected(bound), rel=0.1)
    assert abs(sum(errors) / len(errors)) < 0.06  # the bias; one calibration's own error is its spread


def _with_chances(obs: list[tuple[int, bool]], hazard: float) -> list[tuple[int, bool, list[float]]]:
    """The same samples with their chance of ending at each position (a geometric length: ``hazard`` at each)."""
    return [(n, ended, [hazard] * n) for n, ended in obs]


def test_chances_of_ending_estimate_the_lengths_closer_than_the_ends_seen() -> None:
    """The same short calibrations, the samples' chance of ending at each token given (as the sampler reports
    it): the lengths' error is a fraction of what counting the ends seen gives, without bias, and the two
    kinds of sample mix."""
    rng = random.Random(11)
    seen, chances, mixed = [], [], []
    for _ in range(150):
        job = [_geometric(rng, 0.02) for _ in range(400)]
        truth = sum(min(n, 96) for n in job) / len(job)
        obs = _stream(job, 96, 48, 10)
        seen.append(OutputLengths.fit(obs).expected(96) / truth - 1)
        est = OutputLengths.fit(_with_chances(obs, 0.02))
        assert est.events == sum(e for _, e in obs) and est.ends == pytest.approx(0.02 * est.exposure)
        chances.append(est.expected(96) / truth - 1)
        half = [o if i % 2 else (o[0], o[1], None) for i, o in enumerate(_with_chances(obs, 0.02))]
        mixed.append(OutputLengths.fit(half).expected(96) / truth - 1)

    def rms(e: list[float]) -> float:
        return math.sqrt(sum(x * x for x in e) / len(e))

    assert rms(chances) < 0.5 * rms(seen)
    assert rms(mixed) < rms(seen)
    assert abs(sum(chances) / len(chances)) < 0.03


def test_the_spread_covers_the_error_of_a_short_calibration() -> None:
    rng = random.Random(5)
    inside = 0
    for _ in range(100):
        job = [_geometric(rng, 0.03) for _ in range(300)]
        truth = sum(min(n, 64) for n in job) / len(job)
        est = OutputLengths.fit(_stream(job, 64, 16, 10))
        e = est.spread(64)
        inside += abs(est.expected(64) / truth - 1) <= 2 * e
    assert inside >= 85


def test_the_longest_lengths_reach_the_truth_where_few_ends_were_seen() -> None:
    """A calibration of a few steps sees few ends: most rows here run to the bound and a fifth end at once, and
    the estimate from 8 steps of 4 rows misses the job's mean by over a quarter in most calibrations. The
    lengths at their most (every sample still running goes on to its bound), with the range's floor of 20%,
    reach it in nearly all; the estimate lies between the least and the most."""
    rng = random.Random(7)
    reached = missed = 0
    for _ in range(200):
        job = [rng.choice([2, 3, 5]) if rng.random() < 0.2 else 200 for _ in range(300)]
        truth = sum(min(n, 32) for n in job) / len(job)
        est = OutputLengths.fit(_stream(job, 32, 4, 8))
        lo, hi = est.at_least().expected(32), est.at_most().expected(32)
        assert lo <= est.expected(32) <= hi
        reached += truth <= hi * 1.2
        missed += abs(est.expected(32) / truth - 1) > 0.25
        q = est.at_most().quantiles([32] * 100)
        assert sum(q) / len(q) == pytest.approx(hi, rel=0.1) and max(q) == 32
    assert reached >= 180 and missed >= 100


def test_strata_order_is_a_proportional_sample_at_every_prefix() -> None:
    sizes = {(0, 0): 60, (1, 0): 25, (2, 1): 10, (3, 3): 5}
    rows = [
        CalibrationRow(i, [1], None, s) for i, s in enumerate(s for s, n in sizes.items() for _ in range(n))
    ]
    order = strata_order(rows, seed=1)
    assert sorted(r.index for r in order) == list(range(100))
    for k in range(1, 101):
        for s, n in sizes.items():
            assert abs(sum(r.stratum == s for r in order[:k]) - n * k / 100) <= 1


def test_a_stalled_step_does_not_skew_the_step_model() -> None:
    steps = [(p, d, 0.0, 0.004 + 1e-5 * p + 5e-4 * d) for p in (0, 0, 200, 0, 500) for d in (4, 8, 16)]
    steps[4] = (*steps[4][:3], steps[4][3] + 0.2)  # the OS ran something else in that step
    m = fit_step_model(steps)
    assert m.coef[0] == pytest.approx(0.004, rel=0.05) and m.coef[2] == pytest.approx(5e-4, rel=0.05)
    assert m.coef[1] == pytest.approx(1e-5, rel=0.05)


def test_preempted_requests_compute_their_prompt_again() -> None:
    from batchgen.job.calibrate import StepModel

    unit = StepModel((1.0, 0.0, 0.0, 0.0))
    reqs = [SimRequest(40, 40, 60) for _ in range(8)]
    free = simulate_schedule(reqs, unit, 8, 4096, None, 16)
    assert free.prompt_tokens == 8 * 40 and free.preemptions == 0
    tight = simulate_schedule(reqs, unit, 8, 4096, 16 * 14, 16)
    assert tight.preemptions > 0 and tight.prompt_tokens > 8 * 40


def test_step_cache_keeps_steps_per_setup_and_load_regime(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from batchgen.job.calibrate import Calibration, StepCache, StepModel

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    steps = [(float(p), 4.0, 100.0, 0.01) for p in range(5)]
    a = StepCache.for_setup("model-a", "float32", "EngineConfig(max_num_seqs=8)", "cpu")
    a.store(Calibration(StepModel((0.01, 0.0, 0.0, 0.0)), load=0.5), steps)
    assert a.load(1.0) == steps  # idle then, idle now
    assert a.load(40.0) == []  # the cores oversubscribed now: another speed
    assert StepCache.for_setup("model-a", "float32", "EngineConfig(max_num_seqs=16)", "cpu").load(1.0) == []
