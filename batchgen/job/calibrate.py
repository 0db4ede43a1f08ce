"""Predicting a job's wall time: a calibration run of the real engine, a step-time model fitted to it, and a
simulation of the engine's schedule over every row of the job.

**Step-time model.** One engine step costs ``c0 + a * P + b * D + k * K`` seconds: ``P`` prompt tokens
computed in the step (after prefix sharing), ``D`` sequences that produced a token, ``K`` thousands of tokens
held by the running sequences (the attention's reads). The coefficients are fitted by least squares over the
calibration's steps, a term whose coefficient comes out negative being dropped.

**Calibration.** A stratified sample of the job's rows — by prompt length (quartiles) and prefix group (the
first block of tokens) — runs through the engine with the job's own sampling parameters (so seeded rows
generate exactly what the job will), a batch at a time. Each row's output length over its bound
(``max_tokens``, or the context left) gives the output-length ratio of its stratum. Batches stop once the
calibration has spent its budget: ``fraction`` of the wall time predicted after the first batch.

**Schedule simulation.** The rows, in the job's feed order, go through a model of the scheduler: decodes first,
then prefill chunks under ``max_num_batched_tokens``, admission while the sequence cap and the KV pool allow;
a request's prefill completes with its first token, then it decodes one token per step. Each step is priced by
the model; stretches without admissions or prefills are summed in closed form, so the simulation costs
O(rows log rows) plus the steps that admit.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    """Least squares over ``(P, D, K, seconds)`` steps, non-negative by dropping negative terms."""
    if not samples:
        return StepModel((0.0, 0.0, 0.0, 0.0), 1.0)
    x = np.array([[1.0, s[0], s[1], s[2] / 1000.0] for s in samples])
    y = np.array([s[3] for s in samples])
    keep = [0, 1, 2, 3]
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


@dataclass
class SimRequest:
    """A row as the simulation sees it: prompt tokens to compute, prompt length, output tokens, samples."""

    compute: int
    prompt: int
    output: int
    n: int = 1


@dataclass
class SimResult:
    seconds: float
    steps: int
    peak_running: int


def simulate_schedule(
    reqs: Sequence[SimRequest],
    model: StepModel,
    max_num_seqs: int,
    max_batched_tokens: int,
    kv_tokens: int | None,
) -> SimResult:
    """Seconds the engine takes over ``reqs`` in this order (module docstring)."""
    waiting = deque(reqs)
    prefilling: deque[list[Any]] = deque()  # [tokens left to compute, request]
    decoders: list[tuple[int, int, int, int, int]] = []  # heap: (finish step, start step, context, n, id)
    seqs = 0  # sequences admitted and not finished (prefilling or decoding)
    s0 = 0  # sum over decoders of n * (context at start - start step)
    dn = 0  # decoding sequences
    kv_used = 0
    kv_of: dict[int, int] = {}
    t = 0.0
    step = 0
    peak = 0
    uid = 0

    def need(r: SimRequest) -> int:
        return (r.compute + r.output) * r.n + (r.prompt - r.compute)

    while waiting or prefilling or decoders:
        can_admit = bool(waiting) and (seqs == 0 or seqs + waiting[0].n <= max_num_seqs)
        if can_admit and kv_tokens is not None and kv_used + need(waiting[0]) > kv_tokens and seqs > 0:
            can_admit = False
        if not prefilling and not can_admit and decoders:
            # a pure decode stretch until the next finish: D fixed, K growing by D each step
            nxt = decoders[0][0]
            k = max(1, nxt - step)
            c = model.coef
            kk = (s0 + dn * step) * k + dn * k * (k - 1) / 2  # sum of K over the k steps
            t += k * (c[0] + c[2] * dn) + c[3] * kk / 1000.0
            step += k
        else:
            dn0, k0 = dn, s0 + dn * step  # the sequences decoding in this step, and their context
            budget = max(0, max_batched_tokens - dn)
            p = 0
            done_now = 0
            while budget > 0 and (prefilling or can_admit):
                if not prefilling:
                    r = waiting.popleft()
                    seqs += r.n
                    kv_used += need(r)
                    prefilling.append([max(r.compute, 1), r, uid])
                    kv_of[uid] = need(r)
                    uid += 1
                item = prefilling[0]
                take = min(budget, item[0])
                item[0] -= take
                budget -= take
                p += take
                if item[0] == 0:
                    prefilling.popleft()
                    r = item[1]
                    done_now += r.n
                    left = r.output - 1
                    if left <= 0:
                        seqs -= r.n
                        kv_used -= kv_of.pop(item[2])
                    else:
                        heapq.heappush(decoders, (step + left + 1, step + 1, r.prompt + 1, r.n, item[2]))
                        s0 += r.n * (r.prompt + 1 - (step + 1))
                        dn += r.n
                can_admit = bool(waiting) and (seqs == 0 or seqs + waiting[0].n <= max_num_seqs)
                if (
                    can_admit
                    and kv_tokens is not None
                    and kv_used + need(waiting[0]) > kv_tokens
                    and seqs > 0
                ):
                    can_admit = False
            t += model.step_time(p, dn0 + done_now, k0)
            step += 1
        while decoders and decoders[0][0] <= step:
            _f, start, ctx, n, rid = heapq.heappop(decoders)
            s0 -= n * (ctx - start)
            dn -= n
            seqs -= n
            kv_used -= kv_of.pop(rid)
        peak = max(peak, seqs)
    return SimResult(t, step, peak)


@dataclass
class CalibrationRow:
    """A row the calibration may run: its tokens, parameters and stratum."""

    index: int
    token_ids: list[int]
    params: Any
    stratum: tuple[int, int]
    lora: Any = None


@dataclass
class Calibration:
    """What the calibration measured."""

    model: StepModel
    ratios: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    """Output tokens / output bound of the rows run, by stratum."""
    rows: int = 0
    seconds: float = 0.0
    step_seconds: float = 0.0
    steps: int = 0
    overhead: float = 1.0
    """Calibration wall time over the sum of its steps' model times (adding requests, Python between steps)."""
    note: str = ""

    def all_ratios(self) -> list[float]:
        return [r for v in self.ratios.values() for r in v]


def strata_order(rows: Sequence[CalibrationRow], seed: int = 0) -> list[CalibrationRow]:
    """Rows in the order the calibration takes them: round robin over strata (largest first), shuffled
    within each, so any prefix of the order is a stratified sample."""
    by: dict[tuple[int, int], list[CalibrationRow]] = {}
    for r in rows:
        by.setdefault(r.stratum, []).append(r)
    rng = random.Random(seed)
    groups = sorted(by.values(), key=len, reverse=True)
    for g in groups:
        rng.shuffle(g)
    out: list[CalibrationRow] = []
    i = 0
    while len(out) < len(rows):
        for g in groups:
            if i < len(g):
                out.append(g[i])
        i += 1
    return out


def output_bound(prompt_len: int, params: Any, max_model_len: int) -> int:
    """Most output tokens a row can generate (per sample)."""
    room = max(0, max_model_len - prompt_len)
    mt = getattr(params, "max_tokens", None)
    return min(room, mt) if mt is not None else room


def run_calibration(
    engine: Any,
    order: Sequence[CalibrationRow],
    max_rows: int,
    budget_s: Any,
    first_batch: int,
    max_batch: int,
) -> Calibration:
    """Run ``order``'s rows through ``engine`` in growing batches until ``max_rows`` have run, the next batch
    would pass the budget, or the budget is spent: a batch after the first still running then is aborted, its
    output lengths discarded (the rows that finished first are the short ones: a biased sample) and its steps
    kept. ``budget_s(calibration) -> seconds`` is the budget given what is measured so far. The first batch
    always runs to its end (at least ``first_batch`` rows, fewer when a timed short request says they would
    pass the budget, but at least 2): without one complete batch there is no output length to go by."""
    samples: list[tuple[float, float, float, float]] = []
    cal = Calibration(fit_step_model([]))
    _warm_up(engine, order[0], None)  # not timed: lazy initialisation
    t_start = time.perf_counter()
    warm: list[tuple[float, float, float, float]] = []
    _warm_up(engine, order[0], warm)
    mean_step = sum(s[3] for s in warm) / max(1, len(warm))
    cal.model = StepModel((mean_step, 0.0, 0.0, 0.0), 0.0)
    budget = budget_s(cal)
    pos = 0
    batch = max(1, min(len(order), max_rows, first_batch, max_batch))
    bound = sum(output_bound(len(r.token_ids), r.params, engine.max_model_len) for r in order[:batch]) / batch
    affordable = int(budget / max(mean_step * (bound + 1), 1e-9))  # rows in parallel, one token a step each
    batch = max(min(2, len(order)), min(batch, affordable))
    first = True
    while pos < len(order) and cal.rows < max_rows:
        rows = order[pos : pos + batch]
        pos += len(rows)
        finished = _run_batch(engine, rows, samples, cal, None if first else t_start + budget)
        first = False
        cal.rows += finished
        cal.model = fit_step_model(samples)
        cal.seconds = time.perf_counter() - t_start
        cal.steps = len(samples)
        predicted_steps = sum(cal.model.step_time(*s[:3]) for s in samples)
        cal.step_seconds = sum(s[3] for s in samples)
        cal.overhead = max(1.0, cal.seconds / predicted_steps) if predicted_steps > 0 else 1.0
        if finished < len(rows):
            cal.note = f"stopped at its cap of {budget:.2f} s, {len(rows) - finished} row(s) unfinished"
            break
        budget = budget_s(cal)
        batch = min(max_batch, 2 * batch, max_rows - cal.rows)
        if batch <= 0:
            break
        per_row = cal.seconds / max(cal.rows, 1)
        if cal.seconds + per_row * batch * 0.6 > budget:  # batching amortizes: a batch costs less per row
            break
    return cal


def _warm_up(
    engine: Any, row: CalibrationRow, samples: list[tuple[float, float, float, float]] | None
) -> None:
    """One short request (2 tokens of ``row``): lazy initialisation (kernels, graphs, allocator) out of the
    timings when ``samples`` is None; else its steps timed into ``samples``."""
    from dataclasses import replace

    from batchgen.driver import Driver, EngineRequest, Requests

    params = replace(row.params, max_tokens=2, min_tokens=0) if row.params is not None else None
    request = EngineRequest(f"batchgen-calibration-warmup-{samples is None}", list(row.token_ids), params)
    steps = Driver(engine, Requests([request], lambda outs: None)).steps()
    while True:
        t0 = time.perf_counter()
        if next(steps, None) is None:
            return
        if samples is not None:
            samples.append((1.0, 1.0, float(len(row.token_ids)), time.perf_counter() - t0))


def _run_batch(
    engine: Any,
    rows: Sequence[CalibrationRow],
    samples: list[tuple[float, float, float, float]],
    cal: Calibration,
    deadline: float | None,
) -> int:
    """Run ``rows`` to their end, or until ``deadline`` (the rest aborted and the batch's output lengths
    discarded); returns how many finished."""
    from batchgen.driver import Driver, EngineRequest, Requests

    ids = {f"batchgen-calibration-{r.index}": r for r in rows}
    requests = [
        EngineRequest(rid, list(r.token_ids), r.params, lora_request=r.lora) for rid, r in ids.items()
    ]
    driver = Driver(engine, Requests(requests, lambda outs: None))
    steps = driver.steps()
    st = engine.stats
    bs = max(1, st.block_size)
    prev = st.snapshot()
    finished = 0
    ratios: list[tuple[tuple[int, int], float]] = []
    while True:
        if deadline is not None and time.perf_counter() > deadline:
            driver.abort()
            for _ in steps:  # aborted requests leave at the next step
                pass
            return finished
        t0 = time.perf_counter()
        outs = next(steps, None)
        if outs is None:
            break
        dt = time.perf_counter() - t0
        st = engine.stats
        p = st.prompt_tokens_computed - prev.prompt_tokens_computed
        d = st.generated_tokens - prev.generated_tokens
        k = st.kv_blocks_used * bs
        prev = st.snapshot()
        if p or d:
            samples.append((float(p), float(d), float(k), dt))
        for out in outs:
            r = ids.pop(out.request_id, None)
            if r is None:
                continue
            finished += 1
            if out.error:
                continue
            n = sum(len(c.token_ids) for c in out.outputs) / max(1, len(out.outputs))  # per sample
            bound = output_bound(len(r.token_ids), r.params, engine.max_model_len)
            if bound > 0:
                ratios.append((r.stratum, min(1.0, n / bound)))
    for stratum, ratio in ratios:
        cal.ratios.setdefault(stratum, []).append(ratio)
    return finished


def relative_spread(cal: Calibration, floor: float = 0.2, cap: float = 0.6) -> float:
    """Half-width of the predicted range, relative: the fit's residual, the output ratios' standard error and a
    floor for what neither sees (the extrapolation to larger batches), widened when the machine's CPUs are
    oversubscribed (its other load changes the speed while the job runs)."""
    import os

    try:
        if os.getloadavg()[0] > (os.cpu_count() or 1):
            floor += 0.1
    except OSError:
        pass
    ratios = cal.all_ratios()
    e_out = 0.0
    if len(ratios) > 1 and np.mean(ratios) > 0:
        e_out = float(np.std(ratios) / math.sqrt(len(ratios)) / np.mean(ratios))
    e_fit = cal.model.residual_rel / math.sqrt(max(cal.steps, 1))
    return min(
        cap, max(floor, math.sqrt(floor**2 + e_out**2 + e_fit**2 + (0.5 if cal.rows < 4 else 0.0) ** 2))
    )
