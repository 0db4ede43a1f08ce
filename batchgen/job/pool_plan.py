"""The dry run of a pooling job (``task=embed`` / ``task=classify`` with ``run.dry_run=true``).

The rows are read, tokenized and checked exactly as :mod:`batchgen.job.pool` does it (every window of the shard,
or an even sample of whole windows with ``plan.sample_rows``), reduced by the generation dry run's
:class:`~batchgen.job.dry_run.PlanInput`: rows and error rows by reason, prompt tokens (total and percentiles),
and on a decoder, whose pooling runs on the paged engine in token order, the prefix cache simulated over that
order (the predicted ``tokens.prefix_hit_rate``). An encoder computes every token.

**Calibration.** The checkpoint pools a proportional stratified sample of the rows (by prompt length and prefix
group, :func:`~batchgen.job.calibrate.strata_order`) in chunks the size of the batches the job runs, each chunk
timed, after an untimed warm-up; it stops once its time reaches ``plan.calibration_fraction`` of the job's time
predicted so far (after at least :data:`MIN_CHUNKS` chunks), or the sample is spent. Seconds per computed prompt
token over the sample (a ratio estimator: the sample's lengths mix as the job's) times the job's tokens to compute
is the predicted pooling time; reading and tokenizing the input (measured by this dry run, and serial with the
pooling in the job) is added. The range: the chunks' spread of that rate, the machine's load at calibration and a
floor, widened for a sample of few chunks.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from batchgen.job.calibrate import CalibrationRow, load_average, load_spread, strata_order

logger = logging.getLogger("batchgen.job")

MIN_CHUNKS = 2
"""Chunks the calibration always times (unless the sample runs out first): the least a spread needs."""
FULL_SAMPLE_CHUNKS = 8
"""Chunks from which the sample's size no longer widens the range."""
RANGE_FLOOR = 0.2
"""The range's least relative half-width: what the calibration cannot see (the extrapolation to the whole job,
per-window costs)."""


@dataclass
class PoolCalibration:
    """What pooling a sample of the rows measured: per timed chunk (rows, tokens computed, seconds)."""

    chunks: list[tuple[int, int, float]] = field(default_factory=list)
    warmup_seconds: float = 0.0
    seconds: float = 0.0
    """The calibration's whole wall time, the warm-up included."""
    budget: float = 0.0
    load: float | None = None
    note: str | None = None

    @property
    def rows(self) -> int:
        return sum(c[0] for c in self.chunks)

    @property
    def per_token(self) -> float:
        """Seconds per computed prompt token over the whole sample."""
        tokens = sum(c[1] for c in self.chunks)
        return sum(c[2] for c in self.chunks) / tokens if tokens else 0.0

    def spread(self) -> float:
        """The range's relative half-width (module docstring)."""
        rates = [s / t for _, t, s in self.chunks if t > 0]
        e_rate = (
            statistics.stdev(rates) / statistics.mean(rates) / math.sqrt(len(rates))
            if len(rates) > 1
            else 0.3
        )
        e_few = 0.25 * max(0.0, 1.0 - len(self.chunks) / FULL_SAMPLE_CHUNKS)
        terms = (RANGE_FLOOR, e_rate, e_few, load_spread(self.load))
        return min(0.8, math.sqrt(sum(x * x for x in terms)))


def _computed_tokens(runner: Any) -> int | None:
    """Prompt tokens the runner's engine has computed so far (a decoder); None for an encoder (all of them)."""
    engine = getattr(runner, "engine", None)
    return None if engine is None else int(engine.stats.prompt_tokens_computed)


def chunk_rows(runner: Any, mean_tokens: float) -> int:
    """Rows per calibration chunk: a batch the job runs at full width (the engine's ``max_num_seqs`` rows, or
    enough rows to fill ``max_num_batched_tokens`` twice), at least 4."""
    cfg = runner.config
    by_tokens = math.ceil(2 * cfg.max_num_batched_tokens / max(1.0, mean_tokens))
    return max(4, min(cfg.max_num_seqs, by_tokens))


def calibrate_pooling(
    runner: Any, spec: Any, rows: list[CalibrationRow], tokens_to_compute: float, fraction: float
) -> PoolCalibration:
    """Pool ``rows`` (proportionally stratified in :func:`strata_order`'s order) chunk by chunk until the time
    spent reaches ``fraction`` of the job's predicted time (``tokens_to_compute`` at the rate measured so
    far), after :data:`MIN_CHUNKS` chunks, or the rows run out."""
    cal = PoolCalibration()
    t_start = time.perf_counter()
    if not rows:
        return cal
    order = strata_order(rows)
    runner.run([order[0].token_ids[:8]], spec)  # untimed: lazy initialisation
    cal.warmup_seconds = time.perf_counter() - t_start
    size = chunk_rows(runner, statistics.mean(len(r.token_ids) for r in order))
    for i in range(0, len(order), size):
        chunk = order[i : i + size]
        before = _computed_tokens(runner)
        t0 = time.perf_counter()
        runner.run([r.token_ids for r in chunk], spec)
        dt = time.perf_counter() - t0
        after = _computed_tokens(runner)
        computed = (
            after - before
            if before is not None and after is not None
            else sum(len(r.token_ids) for r in chunk)
        )
        cal.chunks.append((len(chunk), computed, dt))
        cal.seconds = time.perf_counter() - t_start
        cal.budget = fraction * cal.per_token * tokens_to_compute
        if len(cal.chunks) >= MIN_CHUNKS and cal.seconds + dt >= cal.budget:
            break
    cal.seconds = time.perf_counter() - t_start
    if cal.seconds > cal.budget and len(cal.chunks) <= MIN_CHUNKS and cal.rows < len(order):
        cal.note = (f"its floor ({MIN_CHUNKS} chunks of {size} rows) took {cal.seconds:.2f} s, over the budget of "
                    f"{cal.budget:.2f} s: a job this short cannot buy a larger sample, the range is widened instead")  # fmt: skip
    cal.load = load_average()
    return cal


def read_pool_rows(plan: Any, runner: Any) -> Any:
    """This shard's rows read, tokenized and checked as :func:`batchgen.job.pool.run_pool_windows` does, into a
    :class:`~batchgen.job.dry_run.PlanInput` (fed in the order the pooling runs them)."""
    import pyarrow as pa

    from batchgen.data.reader import iter_windows
    from batchgen.job.dry_run import KEEP_ROWS, PlanInput, PlanRow, _sample_windows

    cfg, d = plan.cfg, plan.cfg.data
    specs = list(plan.windows)
    chosen = [
        specs[i] for i in _sample_windows(len(specs), [w.num_rows for w in specs], cfg.plan.sample_rows)
    ]
    decoder = getattr(runner, "engine", None) is not None
    inp = PlanInput(
        rows_total=plan.row_end - plan.row_start,
        block_size=cfg.engine.block_size,
        max_model_len=runner.max_model_len,
        num_blocks=None,
        prompt_column=d.prompt_column,
        prefix_caching=decoder and cfg.engine.enable_prefix_caching,
        replicas=1,
        shard={
            "index": d.shard.index,
            "count": d.shard.count,
            "row_start": plan.row_start,
            "row_end": plan.row_end,
            "windows": len(specs),
        },  # fmt: skip
        keep_every=max(1, sum(w.num_rows for w in chosen) // KEEP_ROWS),
    )
    pa.array([0])  # pyarrow's one-time set-up (it imports pandas), which the job pays before its work starts
    t0 = time.perf_counter()
    for win in iter_windows(plan.input, chosen, plan.columns):
        texts = win.table.column(d.prompt_column).to_pylist()
        ids = win.table.column(d.id_column).to_pylist() if d.id_column else None
        good = [i for i, t in enumerate(texts) if isinstance(t, str) and t]
        tokens: dict[int, list[int]] = dict(zip(good, runner.tokenize([texts[i] for i in good])))
        rows = []
        for i, text in enumerate(texts):
            toks = tokens.get(i)
            why = f"{d.prompt_column} must be a non-empty string" if toks is None else runner.check(toks)
            index = win.spec.row_start + i  # the output's id without data.id_column
            rows.append(PlanRow(index, index if ids is None else ids[i], toks if why is None else None, None, why,
                                source=text))  # fmt: skip
        fed = [i for i, r in enumerate(rows) if r.error is None]
        if decoder:  # the decoder's pooling runs a window in token order (rows sharing a prefix side by side)
            fed.sort(key=lambda i: rows[i].token_ids)  # type: ignore[arg-type,return-value]
        inp.add_window(rows, fed)
    inp.read_seconds = time.perf_counter() - t0
    return inp


def build_pool_plan(plan: Any, runner: Any, inp: Any, spec: Any) -> dict[str, Any]:
    """The plan's dict (``_plan.json``) of a pooling job over ``inp``, calibrated on ``runner`` unless
    ``plan.calibrate=false``."""
    from batchgen.job.dry_run import (
        _percentiles,
        _strata,
        _weights_bytes,
        checkpoint_dtype,
        sharing_analysis,
    )

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
        "sharing": sharing_analysis(inp, runner.tokenizer, inp.hit_rate, inp.first)
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
    candidates = [CalibrationRow(i, r.token_ids, None, strata[i]) for i, r in inp.kept.items()]
    cal = calibrate_pooling(
        runner, spec, candidates[: pc.calibration_rows], to_compute, pc.calibration_fraction
    )
    # reading and tokenizing run between the windows' pooling in the job (serial, on the same cores)
    reading = inp.read_seconds * scale
    wall = cal.per_token * to_compute + reading
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
        "device": str(getattr(runner.engine, "device", None) or _encoder_device(runner)),
        "seconds_per_prompt_token": cal.per_token,
        "load": cal.load,
        "cpus": os.cpu_count(),
        "relative_spread": e,
        "note": cal.note,
    }
    return data


def _encoder_device(runner: Any) -> str:
    enc = getattr(runner, "encoder", None)
    return str(getattr(enc, "device", "cpu"))


def plan_pooling_job(plan: Any) -> dict[str, Any]:
    """``run.dry_run=true`` for ``task=embed`` / ``task=classify``: the plan's dict (module docstring). The
    checkpoint is loaded (its tokenizer and limits are the job's; the calibration pools with it)."""
    from batchgen.errors import ConfigError
    from batchgen.job.pool import start_runner
    from batchgen.pooling.params import PoolingParams

    t0 = time.perf_counter()
    runner = start_runner(plan)
    startup_s = time.perf_counter() - t0
    p = plan.cfg.pooling
    try:
        spec = runner.spec(PoolingParams(p.method, p.normalize, p.dimensions))
    except ValueError as e:
        raise ConfigError(f"pooling: {e}") from e
    inp = read_pool_rows(plan, runner)
    logger.info("dry run: read and tokenized %d of %d rows in %.1f s", inp.rows_read, inp.rows_total,
                inp.read_seconds)  # fmt: skip
    data = build_pool_plan(plan, runner, inp, spec)
    data["predicted"]["startup_s"] = startup_s  # the checkpoint's loading, which the job pays before its work
    return data
