"""Predicting a job's wall time: a calibration run of the real engine, a step-time model fitted to it, the
output lengths it saw, and a simulation of the engine's schedule over every row of the job.

**Step-time model.** One engine step costs ``c0 + a * P + b * D + k * K`` seconds: ``P`` prompt tokens
computed in the step (after prefix sharing), ``D`` sequences that produced a token, ``K`` thousands of tokens
in the running sequences' contexts (the attention's reads: a prefix block shared by several sequences counts
once per sequence, as the simulation counts it). The coefficients are fitted by least squares over the
calibration's timed steps, a term whose coefficient comes out negative (or that the steps do not vary apart
from the others) being dropped; steps far above the fit (stalls) are left out and the rest refitted.

**Calibration.** After a warm-up batch (a fresh engine's one-time costs: lazy initialisation, first calls at a
batch's shapes, first writes into the KV pool; its steps' excess over the step model is added to each engine's
predicted time once, :attr:`Calibration.first_calls_s`, and left out of the fit) and a timed one-sequence
request (the small-batch end: one prefill, one decode; left out when an earlier dry run on the same setup kept
its steps, :class:`StepCache`), a proportional stratified sample of the job's rows — by prompt length
(quartiles) and prefix group (the first block of tokens) — runs through the engine **at the job's
concurrency** (up to ``max_num_seqs`` sequences, admitted a few more each step so that no step's prefill
takes over a third of the budget),
with the job's own sampling parameters (so seeded rows generate what the job will): its steps are timed at the
batch sizes the job runs. The calibration stops when its budget — ``fraction`` of the wall time predicted
from what it has measured so far (output lengths at their estimate), the warm-ups included; re-evaluated once
the floor of batch steps is timed, each time half of what is left of it is spent or the time spent has grown
by half, and before stopping — is spent (after at least :data:`MIN_BATCH_STEPS` steps of a batch, the floor
below which the step model has nothing to fit); rows still running are aborted and kept as censored
observations of their output length. A small sample (few batch steps, the job's concurrency not reached)
widens the range (:func:`relative_spread`); where the batch stayed far below the job's concurrency, a probe
times decode steps at it over contexts of the rows' mean length (:func:`_probe_concurrency`), so the cost per
running sequence is measured, not extrapolated.

**Output lengths.** EOS and stop strings end outputs before ``max_tokens``: the natural length distribution
is estimated by Kaplan-Meier over the calibration's samples and a geometric tail whose mean is estimated
without bias from the ends seen (:class:`OutputLengths`, :func:`tail_estimate`), each row of the job gets
``min(L, its bound)`` at evenly spread quantiles, so the simulation sees the spread (the long tail that keeps
a batch running) and the total is the expectation.

**Schedule simulation.** The rows, in the job's feed order, with these output lengths, go through a model of
the scheduler and its KV blocks (:mod:`.schedule_sim`), each step priced by the step model.

**Range.** Relative half-width from the step model's residual, the output lengths' standard error, and the
machine's load at calibration (a job sharing oversubscribed CPUs runs at a speed the calibration sampled and
the run will not keep, :func:`load_spread`), over a floor.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from batchgen.engine.features.end_probability import EndProbability

MIN_BATCH_STEPS = 8
"""Steps a calibration batch always runs (unless it finishes first), whatever the budget: its prefill and a few
decode steps, the least the step model can be fitted to."""
WARM_UP_TOKENS = 32
"""Prompt tokens of each warm-up request (:func:`_warm_up`)."""
WARM_UP_SEQS = 4
"""Requests of the warm-up batch."""
STOP_MARGIN = 0.95
"""The calibration stops when a step like the last would end past this share of its budget."""
FULL_SAMPLE_STEPS = 48
"""Batch steps from which the sample's size no longer widens the range (:func:`relative_spread`)."""
PROBE_TOKENS = 4
"""Tokens each sequence of the concurrency probe generates: its prefill step, then three decode steps."""
PROBE_MIN_S = 0.05
"""Seconds the concurrency probe may always take, whatever the budget (a job too short for its budget to buy
the probe still gets its decode cost per sequence)."""
MIN_PROBE_SEQS = 8
"""Fewest sequences worth a concurrency probe."""
FEATURES = ("per_step", "per_prefill_token", "per_decode_seq", "per_1k_context_tokens")


@dataclass
class StepModel:
    """Seconds per engine step: ``coef . (1, P, D, K/1000)`` (module docstring)."""

    coef: tuple[float, float, float, float]
    residual_rel: float = 0.0
    """Root-mean-square residual over the mean step time of the fit."""

    def step_time(self, p: float, d: float, k: float) -> float:
        c = self.coef
        return c[0] + c[1] * p + c[2] * d + c[3] * k / 1000.0

    def to_dict(self) -> dict[str, float]:
        return {**dict(zip(FEATURES, self.coef)), "residual_rel": self.residual_rel}


def fit_step_model(samples: Sequence[tuple[float, float, float, float]]) -> StepModel:
    """Least squares over ``(P, D, K, seconds)`` steps, non-negative by dropping negative terms; steps far
    slower than the fit (a stall: the OS running something else, a lazy allocation) are left out and the rest
    fitted again. Their time is not lost: the calibration's overhead factor (wall time over the model's sum)
    keeps it."""
    model = _fit_least_squares(samples)
    if len(samples) < 6:
        return model
    pred = np.array([model.step_time(*s[:3]) for s in samples])
    res = np.array([s[3] for s in samples]) - pred
    scale = 1.4826 * float(np.median(np.abs(res - np.median(res))))
    keep = [s for s, r, q in zip(samples, res, pred) if r <= max(4.0 * scale, 0.25 * q)]
    if len(keep) == len(samples) or len(keep) < 0.75 * len(samples):
        return model
    return _fit_least_squares(keep)


def _fit_least_squares(samples: Sequence[tuple[float, float, float, float]]) -> StepModel:
    if not samples:
        return StepModel((0.0, 0.0, 0.0, 0.0), 1.0)
    x = np.array([[1.0, s[0], s[1], s[2] / 1000.0] for s in samples])
    y = np.array([s[3] for s in samples])
    keep = [0, 1, 2, 3]
    # a term needs steps that vary it apart from the others: the context term (K) only with a few times
    # more steps than terms and not a near-copy of the decode term (D)
    if len(samples) < 12 or _collinear(x[:, 2], x[:, 3]):
        keep.remove(3)
    coef = np.zeros(4)
    while keep:
        cols = [c for c in keep if np.any(x[:, c] != x[0, c]) or c == 0]
        sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        coef = np.zeros(4)
        coef[cols] = sol
        neg = [c for c in cols if coef[c] < 0]
        if not neg:
            break
        keep = [c for c in cols if c != min(neg, key=lambda c: coef[c])]
    if not keep:
        coef = np.array([float(y.mean()), 0.0, 0.0, 0.0])
    res = y - x @ coef
    rel = float(np.sqrt(np.mean(res**2)) / max(float(y.mean()), 1e-12))
    return StepModel(tuple(float(c) for c in coef), rel)  # type: ignore[arg-type]


def _collinear(a: np.ndarray, b: np.ndarray, limit: float = 0.98) -> bool:
    if a.std() == 0 or b.std() == 0:
        return True
    return abs(float(np.corrcoef(a, b)[0, 1])) > limit


@dataclass
class CalibrationRow:
    """A row the calibration may run: its tokens, parameters and stratum."""

    index: int
    token_ids: list[int]
    params: Any
    stratum: tuple[int, int]
    lora: Any = None
    compute: int | None = None
    """Prompt tokens the job computes for the row (after prefix sharing); None: all of them."""


MIN_AT_RISK = 5
"""The Kaplan-Meier part of :class:`OutputLengths` reaches as far as this many samples (fewer: all of them) are
still at risk; beyond, the survival continues geometrically (a handful of samples would make its steps noise)."""


def _geometric_mean_len(h: float, m: int) -> float:
    """``E[min(G, m)]`` for ``G`` geometric on 1, 2, ... with hazard ``h``: ``sum_{k<m} (1-h)^k``."""
    if m <= 0:
        return 0.0
    if h <= 0.0:
        return float(m)
    if h >= 1.0:
        return 1.0
    return (1.0 - (1.0 - h) ** m) / h


def tail_estimate(events: int, exposure: float, m: int) -> float:
    """An estimate of ``E[min(G, m)]`` (``G`` geometric, hazard ``h``) from ``events`` ends seen over
    ``exposure`` token positions at risk: ``X (1 - (1 - m/X)^(d+1)) / (d+1)``, unbiased for ``d`` Poisson of mean
    ``h X`` when ``m <= X``. (Putting the rate ``d / X`` into ``(1 - (1-h)^m) / h`` instead errs long: the mean
    length is convex in the rate.) With no end seen it is ``m``, the bound, whatever ``X``. With ``m > X`` and
    ends seen no estimator is unbiased (the formula swings with ``d``): the rate put into the geometric mean,
    and the range (:meth:`OutputLengths.spread`) reaches to the bound."""
    if m <= 0:
        return 0.0
    if exposure <= 0 or events <= 0:
        return float(m)
    if m > exposure:
        return _geometric_mean_len(events / exposure, m)
    r = m / exposure
    return min(float(m), exposure * (1.0 - (1.0 - r) ** (events + 1)) / (events + 1))


def _hazard_for(mean: float, m: int) -> float:
    """The geometric hazard whose ``E[min(G, m)]`` is ``mean`` (``1 <= mean <= m``), by bisection."""
    if mean >= m:
        return 0.0
    if mean <= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _geometric_mean_len(mid, m) > mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


Observation = tuple[int, bool] | tuple[int, bool, "Sequence[float] | None"]
"""One sample: (tokens generated, ended by EOS or a stop[, its chance of ending at each of those positions])."""


@dataclass
class OutputLengths:
    """The natural output length ``L`` of a sample (tokens until EOS or a stop, were there no bound), estimated
    from the calibration's samples: a finished sample is an event at its length, a sample that reached its
    bound or was still running when the calibration stopped is censored (``L`` > its tokens). A sample with
    its chance of ending at each position (:mod:`batchgen.engine.features.end_probability`) counts those
    chances as its ends instead (at each position at risk: the same expectation, without the draw's noise).

    ``survival[t] = P(L > t)`` by Kaplan-Meier up to the horizon ``H`` (as far as :data:`MIN_AT_RISK` samples
    are at risk); beyond it ``L - H`` is geometric, its mean up to a bound estimated without bias from the
    ends seen over the token positions watched (:func:`tail_estimate`), not by putting the observed rate into
    the geometric mean (which errs long: with few ends seen, far long). The samples are a proportional
    stratified sample of the rows (:func:`strata_order`), so each counts the same."""

    survival: np.ndarray
    events: int
    """Ends seen."""
    exposure: float
    """Token positions watched: the sum over samples of their tokens (each was at risk of ending at each)."""
    observations: int
    lower: bool = False
    """The shortest lengths the samples allow: every sample running at the horizon ends just after it."""
    upper: bool = False
    """The longest lengths the samples allow: every sample running at the horizon runs to its bound."""
    ends: float | None = None
    """The expected ends over the positions watched, where samples gave their chances (None: none did, the
    ends seen count)."""

    @property
    def horizon(self) -> int:
        return len(self.survival) - 1

    @classmethod
    def fit(cls, obs: Sequence[Observation]) -> OutputLengths:
        """``obs``: (tokens generated, ended by EOS or a stop[, chance of ending at each position]) per
        sample; a sample's chances, where given (one per token), stand for its end at each position."""
        if not obs:
            return cls(np.ones(1), 0, 0.0, 0)
        h = max(o[0] for o in obs)
        last = np.zeros(h + 2)  # samples whose last token is at t (ended or censored there)
        d = np.zeros(h + 2)  # ends at t: seen, or the chances given
        seen = 0
        smooth = False
        for o in obs:
            n, ended = o[0], o[1]
            chances = o[2] if len(o) > 2 else None
            last[n] += 1
            seen += bool(ended)
            if chances is not None and len(chances) == n:
                d[1 : n + 1] += np.asarray(chances, dtype=np.float64)
                smooth = True
            elif ended:
                d[n] += 1
        # at risk at t: samples known to reach t (their last token at >= t)
        at_risk = last[::-1].cumsum()[::-1][: h + 1]
        d = d[: h + 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(at_risk > 0, 1.0 - np.minimum(d / np.maximum(at_risk, 1), 1.0), 1.0)
        q[0] = 1.0
        horizon = int(np.count_nonzero(at_risk >= min(MIN_AT_RISK, len(obs)))) - 1
        surv = np.cumprod(q)[: max(horizon, 0) + 1]
        exposure = float(sum(o[0] for o in obs))
        return cls(surv, seen, exposure, len(obs), ends=float(d.sum()) if smooth else None)

    def at_least(self) -> OutputLengths:
        """The shortest lengths the samples allow: every sample still running at the horizon ends there."""
        return replace(self, lower=True)

    def at_most(self) -> OutputLengths:
        """The longest lengths the samples allow: every sample still running at the horizon runs to its bound
        (no end beyond the horizon)."""
        return replace(self, upper=True)

    def tail_hazard(self, bound: int) -> float:
        """The geometric hazard beyond the horizon, for rows of ``bound`` tokens."""
        if self.lower:
            return 1.0
        if self.upper:
            return 0.0
        m = bound - self.horizon
        if m <= 0:
            return 0.0
        return self._fitted_hazard(m)

    def _fitted_hazard(self, m: int) -> float:
        """The tail's hazard fitted to the samples over ``m`` positions past the horizon: with chances, the
        expected ends' rate itself (no draw's noise to correct for); else from the ends seen, without bias."""
        if self.ends is not None:
            return min(1.0, self.ends / self.exposure) if self.exposure > 0 else 0.0
        return _hazard_for(tail_estimate(self.events, self.exposure, m), m)

    def survival_to(self, t_max: int) -> np.ndarray:
        """``P(L > t)`` for ``t = 0 .. t_max``."""
        s = self.survival
        if t_max < len(s):
            return s[: t_max + 1]
        h = self.tail_hazard(t_max + 1)
        tail = s[-1] * (1.0 - h) ** np.arange(1, t_max - len(s) + 2)
        return np.concatenate([s, tail])

    def expected(self, bound: int) -> float:
        """``E[min(L, bound)]``."""
        return float(self.survival_to(max(bound - 1, 0))[:bound].sum()) if bound > 0 else 0.0

    def quantiles(self, bounds: Sequence[int]) -> list[int]:
        """One length per row, ``min(L, bound)`` at evenly spread quantiles of ``L`` (a deterministic sample
        keeping the spread of lengths, whose mean is the expectation's)."""
        if not len(bounds):
            return []
        b = np.asarray(bounds, dtype=np.int64)
        surv = self.survival_to(int(b.max()))
        u = (0.5 + np.arange(len(b)) * 0.6180339887498949) % 1.0
        t = np.searchsorted(-surv, -u, side="left")  # first t with P(L > t) <= u (-surv is non-decreasing)
        return np.where(b > 0, np.clip(np.minimum(t, b), 1, None), 0).tolist()

    def spread(self, bound: int) -> float:
        """Relative standard error of the mean output per sample at ``bound``: the sampling error of the
        lengths seen, the tail's (its rate's standard error, about ``sqrt(d + 1) / X``), and where fewer
        token positions were watched than the tail spans, the share not watched (lengths there are an
        extrapolation)."""
        if bound <= 0 or self.observations == 0:
            return 0.5
        surv = self.survival_to(bound - 1)[:bound]
        pmf = -np.diff(np.concatenate([[1.0], surv[1:], [0.0]]))  # P(min(L, bound) = t), t = 1 .. bound
        t = np.arange(1, bound + 1)
        mean = max(float((pmf * t).sum()), 1e-9)
        sd = math.sqrt(max(0.0, float((pmf * t * t).sum()) - mean**2))
        e = sd / math.sqrt(self.observations) / mean
        m = bound - self.horizon
        if m > 0 and not self.lower:
            s_h = float(self.survival[-1])
            h = self._fitted_hazard(m)
            tail = (
                tail_estimate(self.events, self.exposure, m)
                if self.ends is None
                else _geometric_mean_len(h, m)
            )
            # the tail's mean moved by one standard error of the rate (about sqrt(d + 1) / X, the ends' count
            # as if drawn: kept where the chances stand for them, the rows' own spread is not measured)
            d = self.events if self.ends is None else self.ends
            dh = math.sqrt(d + 1) / self.exposure if self.exposure > 0 else 1.0
            e += s_h * abs(tail - _geometric_mean_len(min(1.0, h + dh), m)) / mean
            if self.exposure < m:  # the part of the tail not watched
                e += s_h * (1.0 - self.exposure / m) * tail / mean
        return e


@dataclass
class Calibration:
    """What the calibration measured."""

    model: StepModel
    lengths: OutputLengths = field(default_factory=lambda: OutputLengths.fit([]))
    observations: list[Observation] = field(default_factory=list)
    """(tokens generated, ended by EOS or a stop, its chance of ending at each position or None) per sample
    run."""
    rows: int = 0
    seconds: float = 0.0
    step_seconds: float = 0.0
    steps: int = 0
    overhead: float = 1.0
    """The calibration's batch steps' wall time over the sum of their model times, at least 1
    (:func:`_overhead`)."""
    note: str = ""
    load: float | None = None
    """The machine's 1-minute load average when the calibration ended."""
    concurrency: int = 0
    """Most sequences the calibration ran at once."""
    target_concurrency: int = 0
    """The job's concurrency, which the calibration ramps to."""
    warmup_seconds: float = 0.0
    """Of ``seconds``: the warm-up batch and the timed one-sequence request."""
    budget: float = 0.0
    """The budget the calibration ended with (``fraction`` of the predicted time)."""
    batch_steps: int = 0
    """Steps timed at the job's concurrency in this calibration (less the one-sequence request's)."""
    reused_steps: int = 0
    """Of ``steps``: steps an earlier calibration on the same setup timed (:class:`StepCache`)."""
    first_calls_s: float = 0.0
    """What a fresh engine's first batch costs beyond the step model, paid once per engine: the warm-up's steps'
    excess over the model (:func:`_warm_up`), which are left out of the fit."""
    first_calls_paid: bool = False
    """The rows will run on the calibrated engine itself, whose one-time costs the calibration paid: not
    predicted again."""
    probe_seqs: int = 0
    """Sequences of the concurrency probe (0: none ran; :func:`_probe_concurrency`)."""
    probe_seconds: float = 0.0
    """Of ``seconds``: the concurrency probe's."""
    timed_steps: list[tuple[float, float, float, float]] = field(default_factory=list)
    """(P, D, K, seconds) per step the step model is fitted to, the reused first."""


@dataclass
class BudgetState:
    """The calibration's budget as it is re-evaluated (:func:`run_calibration`)."""

    seconds: float
    """The budget now: ``fraction`` of the wall time predicted from what is measured so far."""
    check: float = 0.0
    """Calibration seconds (warm-ups included) at which the budget is next re-evaluated."""
    fitted: int = 0
    """Timed steps the budget was last evaluated with."""
    row_seconds: float = 0.0
    """A row's prefill by the step model now (the admissions' ramp: :func:`run_calibration`)."""


def strata_order(rows: Sequence[CalibrationRow], seed: int = 0) -> list[CalibrationRow]:
    """Rows in the order the calibration takes them, so that any prefix of the order is a proportional
    stratified sample: each next row from the stratum furthest below its share (``N_h * k / N`` of the first
    ``k``; ties to the larger stratum), shuffled within each. Proportional, each sample stands for as many rows
    of the job as any other, so the output lengths pool without weights (an equal number per stratum would
    give a small stratum's lengths the weight of a large one's)."""
    by: dict[tuple[int, int], list[CalibrationRow]] = {}
    for r in rows:
        by.setdefault(r.stratum, []).append(r)
    rng = random.Random(seed)
    groups = sorted(by.values(), key=len, reverse=True)
    for g in groups:
        rng.shuffle(g)
    total = len(rows)
    taken = [0] * len(groups)
    out: list[CalibrationRow] = []
    for k in range(1, total + 1):
        j = max(
            (i for i, g in enumerate(groups) if taken[i] < len(g)),
            key=lambda i: (len(groups[i]) * k / total - taken[i], len(groups[i])),
        )
        out.append(groups[j][taken[j]])
        taken[j] += 1
    return out


def output_bound(prompt_len: int, params: Any, max_model_len: int) -> int:
    """Most output tokens a row can generate (per sample)."""
    room = max(0, max_model_len - prompt_len)
    mt = getattr(params, "max_tokens", None)
    return min(room, mt) if mt is not None else room


def compute_threads() -> int | None:
    """The intra-op threads the model computes with now (torch's; the engine's thread policy sets them from the
    CPUs other processes leave free, so a plan and its job may run with different counts); None before torch
    is loaded."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def run_calibration(
    engine: Any,
    order: Sequence[CalibrationRow],
    max_rows: int,
    budget_s: Any,
    batch: int,
    reused: Sequence[tuple[float, float, float, float]] = (),
) -> Calibration:
    """Run up to ``max_rows`` of ``order``'s rows through ``engine`` fed as the job feeds them, at most
    ``batch`` (the job's concurrency) unfinished, each step timed, until they are done or the budget is spent;
    then the rows still running are aborted, their lengths so far kept as censored observations
    (:class:`OutputLengths`). ``budget_s(calibration) -> seconds`` is the budget given what is measured so
    far; it is re-evaluated each time half of it is spent and before the calibration stops (the job's
    prediction sharpens as the steps accumulate). ``reused``: steps an earlier calibration on the same setup
    timed (:class:`StepCache`): the step model starts from them and is fitted to them with this one's, and the
    timed one-sequence request is left out (the budget goes to output lengths)."""
    samples: list[tuple[float, float, float, float]] = [tuple(x) for x in reused]  # type: ignore[misc]
    # the thread count the engine took when it was built may be stale (the dry run read and tokenized the whole
    # input since): decided again from the load now, before any step is timed (not the job's work)
    engine.look_at_threads()
    cal = Calibration(fit_step_model([]), target_concurrency=batch, reused_steps=len(samples))
    t_start = time.perf_counter()  # the warm-ups count against the budget: the calibration's whole cost
    first: list[tuple[float, float, float, float]] = []  # the warm-up's steps: one-time costs
    _warm_up(engine, order[:WARM_UP_SEQS], first)
    if samples:
        cal.model = fit_step_model(samples)
    else:
        _timed(engine, [_short_request(order[-1], "one")], samples)  # the small-batch end of the step model
        cal.model = _one_sequence_model(samples)
    state = BudgetState(budget_s(cal))
    state.row_seconds = _row_prefill_seconds(cal.model, order, batch)

    def admit(in_flight: int) -> int:
        """Rows that may be unfinished after this step: ``in_flight`` and a step's prefills taking at most a
        third of the budget, the rows' prefills all told at most half of it (then the job's concurrency is
        not reached, and the range says so), at least a few."""
        row_s = state.row_seconds
        if row_s <= 0:
            return batch
        b = state.seconds
        step = max(min(batch, 4), int(b / 3 / row_s))
        return max(min(batch, 4), min(batch, in_flight + step, int(b / 2 / row_s)))

    def refresh(running: Sequence[tuple[int, bool]] = ()) -> float:
        cal.model = fit_step_model(samples)
        cal.lengths = OutputLengths.fit([*cal.observations, *running])
        cal.seconds = time.perf_counter() - t_start
        state.seconds = budget_s(cal)
        # next: halfway to the budget, or when the time spent has grown by half (an early budget, from few
        # lengths seen, may be far too large: it must not run unchecked)
        state.check = cal.seconds + max(0.05, min((state.seconds - cal.seconds) / 2, cal.seconds / 2))
        state.fitted = len(samples) - cal.reused_steps
        state.row_seconds = _row_prefill_seconds(cal.model, order, batch)
        return state.seconds

    # the first budget takes every row to its bound (no length seen): re-evaluated early, at a quarter of it
    state.check = state.seconds / 4
    cal.warmup_seconds = time.perf_counter() - t_start
    rows = order[:max_rows]
    n0 = len(samples)
    memo: dict = {}  # the end watches, made before the batches are timed (not the job's work)
    watches = {r.index: _end_watch(engine, r.params, memo) for r in rows}
    admitted, finished = _run_stream(engine, rows, admit, samples, cal, t_start, state, refresh, watches)
    cal.rows = admitted
    n1 = len(samples)
    t_probe = time.perf_counter()
    left = state.seconds - (t_probe - t_start)
    cal.probe_seqs = _probe_concurrency(
        engine, order, batch, cal.concurrency, max(left, state.seconds / 2, PROBE_MIN_S), samples
    )
    cal.probe_seconds = time.perf_counter() - t_probe
    if finished < admitted:
        cal.note = f"stopped at its budget of {state.seconds:.2f} s, {admitted - finished} row(s) censored"
    cal.model = fit_step_model(samples)
    cal.lengths = OutputLengths.fit(cal.observations)
    cal.seconds = time.perf_counter() - t_start
    cal.steps = len(samples)
    cal.batch_steps = n1 - n0
    cal.budget = state.seconds
    if cal.seconds > cal.budget and finished < admitted and cal.batch_steps <= MIN_BATCH_STEPS:
        cal.note += (
            f"; its floor (the warm-up and {MIN_BATCH_STEPS} batch steps) took {cal.seconds:.2f} s, over the "
            "budget: a job this short cannot buy a useful sample within it, the range is widened instead"
        )
    cal.step_seconds = sum(x[3] for x in samples[cal.reused_steps :])
    cal.timed_steps = samples
    cal.overhead = _overhead(cal.model, samples[n0:n1])
    cal.first_calls_s = sum(max(0.0, x[3] - cal.model.step_time(*x[:3])) for x in first)
    cal.load = load_average()
    return cal


def _overhead(model: StepModel, steps: Sequence[tuple[float, float, float, float]]) -> float:
    """The batch's steps' wall time (each the driver's admissions, the engine's step and its outputs handed on,
    as the job runs them; the calibration's own bookkeeping between steps left out) over their model times, at
    least 1: stalls the fit leaves out, which the job meets too."""
    predicted = sum(model.step_time(*x[:3]) for x in steps)
    return max(1.0, sum(x[3] for x in steps) / predicted) if predicted > 0 else 1.0


def _one_sequence_model(samples: Sequence[tuple[float, float, float, float]]) -> StepModel:
    """The first step model, from the timed one-sequence request (a prefill step, then a decode step): per
    step the decode step's time, per prompt token the prefill step's excess over it. It errs short (a batch's
    steps cost more), so the first budget errs small, and the budget re-evaluated before stopping grows it."""
    if not samples:
        return StepModel((0.0, 0.0, 0.0, 0.0), 0.0)
    if len(samples) < 2 or samples[0][0] <= 0:
        return StepModel((sum(x[3] for x in samples) / len(samples), 0.0, 0.0, 0.0), 0.0)
    decode = samples[-1][3]
    return StepModel((decode, max(0.0, samples[0][3] - decode) / samples[0][0], 0.0, 0.0), 0.0)


def _row_prefill_seconds(model: StepModel, order: Sequence[CalibrationRow], batch: int) -> float:
    """Seconds a row's prefill (of the tokens the job computes, after sharing) takes, by the first step
    model's cost per prompt token; 0 when it cannot tell."""
    per_token = model.coef[1]
    head = order[:batch]
    mean_prompt = sum(len(r.token_ids) if r.compute is None else r.compute for r in head) / max(1, len(head))
    return per_token * mean_prompt


def _short_params(params: Any, max_tokens: int) -> Any:
    """The row's parameters for a request that generates exactly ``max_tokens`` tokens whatever its stops; a
    row under structured output keeps its grammar (initialised here, out of the timed steps), which ends the
    output itself and refuses ignore_eos."""
    if params is None:
        return None
    return replace(params, max_tokens=max_tokens, min_tokens=0,
                   ignore_eos=not getattr(params, "constrained", False), stop=None, stop_token_ids=None)  # fmt: skip


def _short_request(row: CalibrationRow, name: str, tokens: int | None = None, new: int = 2) -> Any:
    """A request of ``row`` (its first ``tokens`` prompt tokens; None: all) generating ``new`` tokens: a prefill
    step, then decode steps."""
    from batchgen.driver import EngineRequest

    prompt = list(row.token_ids[:tokens] if tokens is not None else row.token_ids)
    return EngineRequest(
        f"batchgen-calibration-{name}", prompt, _short_params(row.params, new), lora_request=row.lora
    )


def _warm_up(
    engine: Any, rows: Sequence[CalibrationRow], first: list[tuple[float, float, float, float]]
) -> None:
    """A small batch of ``rows`` (their first :data:`WARM_UP_TOKENS` tokens, 2 generated) through the engine:
    the lazy initialisation and one-time costs of a fresh engine's first batch (kernels loaded, first calls at a
    batch's shapes, the first writes into the KV pool: tens of milliseconds on a CPU, varying run to run) are
    paid here, its steps timed into ``first`` (:attr:`Calibration.first_calls_s`), not into the model's."""
    _timed(engine, [_short_request(r, f"warmup-{i}", WARM_UP_TOKENS) for i, r in enumerate(rows)], first)


def _timed(engine: Any, requests: list[Any], samples: list[tuple[float, float, float, float]]) -> None:
    """Run ``requests`` to their ends, all admitted at once; each step timed into ``samples`` as ``(P, D, K,
    seconds)``."""
    from batchgen.driver import Driver, Requests

    steps = Driver(engine, Requests(requests, lambda outs: None)).steps()
    prev = engine.stats.snapshot()
    while True:
        k = _context_tokens(engine)  # before the step (see _run_stream)
        t0 = time.perf_counter()
        if next(steps, None) is None:
            return
        dt = time.perf_counter() - t0
        st = engine.stats
        p = st.prompt_tokens_computed - prev.prompt_tokens_computed
        d = st.generated_tokens - prev.generated_tokens
        samples.append((float(p), float(d), k, dt))
        prev = st.snapshot()


def _probe_concurrency(
    engine: Any,
    order: Sequence[CalibrationRow],
    batch: int,
    reached: int,
    allowance_s: float,
    samples: list[tuple[float, float, float, float]],
) -> int:
    """Where the calibration's batch stayed far below the job's concurrency (its budget admits a few rows: a
    short job, long prompts), the cost of a decode step per running sequence — its attention over a context of
    the job's length, its sampling — is not in its steps. This probe times it: one sequence prefills a prompt
    of the rows' mean length (cut from a row, ending one token into a block), then up to ``batch`` sequences
    of that prompt, admitted at once, each compute its last token (the rest is a prefix cache hit) and
    generate :data:`PROBE_TOKENS` tokens: decode steps at the job's concurrency over contexts of the job's
    length. As many sequences as its cost by the step model so far fits in ``allowance_s``; none when that is
    not over twice ``reached`` or is under :data:`MIN_PROBE_SEQS`. Returns the sequences probed."""
    model = fit_step_model(samples)
    per_token, per_step = max(model.coef[1], 0.0), max(model.coef[0], 0.0)
    bs = max(1, engine.stats.block_size or 16)
    caching = getattr(getattr(engine, "config", None), "enable_prefix_caching", False)
    mean = sum(len(r.token_ids) for r in order) / max(1, len(order))
    length = max(2, min(max(len(r.token_ids) for r in order), int(mean) // bs * bs + 1))
    row = next(r for r in order if len(r.token_ids) >= length)  # its first `length` tokens: the prompt
    # a sequence's prefill (its last token with the prefix cached) and its decode steps, a decode step's
    # sequence priced as two prompt tokens (its attention over the context, its sampling)
    per_seq = ((1 if caching else length) + 2 * PROBE_TOKENS) * per_token
    first = length * per_token + per_step
    fits = int((allowance_s - first - (PROBE_TOKENS + 1) * per_step) / per_seq) if per_seq > 0 else batch
    n = min(batch, fits)
    if n <= 2 * reached or n < MIN_PROBE_SEQS:
        return 0
    if caching:  # one sequence first: its blocks cached for the others
        _timed(engine, [_short_request(row, "probe--1", length, 1)], samples)
    _timed(engine, [_short_request(row, f"probe-{i}", length, PROBE_TOKENS) for i in range(n)], samples)
    return n


def _run_stream(
    engine: Any,
    rows: Sequence[CalibrationRow],
    admit: Any,
    samples: list[tuple[float, float, float, float]],
    cal: Calibration,
    t_start: float,
    state: BudgetState,
    refresh: Any,
    watches: dict[int, EndProbability | None],
) -> tuple[int, int]:
    """Feed ``rows`` to the engine as the job does (a finished row's place taken by the next, at most
    ``admit(unfinished rows allowed so far)`` unfinished: ramped to the job's concurrency so no step's prefill
    is too long), each step timed, until they are all done or the budget is spent (after at
    least :data:`MIN_BATCH_STEPS` steps): the rows still running are then aborted, their samples' lengths so
    far kept as censored observations. Returns (rows admitted, rows finished)."""
    from batchgen.driver import Driver, EngineRequest, Requests

    ids = {f"batchgen-calibration-{r.index}": r for r in rows}
    watches = {rid: watches[r.index] for rid, r in ids.items()}  # by request id from here on
    requests = [
        EngineRequest(rid, list(r.token_ids), r.params, lora_request=r.lora, addons=_addons(watches[rid]))
        for rid, r in ids.items()
    ]
    task = Requests(requests, lambda outs: None)
    driver = Driver(engine, task, max_in_flight=admit(0))
    steps = driver.steps()
    st = engine.stats
    prev = st.snapshot()
    finished = 0
    n0 = len(samples)
    dt = 0.0
    while True:
        now = time.perf_counter() - t_start
        # a step like the last one would end past the budget (less a margin for the stop: the abort, a refit)
        over = now + dt >= STOP_MARGIN * state.seconds
        enough = len(samples) - n0 >= MIN_BATCH_STEPS
        # the budget re-evaluated halfway, and before stopping with a quarter more steps than it was fitted
        # to (the first estimate, from one sequence's steps, may be far off the job's)
        # and first once the floor of batch steps is timed, whatever the first budget (from one sequence's
        # steps and every row at its bound, it may be far too large)
        first = enough and not state.fitted
        if (
            (now >= state.check and not over)
            or first
            or (over and enough and len(samples) - cal.reused_steps >= 1.25 * state.fitted)
        ):
            was_over = over
            refresh(_running(engine, ids, watches))
            # past the budget, it goes on only for a budget grown well beyond (a noisy fit may shrink it next)
            over = now + dt >= STOP_MARGIN * state.seconds / (1.25 if was_over else 1.0)
        if over and enough:
            cal.observations += _running(engine, ids, watches)
            admitted = finished + len(driver.in_flight)
            task.queue.clear()  # nothing more is admitted
            driver.abort()
            for _ in steps:  # aborted requests leave at the next step
                pass
            return admitted, finished
        k = _context_tokens(engine)  # the contexts the step's decoders attend over, as the simulation counts
        t0 = time.perf_counter()
        outs = next(steps, None)
        if outs is None:
            break
        dt = time.perf_counter() - t0
        st = engine.stats
        p = st.prompt_tokens_computed - prev.prompt_tokens_computed
        d = st.generated_tokens - prev.generated_tokens
        prev = st.snapshot()
        if p or d:
            samples.append((float(p), float(d), float(k), dt))
        cal.concurrency = max(cal.concurrency, int(d))
        driver.max_in_flight = admit(driver.max_in_flight or 0)
        for out in outs:
            r = ids.pop(out.request_id, None)
            if r is None:
                continue
            finished += 1
            if out.error:
                continue
            watch = watches.get(out.request_id)
            for c in out.outputs:
                n = len(c.token_ids)
                ended = getattr(c, "finish_reason", None) == "stop"
                chances = watch.of(c.index, n, _stop_string(c, ended)) if watch is not None else None
                cal.observations.append((n, ended, chances))
    return finished, finished


def _stop_string(out: Any, ended: bool) -> str | None:
    """The stop string that ended a sample (None: none did)."""
    reason = getattr(out, "stop_reason", None)
    return reason if ended and isinstance(reason, str) else None


def _end_watch(engine: Any, params: Any, memo: dict) -> EndProbability | None:
    """An add-on recording a sampled request's chance of ending at each token (None: greedy or beam
    requests, whose ends are as good as their chances, or an engine without stop rules). Its tokens: the stop
    ids and eos, and, where no ``min_tokens`` holds them back, every token whose text holds a one-character
    stop string (drawn, it ends the sequence). Requests with the same ends share one :class:`WatchedTokens`
    (``memo``), so the sampler sums their chances in one gather."""
    from batchgen.engine.features.end_probability import EndProbability
    from batchgen.engine.worker.sampler import WatchedTokens

    stop = getattr(engine, "stop", None)
    if stop is None or params is None or params.greedy or getattr(params, "beam_width", 1) > 1:
        return None
    ids = tuple(stop.stop_token_ids(params))
    chars = tuple(sorted({s for s in params.stop or () if len(s) == 1})) if not params.min_tokens else ()
    key = (ids, chars)
    if key not in memo:
        holding = _tokens_holding(getattr(engine, "tokenizer", None), chars, memo) if chars else None
        end_ids, covered = (sorted(set(ids) | holding), chars) if holding is not None else (ids, ())
        memo[key] = (WatchedTokens(end_ids), covered)
    tokens, covered = memo[key]
    return EndProbability(tokens, covered)


def _tokens_holding(tokenizer: Any, chars: tuple[str, ...], memo: dict) -> set[int] | None:
    """The ids whose text, decoded alone, contains one of ``chars`` (none partial: text ending in an unfinished
    character is left out); None without a tokenizer that decodes."""
    if ("vocab", chars) in memo:
        return memo["vocab", chars]
    found: set[int] | None = None
    try:
        n = len(tokenizer)
        ids = [[i] for i in range(n)]
        rust = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if hasattr(rust, "decode_batch"):  # the Rust tokenizer's own batch: milliseconds for the vocab
            texts = rust.decode_batch(ids, skip_special_tokens=True)
        else:
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        found = {i for i, t in enumerate(texts) if "\ufffd" not in t and any(c in t for c in chars)}
    except Exception:  # a tokenizer without len / batch_decode: the stop strings' ends are counted as seen
        found = None
    memo["vocab", chars] = found
    return found


def _addons(watch: EndProbability | None) -> tuple[Any, ...]:
    return () if watch is None else (watch,)


def _context_tokens(engine: Any) -> float:
    """The step model's ``K`` before a step: tokens its decoders attend over, each sequence's whole context (a
    prefix block several sequences share is read by each), as the schedule simulation counts it; from the KV
    blocks held where the engine does not show its sequences."""
    sched = getattr(engine, "scheduler", None)
    if sched is not None and hasattr(sched, "running_seqs"):
        return float(sum(s.num_computed_tokens for s in sched.running_seqs()))
    st = engine.stats
    return float(st.kv_blocks_used * max(1, st.block_size))


STEP_CACHE_KIND = "step-model"
STEP_CACHE_STEPS = 1024
"""Most timed steps a :class:`StepCache` entry keeps (the latest)."""


@dataclass
class StepCache:
    """Timed engine steps kept between dry runs under ``$BATCHGEN_CACHE/step-model/`` (:mod:`batchgen.runtime.
    disk_cache`), one entry per setup: the model (its path and config), dtype, engine configuration, device
    and machine (host, CPUs), the installed torch and transformers, and this module's source — the step time
    depends on all of them, and on the threads the engine computes with and the sampling
    (:func:`sampling_signature`), which the caller adds to the setup),
    the output lengths on none of them but the model. A second dry run on the same
    setup starts its step model from these steps and fits it to them with its own, so its budget goes to
    output lengths. Steps timed under another load regime (:func:`load_spread` differs by 0.1 or more) are
    not reused: a machine shared differently runs at another speed."""

    key: str

    @classmethod
    def for_setup(cls, *parts: Any) -> StepCache:
        import platform

        from batchgen.runtime.disk_cache import make_key, source_key

        machine = (platform.node(), platform.machine(), platform.processor(), os.cpu_count())
        return cls(make_key(STEP_CACHE_KIND, source_key(__file__), machine, *parts))

    def load(self, load: float | None) -> list[tuple[float, float, float, float]]:
        """The kept steps, if timed under the load regime of ``load``; else none."""
        from batchgen.runtime.disk_cache import read

        entry = read(STEP_CACHE_KIND, self.key)
        if not isinstance(entry, dict) or not isinstance(entry.get("steps"), list):
            return []
        if abs(load_spread(entry.get("load")) - load_spread(load)) >= 0.1:
            return []
        try:
            return [tuple(float(v) for v in x[:4]) for x in entry["steps"] if len(x) >= 4]  # type: ignore[misc]
        except (TypeError, ValueError):
            return []

    def store(self, cal: Calibration, steps: Sequence[tuple[float, float, float, float]]) -> None:
        from batchgen.runtime.disk_cache import write

        write(
            STEP_CACHE_KIND,
            self.key,
            {"steps": [list(x) for x in steps[-STEP_CACHE_STEPS:]], "load": cal.load},
        )


def sampling_signature(params: Sequence[Any]) -> list[tuple[Any, ...]]:
    """What of the rows' sampling parameters a step's time depends on (the sampler's path: greedy or drawn,
    top-p/k, min-p, penalties, log-probabilities, samples and beams, a grammar, stop strings read from the
    text), one entry per kind among ``params``, sorted: part of a :class:`StepCache` setup, so steps timed
    under other sampling are not reused."""
    kinds = set()
    for p in {id(p): p for p in params if p is not None}.values():
        if not hasattr(p, "temperature"):  # not a SamplingParams (a prompt-only job's row needs)
            kinds.add((type(p).__name__,))
            continue
        constraint = next(
            (k for k in ("json_schema", "regex", "choice", "grammar") if getattr(p, k, None)), ""
        )
        kinds.add((
            p.temperature == 0, p.top_p < 1, p.top_k > 0, p.min_p > 0,
            (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) != (1.0, 0.0, 0.0),
            p.logprobs is not None, p.prompt_logprobs is not None, p.n, p.beam_width, constraint, bool(p.stop),
        ))  # fmt: skip
    return sorted(kinds, key=repr)


def load_spread(load: float | None, cpus: int | None = None) -> float:
    """Relative uncertainty from the machine's other load: with the CPUs oversubscribed (1-minute load
    average above their count) the job gets a share ``cpus / load`` of them that the calibration measured
    and the run will not keep; half the part of the time that share explains."""
    cpus = cpus or os.cpu_count() or 1
    if load is None or load <= cpus:
        return 0.0
    return min(0.5, 0.5 * (1.0 - cpus / load))


def _running(engine: Any, ids: Any, watches: Any = None) -> list[Observation]:
    """The samples of the requests ``ids`` still running: censored at their tokens so far (a sample of
    theirs already finished below its bound: an event), with their chances of ending where watched."""
    live = getattr(engine, "requests", None) or {}
    out: list[Observation] = []
    for rid, row in ids.items():
        bound = output_bound(len(row.token_ids), row.params, engine.max_model_len)
        watch = (watches or {}).get(rid)
        for seq in getattr(live.get(rid), "seqs", None) or ():
            n = int(seq.num_output_tokens)
            ended = bool(seq.is_finished) and n < bound
            chances = watch.of(seq.sample_index, n, _stop_string(seq, ended)) if watch is not None else None
            out.append((n, ended, chances))
    return out


def relative_spread(
    cal: Calibration, bound: int, floor: float = 0.2, cap: float = 0.8, lengths: bool = True
) -> float:
    """Half-width of the predicted range, relative, from what the calibration measured: the step model's
    residual over its steps, the output lengths' standard error (:meth:`OutputLengths.spread` at the job's
    typical bound), the machine's load at calibration (:func:`load_spread`), and a floor for what none of them
    sees (the extrapolation to the whole job, fixed costs: on an idle machine the prediction still missed by up to
    17% with the other terms under 10%); a small sample widens it: few calibrated rows, fewer batch steps than
    :data:`FULL_SAMPLE_STEPS` (a budget of a few percent of a short job), the job's concurrency not reached (the
    per-sequence cost extrapolated to it). ``lengths=False``: without the output lengths' error (for a time
    simulated with the extreme lengths the samples allow)."""
    e_out = cal.lengths.spread(bound) if lengths else 0.0
    e_fit = cal.model.residual_rel / math.sqrt(max(cal.steps, 1))
    e_load = load_spread(cal.load)
    few = 0.3 if cal.rows < 4 else 0.0
    e_steps = 0.25 * max(0.0, 1.0 - (cal.batch_steps + cal.reused_steps) / FULL_SAMPLE_STEPS)
    e_conc = 0.0
    if cal.target_concurrency > 0 and cal.concurrency < cal.target_concurrency:
        e_conc = 0.25 * (1.0 - cal.concurrency / cal.target_concurrency)
    terms = (floor, e_out, e_fit, e_load, few, e_steps, e_conc)
    return min(cap, math.sqrt(sum(x * x for x in terms)))
