"""Running a job: Parquet rows → prompts → prefix-grouped engine → Parquet parts, resumable.

``run_job(config)`` does, in order:

1. *Plan* (:mod:`batchgen.job.plan`, no model yet) and open the output directory (lock, clean, check). Any
   problem here is a :class:`~batchgen.errors.ConfigError` → exit status 2, before any work.
2. If the manifest already lists every window: nothing to do (exit 0).
3. Start the engine; stream the unfinished windows through prompts → grouping → engine
   (:class:`~batchgen.job.feeder.EngineFeeder`); each window whose rows are all finished becomes one part
   file, committed atomically, then recorded in the manifest.
4. Write ``report.json``, print the summary table.

Signals (:mod:`batchgen.job.signals`): SIGINT, SIGTERM and SIGUSR1 stop admission; windows already started are
finished for up to ``run.stop_grace_s`` seconds (default 0: abandoned at once), finished windows are already
on disk, and the job returns exit status 75 (EX_TEMPFAIL: rerun the same command to resume). A second SIGINT
aborts at once (still 75; the manifest is consistent at every instant).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import batchgen
from batchgen.data.manifest import Manifest, WindowRecord
from batchgen.data.output_dir import OutputDir
from batchgen.data.parts import build_part
from batchgen.data.prompts import build_prompts
from batchgen.data.reader import WindowSpec, iter_windows
from batchgen.engine.interface import Engine
from batchgen.errors import ConfigError
from batchgen.job.config import to_job_config
from batchgen.job.feeder import EngineFeeder, WindowWork
from batchgen.job.plan import JobPlan, fresh_manifest, plan_job
from batchgen.job.progress import Progress
from batchgen.job.report import build_report, format_table, write_report
from batchgen.job.signals import StopSignal

logger = logging.getLogger("batchgen.job")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: incomplete, rerun to resume


@dataclass
class JobResult:
    """What a job run ended with; ``exit_code`` is the CLI's exit status."""

    exit_code: int
    status: str  # "complete" | "incomplete" | "error"
    output_dir: str
    report_path: str | None = None
    report: dict[str, Any] | None = None
    message: str = ""


def run_job(
    cfg: Any,
    *,
    engine: Engine | None = None,
    stop: StopSignal | None = None,
    handle_signals: bool = True,
    print_summary: bool = True,
) -> JobResult:
    """Run the job described by `cfg` (a JobConfig or a composed DictConfig).

    `engine` (optional) is an already started engine to use instead of building one (tests, benchmarks).
    Returns a JobResult; configuration/input problems are returned as exit code 2 with the message, not raised.
    """
    t_start = time.monotonic()
    out_dir = "?"
    try:
        job = to_job_config(cfg)
        out_dir = job.data.output
        plan = plan_job(job)
        outdir = OutputDir(job.data.output, job.data.shard.index, job.data.shard.count)
        out_dir = str(outdir.path)
        manifest = outdir.open(fresh_manifest(plan), overwrite=job.data.overwrite)
    except ConfigError as e:
        return _config_error(e, out_dir)

    stop = stop or StopSignal(job.run.stop_grace_s)
    with outdir, stop.installed() if handle_signals else contextlib.nullcontext(stop):
        if manifest.complete:
            return _nothing_to_do(plan, outdir, manifest, print_summary)
        try:
            return _execute(plan, outdir, manifest, engine, stop, t_start, print_summary)
        except ConfigError as e:
            return _config_error(e, out_dir)
        except KeyboardInterrupt:
            msg = f"aborted; finished windows are saved in {out_dir}: rerun the same command to resume"
            logger.warning(msg)
            return JobResult(EXIT_INTERRUPTED, "incomplete", out_dir, message=msg)


def _config_error(e: ConfigError, out_dir: str) -> JobResult:
    logger.error("%s", e)
    return JobResult(EXIT_CONFIG, "error", out_dir, message=str(e))


def _nothing_to_do(plan: JobPlan, outdir: OutputDir, manifest: Manifest, print_summary: bool) -> JobResult:
    d = plan.cfg.data
    if manifest.num_windows == 0:
        msg = f"nothing to do: shard {d.shard.index}/{d.shard.count} of the input has no rows"
    else:
        msg = (
            f"nothing to do: {outdir.path} already holds the complete output ({manifest.num_windows} windows)"
        )
    logger.info(msg)
    if print_summary:
        print(msg)
    rp = outdir.report_path
    return JobResult(EXIT_OK, "complete", str(outdir.path), str(rp) if rp.is_file() else None, message=msg)


def _execute(
    plan: JobPlan,
    outdir: OutputDir,
    manifest: Manifest,
    engine: Engine | None,
    stop: StopSignal,
    t_start: float,
    print_summary: bool,
) -> JobResult:
    """Steps 3 and 4 of the module docstring, for the windows the manifest does not list yet."""
    todo = [w for w in plan.windows if w.index not in manifest.windows]
    _log_start(plan, outdir, todo)
    if engine is None:
        engine = _start_engine(plan)
    _require_chat_template(plan, engine.tokenizer)
    plan.prompt_spec.max_model_len = engine.max_model_len
    before = engine.stats.snapshot()

    t_run = time.monotonic()
    rows_before = sum(r.row_end - r.row_start for r in manifest.windows.values())
    progress = Progress(
        total=plan.row_end - plan.row_start,
        initial=rows_before,
        mode=plan.cfg.run.progress,
        interval_s=plan.cfg.run.log_interval_s,
    )
    try:
        if plan.cfg.task == "score":  # batchgen.job.score: log-likelihoods instead of generations
            from batchgen.job.score import run_score_windows

            windows_done, rows_done = run_score_windows(plan, outdir, engine, todo, stop, progress)
        else:
            feeder = _feeder(plan, engine, todo, stop, progress)
            windows_done, rows_done = _commit_windows(plan, outdir, feeder)
    finally:
        progress.close()
    wall = time.monotonic() - t_run

    status = "complete" if manifest.complete else "incomplete"
    report = build_report(
        status=status,
        output_dir=str(outdir.path),
        manifest=manifest,
        wall_time_s=wall,
        rows_this_run=rows_done,
        windows_this_run=windows_done,
        engine_stats=engine.stats.delta(before),
        model=plan.cfg.model.path or "tiny-default",
        extra={
            "startup_s": round(t_run - t_start, 3),
            "interrupted_by": stop.signal_name,
            "shard": manifest.shard,
            "batchgen_version": batchgen.__version__,
        },
    )
    write_report(outdir.report_path, report)
    return _finish(plan, outdir, manifest, stop, report, print_summary)


def _log_start(plan: JobPlan, outdir: OutputDir, todo: list[WindowSpec]) -> None:
    d = plan.cfg.data
    logger.info(
        "input: %d file(s), %d rows; shard %d/%d = rows [%d, %d); %d window(s) of %d rows, %d to do; output: %s",
        len(plan.input.files), plan.input.num_rows, d.shard.index, d.shard.count,
        plan.row_start, plan.row_end, len(plan.windows), d.window_rows, len(todo), outdir.path,
    )  # fmt: skip


def _start_engine(plan: JobPlan) -> Engine:
    """The engine for the plan's checkpoint; a chat job fails fast, before the weights load, without a chat
    template. The engine's own ValueError/FileNotFoundError (bad checkpoint, no room) becomes a ConfigError."""
    from batchgen.engine.llm_engine import LLMEngine

    if plan.cfg.data.messages_column:
        from batchgen.models.loader import load_tokenizer

        _require_chat_template(plan, load_tokenizer(plan.model_path))
    try:
        return LLMEngine(plan.model_path, plan.cfg.engine, dtype=plan.cfg.model.dtype)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"cannot start the engine: {e}") from e


def _require_chat_template(plan: JobPlan, tokenizer: Any) -> None:
    if plan.cfg.data.messages_column and tokenizer.chat_template is None:
        raise ConfigError(
            f"data.messages_column is set but the tokenizer of {plan.model_path!r} has no chat template"
        )


def _window_source(
    plan: JobPlan, tokenizer: Any, todo: list[WindowSpec], progress: Progress
) -> Callable[[], WindowWork | None]:
    """The feeder's ``next_window``: read the next unfinished window, turn its rows into prompts, group them.
    Error rows need no engine work: they count as finished at once."""
    windows = iter_windows(plan.input, todo, plan.columns)
    kept = [f.name for f in plan.part_layout.kept]

    def next_window() -> WindowWork | None:
        w = next(windows, None)
        if w is None:
            return None
        rows = build_prompts(w.table, w.spec.row_start, plan.prompt_spec, tokenizer)
        work = WindowWork.create(
            w.spec, rows, plan.cfg.data.group_by_prefix, extra=w.table.select(kept) if kept else None
        )
        errors = sum(1 for r in rows if not r.ok)
        if errors:
            progress.update(errors)
        return work

    return next_window


def _feeder(
    plan: JobPlan, engine: Engine, todo: list[WindowSpec], stop: StopSignal, progress: Progress
) -> EngineFeeder:
    """The feed loop over the unfinished windows, keeping about two steps' worth of sequences in flight."""
    max_in_flight = max(1, 2 * plan.cfg.engine.max_num_seqs // plan.cfg.sampling.n)
    return EngineFeeder(
        engine,
        _window_source(plan, engine.tokenizer, todo, progress),
        max_in_flight,
        stop,
        on_output=lambda work, pos, out: progress.update(1),
        on_step=lambda: progress.update(0, stats=engine.stats),
    )


def _commit_windows(plan: JobPlan, outdir: OutputDir, feeder: EngineFeeder) -> tuple[int, int]:
    """Write each window the feeder finishes as a part and record it; returns (windows, rows) done."""
    windows = rows = 0
    for work in feeder.run():
        spec = work.spec
        window_meta = {"index": spec.index, "row_start": spec.row_start, "row_end": spec.row_end}
        table, st = build_part(plan.part_layout, work.rows, work.results, work.extra, window_meta)
        record = WindowRecord(
            part="",
            row_start=spec.row_start,
            row_end=spec.row_end,
            num_output_rows=st.num_output_rows,
            rows_ok=st.rows_ok,
            rows_error=st.rows_error,
            prompt_tokens=st.prompt_tokens,
            cached_tokens=st.cached_tokens,
            generated_tokens=st.generated_tokens,
            wall_time_s=round(work.finished_at - work.started_at, 3),
        )
        outdir.commit(spec.index, table, record)
        windows += 1
        rows += spec.num_rows
    return windows, rows


def _finish(
    plan: JobPlan,
    outdir: OutputDir,
    manifest: Manifest,
    stop: StopSignal,
    report: dict[str, Any],
    print_summary: bool,
) -> JobResult:
    """The result (exit 0 when complete, 75 when stopped early), logged and printed with the summary table."""
    if manifest.complete:
        msg = f"done: {len(plan.windows)} part(s) in {outdir.path}; report: {outdir.report_path}"
        code, status = EXIT_OK, "complete"
    else:
        left = manifest.num_windows - len(manifest.windows)
        why = f"stopped by {stop.signal_name}" if stop.signal_name else "stopped"
        msg = (
            f"incomplete ({why}): {len(manifest.windows)}/{manifest.num_windows} windows saved in {outdir.path}, "
            f"{left} left; rerun the same command to resume (exit status {EXIT_INTERRUPTED})"
        )
        code, status = EXIT_INTERRUPTED, "incomplete"
    logger.info(msg)
    if print_summary:
        print(format_table(report))
        print(msg)
    return JobResult(code, status, str(outdir.path), str(outdir.report_path), report, msg)
