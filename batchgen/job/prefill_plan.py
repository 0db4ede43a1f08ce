"""The dry run of the jobs that only read their prompts: pooling (``task=embed`` / ``task=classify``) and
scoring (``task=score``), with ``run.dry_run=true``.

The rows are read and checked exactly as the job does it (:mod:`batchgen.job.pool`, :mod:`batchgen.job.score`;
every window of the shard, or an even sample of whole windows with ``plan.sample_rows``), reduced by the
generation dry run's :class:`~batchgen.job.dry_run.PlanInput`: rows and error rows by reason, prompt tokens
(total and percentiles; a scored row's context and continuation, or its rolling windows), and on the paged
engine (a decoder's pooling, scoring) the prefix cache simulated over the order the job feeds each window's
rows (their tokens sorted; per adapter when scoring under adapters): the predicted ``tokens.prefix_hit_rate``.
An encoder computes every token.

**Calibration.** The job's own model runs a proportional stratified sample of the rows (by prompt length and
prefix group, :func:`~batchgen.job.calibrate.strata_order`) in chunks the size of the batches the job runs, each
chunk timed, after an untimed warm-up; on the paged engine a quarter of each of the first chunks runs again, its
prefixes cached (the same requests computing fewer tokens). It stops once its time reaches
``plan.calibration_fraction`` of the job's time predicted so far (after at least :data:`MIN_CHUNKS` chunks), or
the sample is spent. A cost per request and one per computed prompt token, fitted to the chunks
(:meth:`PrefillCalibration.fit`; without the second runs, all per token: the sample's lengths mix as the job's),
price the job's requests and its tokens to compute after sharing; reading and tokenizing the input (measured by
this dry run, and serial with the compute in these jobs) is added. The range: the fit's residual over the
chunks, the machine's load at calibration and a floor, widened for a sample of few chunks.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from batchgen.job.calibrate import CalibrationRow, compute_threads, load_average, load_spread, strata_order

logger = logging.getLogger("batchgen.job")

MIN_CHUNKS = 2
"""Chunks the calibration always times (unless the sample runs out first): the least a spread needs."""
AGAIN_SHARE = 4
"""A chunk run again (its prefixes cached) is this fraction of it: ``1 / AGAIN_SHARE`` of its rows."""
FULL_SAMPLE_CHUNKS = 8
"""Chunks from which the sample's size no longer widens the range."""
SCORED_KEY_BASE = -(1 << 48)
"""The first of the ids that key a scored continuation's tokens in the prefix-cache simulation (negative, so
never a vocabulary id; below any image key)."""
RANGE_FLOOR = 0.2
"""The range's least relative half-width: what the calibration cannot see (the extrapolation to the whole job,
per-window costs)."""


@dataclass
class PrefillTask:
    """What the dry run needs of a prompt-only job's model: how the job turns a window into rows, and how it
    computes some of them.

    ``window_rows(table, row_start)`` -> each row of the window as a
    :class:`~batchgen.job.dry_run.PlanRow` (tokens, or its error) and the positions the job feeds, in its
    order; ``run(rows)`` computes calibration rows as the job would (their ``params`` hold what the task
    needs of each); ``computed()`` the prompt tokens the engine has computed so far (None: the model
    computes every token); ``tokenizer`` for the sharing analysis; ``max_model_len``, ``device``;
    ``prefix_caching``: the model runs on the paged engine with its prefix cache on."""

    window_rows: Callable[[Any, int], tuple[list[Any], list[int]]]
    run: Callable[[list[CalibrationRow]], None]
    computed: Callable[[], int | None]
    tokenizer: Any
    max_model_len: int
    device: str
    prefix_caching: bool
    batch_rows: Callable[[float], int]
    """Rows per calibration chunk for rows computing this many tokens each (after sharing): a batch the job runs
    at full width."""
    requests: Callable[[CalibrationRow], int] = lambda row: 1  # noqa: E731
    """The model's requests for a row (scoring: one per token pair, several for a long text's rolling windows)."""
    scored: Callable[[CalibrationRow], int] = lambda row: 0  # noqa: E731
    """The row's tokens whose logits are scored (scoring: its continuations' tokens)."""
    look_at_threads: Callable[[], None] = lambda: None  # noqa: E731
    """Take the engine's CPU thread decision afresh (:meth:`LLMEngine.look_at_threads`; no-op without a paged
    engine): the calibration runs after the whole input was read."""


WORK_TERMS = ("requests", "computed_tokens", "scored_tokens")
"""What a chunk of rows costs: its requests, the prompt tokens the model computes (after prefix sharing), and the
tokens whose logits it scores (a scoring job's continuations: each a row of the vocabulary's log-softmax)."""


@dataclass
class PrefillCalibration:
    """What running a sample of the rows measured: per timed chunk its work (:data:`WORK_TERMS`) and seconds,
    and on the paged engine a part of the first chunks again (``again``: its prefixes now cached, the same
    requests and scored tokens with fewer computed tokens). A cost per unit of each term (:meth:`fit`) is
    fitted to all of them: a job whose rows share more (or less) than the sample's still gets each cost right
    (the requests of a job that shares a long context compute few tokens each, most of them scored)."""

    chunks: list[tuple[tuple[float, ...], float]] = field(default_factory=list)
    again: list[tuple[tuple[float, ...], float]] = field(default_factory=list)
    rows: int = 0
    warmup_seconds: float = 0.0
    seconds: float = 0.0
    """The calibration's whole wall time, the warm-up included."""
    budget: float = 0.0
    load: float | None = None
    note: str | None = None

    def fit(self) -> tuple[float, ...]:
        """Seconds per unit of each :data:`WORK_TERMS` term: least squares over every timed chunk, non-negative
        (a term the chunks do not vary, or whose cost fits negative, is dropped and the rest refitted); with
        too few chunks to tell the terms apart, all of it per computed token (the ratio over the sample)."""
        points = [(w, s) for w, s in (*self.chunks, *self.again) if s > 0]
        tokens = sum(w[1] for w, _ in points)
        ratio = (0.0, sum(s for _, s in points) / tokens if tokens else 0.0, 0.0)
        if not self.again or len(points) < 3:
            return ratio
        x = np.array([w for w, _ in points], dtype=float)
        y = np.array([s for _, s in points])
        keep = [k for k in range(x.shape[1]) if np.any(x[:, k] > 0)]
        while keep:
            if len(keep) >= len(points):  # as many terms as chunks: the request term goes first
                keep.pop(0)
                continue
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if all(v >= 0 for v in sol):
                coef = [0.0] * x.shape[1]
                for k, v in zip(keep, sol):
                    coef[k] = float(v)
                return tuple(coef) if coef[1] > 0 or coef[2] > 0 else ratio
            keep.pop(int(np.argmin(sol)))
        return ratio

    def seconds_for(self, work: tuple[float, ...]) -> float:
        """Predicted seconds for ``work`` (:data:`WORK_TERMS`)."""
        return sum(c * w for c, w in zip(self.fit(), work))

    def spread(self) -> float:
        """The range's relative half-width (module docstring): the fit's relative residual over the chunks, a
        small sample's, the load's, and a floor."""
        points = [(w, s) for w, s in (*self.chunks, *self.again) if s > 0]
        rel = [(s - self.seconds_for(w)) / s for w, s in points]
        e_fit = math.sqrt(sum(e * e for e in rel) / len(rel)) / math.sqrt(len(rel)) if len(rel) > 1 else 0.3
        e_few = 0.25 * max(0.0, 1.0 - len(self.chunks) / FULL_SAMPLE_CHUNKS)
        terms = (RANGE_FLOOR, e_fit, e_few, load_spread(self.load))
        return min(0.8, math.sqrt(sum(x * x for x in terms)))


def batch_rows(max_num_seqs: int, max_num_batched_tokens: int) -> Callable[[float], int]:
    """Rows per calibration chunk: the engine's ``max_num_seqs`` rows, or fewer rows that fill
    ``max_num_batched_tokens`` twice; at least 4."""

    def rows(mean_tokens: float) -> int:
        by_tokens = math.ceil(2 * max_num_batched_tokens / max(1.0, mean_tokens))
        return max(4, min(max_num_seqs, by_tokens))

    return rows


def calibrate(
    task: PrefillTask, rows: list[CalibrationRow], work: tuple[float, ...], fraction: float
) -> PrefillCalibration:
    """Run ``rows`` (proportionally stratified in :func:`strata_order`'s order) chunk by chunk (on the paged
    engine a quarter of each of the first chunks again, its prefixes cached) until the time spent reaches
    ``fraction`` of the job's predicted time (its ``work``, :data:`WORK_TERMS`, at the costs measured so far),
    after :data:`MIN_CHUNKS` chunks, or the rows run out."""
    cal = PrefillCalibration()
    if not rows:
        return cal
    task.look_at_threads()  # the count the engine took when built may be stale: decided again, untimed
    t_start = time.perf_counter()
    order = strata_order(rows)
    task.run(order[:1])  # untimed: lazy initialisation
    cal.warmup_seconds = time.perf_counter() - t_start
    # the job's batches are as wide as the tokens its rows compute after sharing (a cached context is not in
    # them): so are the chunks
    size = task.batch_rows(work[1] / max(1.0, work[0]))

    def timed(chunk: list[CalibrationRow]) -> tuple[tuple[float, ...], float]:
        before = task.computed()
        t0 = time.perf_counter()
        task.run(chunk)
        dt = time.perf_counter() - t0
        after = task.computed()
        known = before is not None and after is not None
        computed = after - before if known else sum(len(r.token_ids) for r in chunk)  # type: ignore[operator]
        return (sum(task.requests(r) for r in chunk), computed, sum(task.scored(r) for r in chunk)), dt

    for i in range(0, len(order), size):
        chunk = order[i : i + size]
        cal.rows += len(chunk)
        cal.chunks.append(timed(chunk))
        if task.prefix_caching and len(cal.again) < MIN_CHUNKS:
            # a quarter of it again, its prefixes cached: fewer tokens for the same requests (what separates
            # the per-request cost from the per-token one; the first chunks' are enough)
            cal.again.append(timed(chunk[: max(4, len(chunk) // AGAIN_SHARE)]))
        cal.seconds = time.perf_counter() - t_start
        cal.budget = fraction * cal.seconds_for(work)
        dt = cal.chunks[-1][1]
        if len(cal.chunks) >= MIN_CHUNKS and cal.seconds + dt >= cal.budget:
            break
    cal.seconds = time.perf_counter() - t_start
    if cal.seconds > cal.budget and len(cal.chunks) <= MIN_CHUNKS and cal.rows < len(order):
        cal.note = (f"its floor ({MIN_CHUNKS} chunks of {size} rows) took {cal.seconds:.2f} s, over the budget of "
                    f"{cal.budget:.2f} s: a job this short cannot buy a larger sample, the range is widened instead")  # fmt: skip
    cal.load = load_average()
    return cal


def read_rows(plan: Any, task: PrefillTask, left: Any = None) -> tuple[Any, float]:
    """This shard's rows read and checked as the job does (``task.window_rows``), into a
    :class:`~batchgen.job.dry_run.PlanInput` fed in the job's order; and the seconds of pyarrow's one-time
    set-up (it imports pandas on its first array), which the job pays in its first window's commit. ``left``
    (a :class:`~batchgen.job.dry_run.WorkLeft`): only the rows a resumed run has left to do."""
    import pyarrow as pa

    from batchgen.data.reader import iter_windows
    from batchgen.job.dry_run import KEEP_ROWS, PlanInput, _sample_windows, shard_facts

    cfg, d = plan.cfg, plan.cfg.data
    specs = list(plan.windows) if left is None else list(left.specs)
    skip = {} if left is None else left.skip
    chosen = [
        specs[i] for i in _sample_windows(len(specs), [w.num_rows for w in specs], cfg.plan.sample_rows)
    ]
    inp = PlanInput(
        rows_total=plan.row_end - plan.row_start if left is None else left.rows,
        block_size=cfg.engine.block_size,
        max_model_len=task.max_model_len,
        num_blocks=None,
        prompt_column=d.prompt_column,
        prefix_caching=task.prefix_caching,
        replicas=1,
        shard=shard_facts(plan, len(specs)),
        keep_every=max(1, sum(w.num_rows for w in chosen) // KEEP_ROWS),
    )
    t_setup = time.perf_counter()
    pa.array([0])
    setup_s = time.perf_counter() - t_setup
    t0 = time.perf_counter()
    for win in iter_windows(plan.input, chosen, plan.columns):
        rows, feed = task.window_rows(win.table, win.spec.row_start)
        done = skip.get(win.spec.index, frozenset())
        inp.add_window(rows, [i for i in feed if i not in done], done)
    inp.read_seconds = time.perf_counter() - t0
    return inp, setup_s


def _row_ids(table: Any, id_column: str | None, row_start: int) -> list[Any]:
    """The output's ``id`` of each row of the window: ``id_column``'s values, else the rows' input positions."""
    if id_column:
        return table.column(id_column).to_pylist()
    return list(range(row_start, row_start + table.num_rows))


def build_plan(plan: Any, task: PrefillTask, inp: Any, setup_s: float = 0.0) -> dict[str, Any]:
    """The plan's dict (``_plan.json``) of a prompt-only job over ``inp``, calibrated by ``task`` unless
    ``plan.calibrate=false``; ``setup_s``: one-time costs the job pays within its wall time."""
    from batchgen.job.dry_run import _percentiles, _strata, _weights_bytes, checkpoint_dtype, sharing_analysis

    cfg = plan.cfg
    pc = cfg.plan
    scale = inp.rows_total / inp.rows_read if inp.rows_read else 1.0
    lens = list(inp.lens)
    n_err = sum(e["rows"] for e in inp.errors.values())
    to_compute = sum(lens) * scale - inp.weighted(inp.saved)
    data: dict[str, Any] = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "task": cfg.task,
        "model": cfg.model.path,
        "shard": inp.shard,
        "rows": {
            "total": inp.rows_total,
            "sampled": inp.rows_read,
            "valid": round(len(lens) * scale),
            "error": round(n_err * scale),
        },  # fmt: skip
        "errors": dict(sorted(inp.errors.items(), key=lambda kv: -kv[1]["rows"])),
        "prompt_tokens": {"total": round(sum(lens) * scale), **_percentiles(lens)},
        "sharing": sharing_analysis(inp, task.tokenizer, inp.hit_rate, inp.first)
        if inp.prefix_caching
        else {},
        "read_seconds": round(inp.read_seconds, 3),
    }
    predicted: dict[str, Any] = {
        "prefix_hit_rate": inp.hit_rate,
        "prompt_tokens": round(sum(lens) * scale),
        "prompt_tokens_to_compute": round(to_compute),
    }
    data["predicted"] = predicted
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else checkpoint_dtype(plan.model_path)
    data["memory"] = {"weights_bytes": _weights_bytes(plan.model_path, dtype)}
    if not lens:  # no row reaches the model: no work to time
        predicted.update(wall_time_s=0.0, wall_time_range_s=[0.0, 0.0], device_hours=0.0,
                         cost=0.0 if pc.cost_per_hour is not None else None)  # fmt: skip
        return data
    if not pc.calibrate:
        predicted["wall_time_s"] = predicted["wall_time_range_s"] = None
        return data
    strata = _strata(lens, list(inp.heads))
    candidates = [CalibrationRow(i, r.token_ids, r.params, strata[i], r.lora) for i, r in inp.kept.items()]
    rows = len(lens) * scale  # the job's requests and scored tokens, from the kept rows' means
    mean = (lambda f: statistics.mean(f(r) for r in candidates)) if candidates else (lambda f: 0.0)  # noqa: E731
    work = (rows * mean(task.requests), to_compute, rows * mean(task.scored))
    cal = calibrate(task, candidates[: pc.calibration_rows], work, pc.calibration_fraction)
    # reading and tokenizing run between the windows' compute in the job (serial, on the same cores)
    reading = inp.read_seconds * scale + setup_s
    wall = cal.seconds_for(work) + reading
    e = cal.spread()
    predicted["wall_time_s"] = wall
    predicted["wall_time_range_s"] = [wall * (1 - e), wall * (1 + e)]
    predicted["device_hours"] = wall * max(1, cfg.engine.tensor_parallel_size) / 3600.0
    predicted["cost"] = predicted["device_hours"] * pc.cost_per_hour if pc.cost_per_hour is not None else None
    data["calibration"] = {
        "rows": cal.rows,
        "chunks": len(cal.chunks),
        "seconds": round(cal.seconds, 3),
        "warmup_seconds": round(cal.warmup_seconds, 3),
        "fraction_of_predicted": cal.seconds / wall if wall > 0 else None,
        "budget_fraction": pc.calibration_fraction,
        "budget_s": round(cal.budget, 3),
        "device": task.device,
        "seconds_per": dict(zip(WORK_TERMS, cal.fit())),
        "load": cal.load,
        "cpus": os.cpu_count(),
        "threads": compute_threads(),
        "relative_spread": e,
        "note": cal.note,
    }
    return data


def _engine_tokens(engine: Any) -> Callable[[], int]:
    return lambda: int(engine.stats.prompt_tokens_computed)


# ----------------------------------------------------------------------------------------------- pooling
def pooling_task(plan: Any, runner: Any, spec: Any) -> PrefillTask:
    """A pooling job's rows (:func:`batchgen.job.pool.texts_to_tokens`) on its :class:`PoolingRunner`."""
    from batchgen.job.dry_run import PlanRow
    from batchgen.job.pool import texts_to_tokens

    d, e = plan.cfg.data, plan.cfg.engine
    engine = (
        runner.engine
    )  # a decoder pools on the paged engine, in token order (rows sharing a prefix together)

    def window_rows(table: Any, row_start: int) -> tuple[list[Any], list[int]]:
        texts = table.column(d.prompt_column).to_pylist()
        tokens, why = texts_to_tokens(runner, texts, d.prompt_column)
        ids = _row_ids(table, d.id_column, row_start)
        rows = [PlanRow(row_start + i, ids[i], None if w else t, None, w, source=x)
                for i, (t, w, x) in enumerate(zip(tokens, why, texts))]  # fmt: skip
        feed = [i for i, r in enumerate(rows) if r.error is None]
        if engine is not None:
            feed.sort(key=lambda i: rows[i].token_ids)  # type: ignore[arg-type,return-value]
        return rows, feed

    enc = getattr(runner, "encoder", None)
    return PrefillTask(
        window_rows=window_rows,
        run=lambda rows: runner.run([r.token_ids for r in rows], spec),
        computed=_engine_tokens(engine) if engine is not None else lambda: None,
        tokenizer=runner.tokenizer,
        max_model_len=runner.max_model_len,
        device=str(engine.device if engine is not None else getattr(enc, "device", "cpu")),
        prefix_caching=engine is not None and e.enable_prefix_caching,
        batch_rows=batch_rows(e.max_num_seqs, e.max_num_batched_tokens),
        look_at_threads=engine.look_at_threads if engine is not None else lambda: None,
    )


def plan_pooling_job(plan: Any, t_start: float | None = None, left: Any = None) -> dict[str, Any]:
    """``run.dry_run=true`` for ``task=embed`` / ``task=classify``: the plan's dict (module docstring). The
    checkpoint is loaded (its tokenizer and limits are the job's; the calibration pools with it). ``t_start``:
    when the job began opening (``time.monotonic()``), for the start-up the job will pay; ``left``: what a
    resumed run has left to do (None: the whole shard)."""
    from batchgen.errors import ConfigError
    from batchgen.job.pool import start_runner
    from batchgen.pooling.params import PoolingParams

    t0 = time.monotonic()
    runner = start_runner(plan)
    startup_s = time.monotonic() - (t0 if t_start is None else t_start)  # opening the job, loading the model
    p = plan.cfg.pooling
    try:
        spec = runner.spec(PoolingParams(p.method, p.normalize, p.dimensions))
    except ValueError as e:
        raise ConfigError(f"pooling: {e}") from e
    data = _plan(plan, pooling_task(plan, runner, spec), left)
    data["predicted"]["startup_s"] = startup_s  # the checkpoint's loading, which the job pays before its work
    return data


# ----------------------------------------------------------------------------------------------- scoring
def scoring_task(plan: Any, engine: Any) -> PrefillTask:
    """A scoring job's rows (:func:`batchgen.job.score.window_pairs`: each row its pairs' tokens together) on
    its engine."""
    from batchgen.job.dry_run import PlanRow
    from batchgen.job.score import window_pairs
    from batchgen.scoring import score_token_pairs

    d, e = plan.cfg.data, plan.cfg.engine
    # a scored continuation is never served from the prefix cache (its positions' logits are computed):
    # keyed by ids no other token has, only a row's contexts can share
    unique = itertools.count(SCORED_KEY_BASE, -1)

    def window_rows(table: Any, row_start: int) -> tuple[list[Any], list[int]]:
        w = window_pairs(plan, engine, table)
        ids = _row_ids(table, d.id_column, row_start)
        texts = table.column(d.prompt_column).to_pylist()
        mine: dict[int, list[int]] = {}
        for k, i in enumerate(w.owner):
            mine.setdefault(i, []).append(k)
        rows = []
        for i, why in enumerate(w.error):
            pairs = [w.pairs[k] for k in mine.get(i, [])]
            tokens = [t for c, x in pairs for t in (*c, *x)] if why is None else None
            keyed = [t for c, x in pairs for t in (*c, *(next(unique) for _ in x))] if why is None else None
            lora = w.loras[mine[i][0]] if i in mine else None
            rows.append(PlanRow(row_start + i, ids[i], tokens, pairs, why, lora, texts[i], cache_ids=keyed))
        # the engine runs a window's pairs sorted by (adapter, tokens): rows sharing a context side by side
        feed = [i for i, r in enumerate(rows) if r.error is None]
        feed.sort(key=lambda i: (rows[i].lora.lora_int_id if rows[i].lora else 0, rows[i].token_ids))
        return rows, feed

    def run(rows: list[CalibrationRow]) -> None:
        pairs = [(p, r.lora) for r in rows for p in r.params]
        score_token_pairs(engine, [p for p, _ in pairs], loras=[lora for _, lora in pairs])

    return PrefillTask(
        window_rows=window_rows,
        run=run,
        computed=_engine_tokens(engine),
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        device=str(engine.device),
        prefix_caching=e.enable_prefix_caching,
        batch_rows=batch_rows(e.max_num_seqs, e.max_num_batched_tokens),
        requests=lambda row: len(row.params),
        scored=lambda row: sum(len(x) for _, x in row.params),
        look_at_threads=engine.look_at_threads,
    )


def plan_scoring_job(
    plan: Any, engine: Any, t_start: float | None = None, left: Any = None
) -> dict[str, Any]:
    """``run.dry_run=true`` for ``task=score``: the plan's dict (module docstring) on the job's engine (started
    here when none is given: the rows' checks need its tokenizer and adapters); ``t_start`` and ``left`` as for
    pooling."""
    from batchgen.job.run import _start_engine

    startup_s = None
    if engine is None:
        t0 = time.monotonic()
        engine = _start_engine(plan)
        startup_s = time.monotonic() - (t0 if t_start is None else t_start)  # opening the job, the engine
    data = _plan(plan, scoring_task(plan, engine), left)
    data["predicted"]["startup_s"] = startup_s
    return data


def _plan(plan: Any, task: PrefillTask, left: Any = None) -> dict[str, Any]:
    inp, setup_s = read_rows(plan, task, left)
    logger.info("dry run: read and tokenized %d of %d rows in %.1f s", inp.rows_read, inp.rows_total,
                inp.read_seconds)  # fmt: skip
    return build_plan(plan, task, inp, setup_s)
