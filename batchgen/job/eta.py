"""The live ETA of a job, from the tokens that remain rather than rows x mean seconds per row.

Work is counted in engine tokens: prompt tokens to compute (after prefix sharing) and output tokens to
generate, each at its own cost. A step's wall time is modelled as ``a * prefill_tokens + b * decode_tokens``;
``a`` and ``b`` are fitted by least squares over the steps so far (a running 2x2 normal equation), and the
ETA is ``a * prefill_left + b * decode_left``, scaled by how much slower the whole run has been than the sum
of its steps' predictions (time between steps: reading, writing, Python).

With a plan whose calibration gives seconds per prompt and per output token, the tokens left and the tokens
done are weighed by those calibrated costs and the ETA is the run's time so far scaled by their ratio: a fit
over the steps so far prices prompt tokens by the prompts seen so far (short prompts' prefill costs mostly per
sequence), which would overprice a tail of long prompts many times over.

What remains comes from the dry run's plan when one is given (``_plan.json``: the shard's prompt tokens left
after sharing and the calibrated output tokens, minus what this run has done); without a plan, from the rows
left times the tokens per row of the rows finished so far, the closest available estimate.

Invariant: the ETA is never negative; NaN until the first step of work has been timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchgen.engine.core.stats import EngineStats


@dataclass
class PlannedWork:
    """The shard's work as the dry run predicted it (``predicted.*`` of ``_plan.json``)."""

    rows: int
    prompt_tokens_to_compute: float
    output_tokens: float
    seconds_per_prefill_token: float | None = None
    seconds_per_output_token: float | None = None

    @classmethod
    def from_plan(cls, plan: dict) -> PlannedWork | None:
        """From a ``_plan.json`` dict (None when it lacks the figures)."""
        try:
            p = plan["predicted"]
            cal = plan.get("calibration") or {}
            return cls(
                rows=int(plan["rows"]["total"]),
                prompt_tokens_to_compute=float(p["prompt_tokens_to_compute"]),
                output_tokens=float(p["output_tokens"]),
                seconds_per_prefill_token=cal.get("seconds_per_prefill_token"),
                seconds_per_output_token=cal.get("seconds_per_output_token"),
            )
        except (KeyError, TypeError, ValueError):
            return None


class TokenETA:
    """Seconds left for ``rows_total`` rows (``rows_initial`` done by earlier runs), from engine stats."""

    def __init__(self, rows_total: int, rows_initial: int = 0, planned: PlannedWork | None = None) -> None:
        self.rows_total, self.rows_initial = rows_total, rows_initial
        self.planned = planned
        self._sxx = [[0.0, 0.0], [0.0, 0.0]]
        self._sxy = [0.0, 0.0]
        self._first: EngineStats | None = None
        self._last: EngineStats | None = None
        self._step_time_sum = 0.0
        self._step_tokens = 0.0
        self._elapsed = 0.0
        self._first_elapsed = 0.0

    def step(self, stats: EngineStats, dt: float, elapsed: float) -> None:
        """After engine steps taking ``dt`` seconds in all (``elapsed`` since the run's work started)."""
        snap = stats.snapshot()
        if self._first is None:
            self._first = self._last = snap
            self._elapsed = self._first_elapsed = elapsed
            return
        prev = self._last
        assert prev is not None
        p = snap.prompt_tokens_computed - prev.prompt_tokens_computed
        d = snap.generated_tokens - prev.generated_tokens
        self._last, self._elapsed = snap, elapsed
        if p + d <= 0 or dt <= 0:
            return
        x = (float(p), float(d))
        for i in range(2):
            self._sxy[i] += x[i] * dt
            for j in range(2):
                self._sxx[i][j] += x[i] * x[j]
        self._step_time_sum += dt
        self._step_tokens += p + d

    def _costs(self) -> tuple[float, float] | None:
        """(seconds per prefill token, seconds per output token): fitted, else the plan's, else one rate."""
        (a, b), (c, d) = self._sxx
        det = a * d - b * c
        if det > 1e-9 * max(a * d, 1e-30):
            ca = (self._sxy[0] * d - b * self._sxy[1]) / det
            cb = (a * self._sxy[1] - c * self._sxy[0]) / det
            if ca >= 0 and cb > 0:
                return ca, cb
        pl = self.planned
        if pl and pl.seconds_per_prefill_token is not None and pl.seconds_per_output_token:
            return pl.seconds_per_prefill_token, pl.seconds_per_output_token
        if self._step_tokens <= 0:
            return None
        rate = self._step_time_sum / self._step_tokens
        return rate, rate

    def tokens_left(self, rows_done: int) -> tuple[float, float]:
        """(prompt tokens to compute, output tokens to generate) still left."""
        first, last = self._first, self._last
        done_p = last.prompt_tokens_computed - first.prompt_tokens_computed if first and last else 0
        done_d = last.generated_tokens - first.generated_tokens if first and last else 0
        rows_left = max(0, self.rows_total - rows_done)
        pl = self.planned
        if pl is not None and pl.rows:
            # the plan covers the shard (an earlier run did rows_initial of it), or what was left of it when the
            # plan was made
            share = (self.rows_total - self.rows_initial) / pl.rows if pl.rows else 1.0
            left_p = pl.prompt_tokens_to_compute * share - done_p
            left_d = pl.output_tokens * share - done_d
            # rows are left but the plan's tokens are used up: a floor of a tenth of its mean per row left
            per_row = rows_left / pl.rows
            return (max(left_p, per_row * pl.prompt_tokens_to_compute * 0.1),
                    max(left_d, per_row * pl.output_tokens * 0.1))  # fmt: skip
        ran = rows_done - self.rows_initial
        if ran <= 0:
            return math.nan, math.nan
        return rows_left * done_p / ran, rows_left * done_d / ran

    def _paced_by_plan(self, left_p: float, left_d: float) -> float | None:
        """The run's time since its first step x (tokens left / tokens done), both weighed by the plan's
        calibrated costs; None without those costs or before any work was timed."""
        pl, first, last = self.planned, self._first, self._last
        if pl is None or pl.seconds_per_prefill_token is None or not pl.seconds_per_output_token:
            return None
        if first is None or last is None or math.isnan(left_p):
            return None
        a, b = pl.seconds_per_prefill_token, pl.seconds_per_output_token
        done = (last.prompt_tokens_computed - first.prompt_tokens_computed) * a + (
            last.generated_tokens - first.generated_tokens
        ) * b
        spent = self._elapsed - self._first_elapsed
        if done <= 0 or spent <= 0:
            return None
        return max(0.0, spent * (max(0.0, left_p) * a + max(0.0, left_d) * b) / done)

    def eta_s(self, rows_done: int) -> float:
        """Seconds until the rows are done (0 when none is left; NaN while unknown)."""
        if rows_done >= self.rows_total:
            return 0.0
        left_p, left_d = self.tokens_left(rows_done)
        paced = self._paced_by_plan(left_p, left_d)
        if paced is not None:
            return paced
        costs = self._costs()
        if costs is None or math.isnan(left_p):
            return math.nan
        predicted = max(0.0, left_p) * costs[0] + max(0.0, left_d) * costs[1]
        overhead = self._elapsed / self._step_time_sum if self._step_time_sum > 0 else 1.0
        return max(0.0, predicted * max(1.0, overhead))
