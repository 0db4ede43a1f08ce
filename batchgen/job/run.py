"""Running a job: Parquet rows → prompts → prefix-grouped engine → Parquet parts, resumable.

``run_job(config)`` does, in order:

1. *Plan* (:mod:`batchgen.job.plan`, no model yet), open the output directory (lock, clean, check; a
   directory holding no successful row of another configuration is taken over), and check that the input
   rows of every window a resume skips are unchanged (a hash per window). Any problem here is a
   :class:`~batchgen.errors.ConfigError` → exit status 2, before any work.
2. If nothing is left to do (every window finished, and no error row to retry with ``data.retry_errors``):
   exit 0 — or 3 when the output's error rows exceed ``run.max_error_fraction``.
3. *Preflight* with the tokenizer only: when the output holds no successful row yet, the first rows to do
   (up to :data:`EARLY_ROWS`) are turned into prompts; if every one of them fails (too long for
   ``engine.max_model_len``, a chat template that raises, a KV pool of ``engine.num_blocks`` too small for
   them, ...), the configuration makes the job impossible: exit 2 before the model loads.
4. Start the engine; stream the windows through prompts → grouping → engine
   (:class:`~batchgen.job.feeder.EngineFeeder`). Finished rows of unfinished windows are checkpointed every
   ``run.checkpoint_interval_s`` and on a stop signal; a window whose every row is finished is committed
   (its checkpointed rows folded in); consecutive committed windows are rolled into parts of
   ``data.part_size``, each committed by a record of its own (:mod:`batchgen.data.part_roll`). While
   the output holds no successful row, nothing is written until one succeeds: if the first
   :data:`EARLY_ROWS` rows of the run all fail in the engine, the job stops with exit 2 and an empty output.
5. Write ``_report.json``, print the summary table. Exit 0, or 3 when error rows exceed
   ``run.max_error_fraction``.

Exit statuses (README's table): 0 complete; 1 an unexpected error (one line; the traceback with
``HYDRA_FULL_ERROR=1`` or ``BATCHGEN_DEBUG=1``); 2 invalid configuration, input or output directory;
3 complete, but more error rows than ``run.max_error_fraction``; 75 incomplete — stopped by a signal, the
disk is full, or a tensor-parallel rank was lost — rerun the same command to resume.

Signals (:mod:`batchgen.job.signals`, installed for the whole run, start-up included): SIGINT, SIGTERM and
SIGUSR1 stop starting windows; the windows already started are finished for up to ``run.stop_grace_s``
seconds (default 0: their rows in flight are abandoned at once), every finished row is checkpointed, and the
job returns 75. A second SIGINT abandons the
rows in flight at once (still 75) but never interrupts the save of finished rows (``StopSignal.saving``); the
manifest is consistent at every instant.

What a stop can lose: a signal loses only the rows in flight (at most ``2 * engine.max_num_seqs /
sampling.n`` requests, each with the tokens generated so far); a kill -9, a power cut or a full disk loses
those plus the rows finished since the last checkpoint (at most ``run.checkpoint_interval_s`` seconds of
work).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from batchgen.data.lease import LeaseLost
from batchgen.data.manifest import Manifest
from batchgen.data.output_dir import OutputDir, on_disk_full, open_output_dir
from batchgen.data.part_roll import PartRoller
from batchgen.data.storage import StorageUnavailable
from batchgen.engine.config import parse_bytes
from batchgen.engine.core.interface import Engine
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.core.stats import EngineStats
from batchgen.errors import ConfigError, WorkerLost
from batchgen.job.config import POOLING_TASKS, to_job_config
from batchgen.job.duplicate_ids import DuplicateIdCheck
from batchgen.job.early_failure import FirstSuccessGate, preflight
from batchgen.job.feeder import EngineFeeder, ReadAhead, WindowWork
from batchgen.job.finish import examples_text, finish, job_report, nothing_to_do
from batchgen.job.input_versions import input_versions_unchanged
from batchgen.job.metrics import JobMetrics, open_metrics
from batchgen.job.openai_batch import is_batch_file, open_batch_file
from batchgen.job.plan import RETRY_KEYS, JobPlan, fresh_manifest, plan_job
from batchgen.job.progress import Progress
from batchgen.job.redact import job_secrets, scrub_text
from batchgen.job.replicas.run import run_replicas, uses_replicas
from batchgen.job.report import format_table, pooling_figures
from batchgen.job.result import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, JobResult, one_line
from batchgen.job.result import EXIT_OK as EXIT_OK  # re-exported: the exit statuses are run_job's
from batchgen.job.result import EXIT_TOO_MANY_ERRORS as EXIT_TOO_MANY_ERRORS
from batchgen.job.resume import WindowsTodo, verify_skipped_input, windows_to_do
from batchgen.job.signals import StopSignal
from batchgen.job.tally import RowTally
from batchgen.job.windows import iter_window_work
from batchgen.job.writer import PartWriter
from batchgen.runtime import startup_trace

logger = logging.getLogger("batchgen.job")


def debug_tracebacks() -> bool:
    """Whether unexpected errors should show their traceback (``HYDRA_FULL_ERROR=1`` / ``BATCHGEN_DEBUG=1``)."""
    return any(os.environ.get(k, "") not in ("", "0") for k in ("HYDRA_FULL_ERROR", "BATCHGEN_DEBUG"))


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
    Returns a JobResult with the exit status; nothing is raised for a configuration problem, a signal, a full
    disk or an unexpected error (each is one log line and its exit status; see the module docstring).
    """
    stop = stop or StopSignal()
    batch = None
    if is_batch_file(_data_input(cfg)):  # an OpenAI batch file: its requests in, its results file out
        try:
            batch = open_batch_file(cfg)
        except ConfigError as e:
            logger.error("%s", e)
            return JobResult(EXIT_CONFIG, "error", str(cfg.data.output), None, None, str(e))
        cfg = batch.job
    with stop.installed() if handle_signals else contextlib.nullcontext(stop):
        # a batch file's summary is its results file's, printed once that file is written
        result = _run_guarded(cfg, engine, stop, print_summary and batch is None)
    return batch.results(result, print_summary) if batch is not None else result


def _run_guarded(cfg: Any, engine: Engine | None, stop: StopSignal, print_summary: bool) -> JobResult:
    """Open the job whole, then run it; every failure mapped to its exit status and one line (the module
    docstring)."""
    opening = _Opening()
    job: _Job | None = None
    try:
        plan = opening.plan(cfg, stop)
        if plan.cfg.run.dry_run:  # the plan of the job instead of the job (batchgen.job.dry_run)
            from batchgen.job.dry_run import dry_run_job

            return dry_run_job(plan, engine, print_summary, opening.t_start)
        job = opening.open(plan, engine, stop, print_summary)
        return job.run()
    except ConfigError as e:
        return _failed(job, opening, EXIT_CONFIG, "error", str(e))
    except _Stopped as e:
        return _failed(
            job,
            opening,
            EXIT_INTERRUPTED,
            "incomplete",
            f"stopped by {stop.signal_name or 'a signal'} during {e.when}; nothing new was written: rerun the "
            "same command to resume",
            warn=True,
        )
    except WorkerLost as e:
        _note_exit_reason("worker-lost")
        where = _saved_where(job)
        return _failed(
            job,
            opening,
            EXIT_INTERRUPTED,
            "incomplete",
            f"stopped: {one_line(e)}{where}; rerun the same command (or let Slurm requeue) to resume",
        )
    except (LeaseLost, StorageUnavailable) as e:
        return _failed(
            job,
            opening,
            EXIT_INTERRUPTED,
            "incomplete",
            f"stopped: {one_line(e)}; every committed row is kept: rerun the same command to resume",
        )
    except KeyboardInterrupt:
        where = _saved_where(job)
        msg = f"aborted{where}: rerun the same command to resume"
        return _failed(job, opening, EXIT_INTERRUPTED, "incomplete", msg, warn=True)
    except Exception as e:  # noqa: BLE001 - the job's boundary: one clear line, the right status
        return _unexpected(job, opening, e)
    finally:
        if job is not None:
            job.close()
        else:
            opening.close()


def _unexpected(job: _Job | None, opening: _Opening, e: Exception) -> JobResult:
    """An unexpected error: exit 75 for a full disk, else 1 (or the traceback with ``HYDRA_FULL_ERROR=1``)."""
    out_dir = job.out_dir if job is not None else opening.out_dir
    if on_disk_full(e) and not debug_tracebacks():
        return _failed(
            job,
            opening,
            EXIT_INTERRUPTED,
            "incomplete",
            f"disk full writing {out_dir} ({one_line(e)}): every row committed so far is kept; "
            "free space and rerun the same command to resume",
        )
    if debug_tracebacks():
        raise e
    saved = job is not None and job.save_finished_rows()
    logger.debug("unexpected error", exc_info=True)
    return _failed(
        job,
        opening,
        EXIT_FAILED,
        "error",
        f"failed: {type(e).__name__}: {one_line(e)}"
        + (f" (finished rows are saved in {out_dir}; rerun to resume)" if saved else "")
        + " — set HYDRA_FULL_ERROR=1 for the traceback",
    )


def _saved_where(job: _Job | None) -> str:
    """After a stop or an error: save the finished rows; where they are, for the message ('' when none)."""
    if job is None or not job.save_finished_rows():
        return ""
    return f"; every finished row is saved in {job.out_dir}"


def _failed(
    job: _Job | None, opening: _Opening, code: int, status: str, msg: str, warn: bool = False
) -> JobResult:
    msg = scrub_text(msg, opening.secrets)  # a credential in a URL or an option never reaches a message
    (logger.warning if warn else logger.error)("%s", msg)
    if job is None:
        return JobResult(code, status, opening.out_dir, None, None, msg)
    report = None
    if code == EXIT_INTERRUPTED:
        with contextlib.suppress(Exception):
            report = job.report("incomplete", 0.0, {})
    return JobResult(code, status, job.out_dir, None, report, msg)


def _data_input(cfg: Any) -> Any:
    try:
        return cfg.data.input
    except Exception:  # noqa: BLE001 - not a job config: to_job_config reports it
        return None


EXIT_REASON_ENV = "BATCHGEN_EXIT_REASON_FILE"
"""When set, a job that exits 75 because a tensor-parallel rank was lost writes ``worker-lost`` into this file
(jobs/slurm/generate.sbatch requeues such a task; a 75 for a full disk it does not)."""


def _note_exit_reason(reason: str) -> None:
    path = os.environ.get(EXIT_REASON_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(reason + "\n")


class _Opening:
    """Opening a job: what is open until the job stands whole (:meth:`open`), for the failure of a step before
    that — the output directory to name in the message, and to close."""

    def __init__(self) -> None:
        self.out_dir = "?"
        self.outdir: OutputDir | None = None
        self.t_start = time.monotonic()
        self.secrets: list[str] = []
        """The job's credentials (:func:`~batchgen.job.redact.job_secrets`), scrubbed from every message."""

    def plan(self, cfg: Any, stop: StopSignal) -> JobPlan:
        """Plan the job (no model yet; the module docstring's step 1); raises ConfigError for a job that
        cannot run."""
        self.secrets = job_secrets(cfg)
        job = to_job_config(cfg)
        stop.grace_s = job.run.stop_grace_s
        self.out_dir = job.data.output
        plan = plan_job(job)
        startup_trace.mark("plan")
        return plan

    def open(self, plan: JobPlan, engine: Engine | None, stop: StopSignal, print_summary: bool) -> _Job:
        """Lock the output directory of the planned job and read its manifest; raises ConfigError for a job
        that cannot run, _Stopped on a stop."""
        t_start = self.t_start
        d = plan.cfg.data
        outdir = self.outdir = open_output_dir(
            d.output, d.shard.index, d.shard.count, dict(d.storage_options), d.lease_ttl_s
        )
        self.out_dir = str(outdir.path)
        _check_stop(stop, "start-up")
        manifest = outdir.open(
            fresh_manifest(plan),
            overwrite=d.overwrite,
            retry_keys=RETRY_KEYS,
            retry_errors=d.retry_errors,
        )
        return _Job(plan, outdir, manifest, engine, stop, print_summary, t_start)

    def close(self) -> None:
        if self.outdir is not None:
            self.outdir.close()


class InFlight(Protocol):
    """The windows a run has in flight (the feeder, or the replicas' coordinator): the active ones, whose
    finished rows a checkpoint saves, and every one not handed back (what a stop or an error saves)."""

    active: dict[int, WindowWork]

    def unfinished_windows(self) -> list[WindowWork]: ...


class _NothingInFlight:
    """The windows in flight before any engine runs: none."""

    active: dict[int, WindowWork] = {}

    def unfinished_windows(self) -> list[WindowWork]:
        return []


class _Job:
    """One run of a job, built whole before it runs (:meth:`_Opening.open`): its plan, the locked output
    directory and its manifest, the writer, the first-success gate and the row tally. Running adds the engine
    (unless one was given), the progress of the run and the windows in flight (the feeder, or the replicas'
    coordinator). The parts live in their own modules: what to do (:mod:`.resume`), reading windows
    (:mod:`.windows`), counting rows (:mod:`.tally`), stopping an impossible job (:mod:`.early_failure`),
    writing (:mod:`.writer`), the end (:mod:`.finish`)."""

    def __init__(
        self,
        plan: JobPlan,
        outdir: OutputDir,
        manifest: Manifest,
        engine: Engine | None,
        stop: StopSignal,
        print_summary: bool,
        t_start: float,
    ) -> None:
        self.plan, self.outdir, self.manifest = plan, outdir, manifest
        self.engine, self.stop, self.print_summary, self.t_start = engine, stop, print_summary, t_start
        self.out_dir = str(outdir.path)
        self.tally = RowTally()
        self.tally.lora = bool(plan.cfg.model.lora_modules)
        self.writer = PartWriter(plan, outdir, last_checkpoint=t_start)
        nothing_ok_yet = not any(r.rows_ok for r in manifest.windows.values()) and not any(
            p.rows_ok for p in manifest.partial.values()
        )
        closed = plan.cfg.run.max_error_fraction < 1.0 and nothing_ok_yet
        self.gate = FirstSuccessGate(closed, self._commit, self.tally)
        self.roller = PartRoller(outdir, parse_bytes(plan.cfg.data.part_size), plan.cfg.data.part_rows)
        self.duplicate_ids: DuplicateIdCheck | None = None
        self.in_flight: InFlight = _NothingInFlight()
        """What a stop or an error saves the finished rows of: the feeder, or the replicas' coordinator."""
        self.progress = Progress(total=0, mode="off")
        """The run's progress (a bar or log lines), set when the work starts."""
        self.metrics: JobMetrics | None = None
        """The Prometheus endpoint / textfile (``run.metrics_port`` / ``run.metrics_file``), opened when the
        work starts."""

    # ------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:  # the final figures, then the last textfile
            m = self.manifest
            self.metrics.job(
                rows_done=m.rows_done, windows_committed=self.writer.windows_done,
                eta_s=0.0 if m.complete else self.metrics.figures.eta_s,
            )  # fmt: skip
            self.metrics.close()
            self.metrics = None
        self.outdir.close()

    def run(self) -> JobResult:
        plan, outdir, m = self.plan, self.outdir, self.manifest
        todo = windows_to_do(plan, m, outdir)
        # changed input is refused also when nothing is left to do; unchanged store versions (ETags) need no
        # re-read of the rows
        unchanged = input_versions_unchanged(outdir.previous_input, plan.input.describe())
        checked = (0, 0.0) if unchanged else verify_skipped_input(plan, m, self.out_dir)
        with self.stop.saving():
            self.roller.open()  # parts whose windows a killed run committed are rolled first
        if not todo:
            return nothing_to_do(plan, outdir, m, self.print_summary, checked)
        if not m.committed_anything:  # a resumed output was checked by the run that started it
            self.duplicate_ids = DuplicateIdCheck(plan)
        _check_stop(self.stop, "start-up")
        return self._execute(todo)

    # ------------------------------------------------------------------------------------ execution
    def _execute(self, todo: WindowsTodo) -> JobResult:
        plan, m = self.plan, self.manifest
        retry_rows = todo.retry_rows
        self._log_input(todo, retry_rows)
        if plan.cfg.task == "score":
            return self._execute_score(todo)
        if plan.cfg.task in POOLING_TASKS:
            return self._execute_pool(todo)
        works, first, tokenizer_ref = self._read_first_windows(todo)
        if uses_replicas(plan.cfg):  # several engines (processes or Ray actors) behind one coordinator
            return run_replicas(self, works, first, tokenizer_ref[0], retry_rows)
        engine = self._started_engine()
        tokenizer_ref[0] = engine.tokenizer
        plan.prompt_spec.max_model_len = engine.max_model_len
        ahead = ReadAhead(works)  # the next window is read and tokenised while the engine runs
        before = engine.stats.snapshot()
        t_run = time.monotonic()
        self.start_progress(initial=m.rows_done - retry_rows)
        self._generate(engine, self.window_source(first, ahead))
        self.end_progress()
        return self._end(engine, before, t_run)

    def _commit(self, work: WindowWork) -> None:
        """Commit a finished window, then roll the parts it completes."""
        self.writer.commit(work)
        self.roller.roll_ready()

    def _log_input(self, todo: WindowsTodo, retry_rows: int) -> None:
        plan, outdir = self.plan, self.outdir
        d = plan.cfg.data
        logger.info(
            "input: %d file(s), %d rows; shard %d/%d = rows [%d, %d); %d window(s) of %d rows, %d to do%s; output: %s",
            len(plan.input.files), plan.input.num_rows, d.shard.index, d.shard.count, plan.row_start,
            plan.row_end, len(plan.windows), d.window_rows, len(todo),
            f" ({retry_rows} error rows to retry)" if retry_rows else "", outdir.path,
        )  # fmt: skip

    def _read_first_windows(self, todo: WindowsTodo) -> tuple[Any, list[WindowWork], list[Any]]:
        """Before the engine starts: the windows as a lazy stream (prompts built with ``tokenizer_ref[0]``),
        the first of them read by the preflight, and ``tokenizer_ref`` (the tokenizer alone until then)."""
        plan = self.plan
        tokenizer = self.engine.tokenizer if self.engine is not None else _load_tokenizer(plan)
        _require_chat_template(plan, tokenizer)
        plan.prompt_spec.max_model_len = plan.cfg.engine.max_model_len or plan.model_max_len
        tokenizer_ref = [tokenizer]
        works = iter_window_work(plan, self.outdir, todo, tokenizer_ref, self.roller)
        first = preflight(works, plan, self.gate.closed)
        _check_stop(self.stop, "start-up")
        return works, first, tokenizer_ref

    def _started_engine(self) -> Engine:
        engine = self.engine
        if engine is None:
            engine = self.engine = _start_engine(self.plan)
            startup_trace.mark("model_loaded")
        _check_stop(self.stop, "start-up")
        return engine

    def start_progress(self, initial: int) -> None:
        """The run's work starts: its progress from ``initial`` finished rows (its ETA from the dry run's
        ``_plan.json`` when the output holds one of this configuration), and the metrics endpoint / textfile when
        ``run.metrics_port`` / ``run.metrics_file`` is set."""
        from batchgen.job.plan_report import planned_work

        cfg = self.plan.cfg
        if self.metrics is None:
            self.metrics = open_metrics(cfg.run.metrics_port, cfg.run.metrics_file)
        self.progress = Progress(
            total=self.plan.row_end - self.plan.row_start,
            initial=initial,
            mode=cfg.run.progress,
            interval_s=cfg.run.progress_interval_s,
            planned=planned_work(self.outdir, self.plan.fingerprint),
        )
        if self.metrics is not None:  # the shard's rows from the first scrape on
            self.metrics.job(rows_total=self.progress.total, rows_done=self.progress.done)

    def end_progress(self) -> None:
        self.progress.close()
        self.progress = Progress(total=0, mode="off")

    def _generate(self, engine: Engine, next_window: Any) -> None:
        """Feed every window through the engine, committing each as it finishes; on a stop, save the
        finished rows; at the end, commit the windows still held (or stop: nothing succeeded)."""
        cfg = self.plan.cfg
        max_in_flight = max(1, 2 * cfg.engine.max_num_seqs // cfg.sampling.n)
        feeder = self.in_flight = EngineFeeder(
            engine, next_window, max_in_flight, self.stop, on_output=self.on_output, on_step=self._on_step
        )
        for work in feeder.run():
            with self.stop.saving():
                self.gate.window_finished(work)
            if self.metrics is not None:
                self._update_metrics()
        if self.stop.requested:
            self.save_finished_rows()
        elif self.gate.held:
            self.gate.check(final=True)
            self.gate.release()

    def _execute_score(self, todo: WindowsTodo) -> JobResult:
        """``task=score``: log-likelihoods instead of generations (:mod:`batchgen.job.score`), a window at a
        time (the unit of resume)."""
        from batchgen.job.score import run_score_windows

        engine = self._started_engine()
        before = engine.stats.snapshot()
        t_run = time.monotonic()
        self.start_progress(initial=self.manifest.rows_done)
        try:
            specs = todo.specs()
            self.writer.windows_done, self.writer.rows_done = run_score_windows(
                self.plan,
                self.outdir,
                engine,
                specs,
                self.stop,
                self.progress,
                self.tally.adapter_row,
                after_commit=self.roller.roll_ready,
                on_window=self._window_committed,
            )
        finally:
            self.end_progress()
        return self._end(engine, before, t_run)

    def _execute_pool(self, todo: WindowsTodo) -> JobResult:
        """``task=embed`` / ``task=classify``: pooled vectors instead of generations (:mod:`batchgen.job.pool`),
        a window at a time (the unit of resume)."""
        from batchgen.job.pool import run_pool_windows, start_runner

        runner = start_runner(self.plan)
        _check_stop(self.stop, "start-up")
        stats = runner.engine.stats if runner.engine is not None else None
        before = stats.snapshot() if stats is not None else None
        t_run = time.monotonic()
        self.start_progress(initial=self.manifest.rows_done)
        try:
            specs = todo.specs()
            self.writer.windows_done, self.writer.rows_done, pooled = run_pool_windows(
                self.plan,
                self.outdir,
                runner,
                specs,
                self.stop,
                self.progress,
                after_commit=self.roller.roll_ready,
                on_window=lambda n: self._window_committed(n, stats),
            )
        finally:
            self.end_progress()
        wall = time.monotonic() - t_run
        status = "complete" if self.manifest.complete else "incomplete"
        delta = stats.delta(before) if stats is not None else None
        extra = {"startup_s": round(t_run - self.t_start, 3), "pooling": pooling_figures(pooled, wall)}
        return self.conclude(self.report(status, wall, extra, delta))

    def _end(self, engine: Engine, before: Any, t_run: float) -> JobResult:
        """Report and result of a run whose work started at ``t_run`` (engine stats since ``before``)."""
        wall = time.monotonic() - t_run
        status = "complete" if self.manifest.complete else "incomplete"
        report = self.report(
            status, wall, {"startup_s": round(t_run - self.t_start, 3)}, engine.stats.delta(before)
        )
        return self.conclude(report)

    def window_source(self, first: list[WindowWork], ahead: ReadAhead) -> Callable[[], WindowWork | None]:
        """The windows to run, in order (the preflight's `first`, then those `ahead` reads), as a function
        returning the next one (None at the end); rows already invalid are counted as each window comes."""
        queue = iter(first)

        def next_window() -> WindowWork | None:
            work = next(queue, None) or next(ahead, None)
            if work is not None:
                for p in work.todo_positions:
                    r = work.rows[p]
                    if r.error is not None:
                        self._count(False, r.error, r.lora_name)
            return work

        return next_window

    def _count(self, ok: bool, error: str | None, lora_name: str | None = None) -> None:
        self.tally.count(ok, error)
        self.tally.adapter_row(lora_name, ok)
        self.progress.update(1, errors=int(not ok))

    def on_output(self, work: WindowWork, pos: int, out: RequestOutput) -> None:
        """A row finished in the engine: counted, and the gate opened by the first success."""
        ok = self.tally.engine_output(out)
        self.tally.adapter_row(work.rows[pos].lora_name, ok)
        self.progress.update(1, errors=int(not ok))
        if self.metrics is not None and self.engine is not None:
            self.metrics.finished(out, self.engine.stats.num_steps)
        if ok and self.gate.closed:
            self.gate.open()

    def _on_step(self) -> None:
        assert self.engine is not None
        self.progress.update(0, stats=self.engine.stats)
        if self.metrics is not None:
            self._update_metrics()
        if self.gate.closed:
            self.gate.check()
            return
        if self.writer.checkpoint_due():
            self.writer.checkpoint(list(self.in_flight.active.values()))

    def _window_committed(self, windows: int, stats: EngineStats | None = None) -> None:
        """A prompt-only job (score, embed, classify) committed its ``windows``-th window of this run: the
        metrics see it (with ``stats``, the engine's, when the job's engine is not ``self.engine``)."""
        self.writer.windows_done = windows
        if self.metrics is not None:
            self._update_metrics(stats)

    def _update_metrics(self, stats: EngineStats | None = None) -> None:
        """The metrics get the engine's stats (``stats``, else ``self.engine``'s) and the job's figures."""
        assert self.metrics is not None
        if stats is None and self.engine is not None:
            stats = self.engine.stats
        if stats is not None:
            engines = getattr(self.in_flight, "busy_engines", 1)  # replicas: their steps are summed
            self.metrics.step(stats, getattr(self.in_flight, "where", {}).keys(), engines)
        p = self.progress
        self.metrics.job(
            rows_total=p.total, rows_done=p.done, error_rows=p.errors,
            windows_committed=self.writer.windows_done, eta_s=p.eta_s(),
        )  # fmt: skip

    def save_finished_rows(self) -> bool:
        """After a stop or an error: commit held windows and checkpoint every finished row of the windows in
        flight. Best effort (a full disk, a second Ctrl-C); returns whether anything is on disk (False before
        any window was in flight: nothing of this run to save)."""
        if isinstance(self.in_flight, _NothingInFlight):
            return False
        try:
            with self.stop.saving():
                if self.gate.held:
                    self.gate.open()
                self.writer.checkpoint(self.in_flight.unfinished_windows())
        except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - keep the first error's message
            logger.warning("could not save every finished row (%s)", one_line(e) or type(e).__name__)
        return self.manifest.committed_anything

    # ------------------------------------------------------------------------------------------ end
    def report(self, status: str, wall: float, extra: dict[str, Any], stats: Any = None) -> dict[str, Any]:
        this_run = (self.writer.rows_done, self.writer.windows_done)
        images = getattr(self.engine, "images", None)  # image-text models: the encoder's figures
        extra = {**extra, **(images.report(wall) if images is not None else {})}
        return job_report(
            self.plan, self.outdir, self.manifest, self.tally, this_run, self.stop.signal_name, status, wall,
            extra, stats,
        )  # fmt: skip

    def conclude(self, report: dict[str, Any]) -> JobResult:
        """The result (0 complete, 3 too many error rows, 75 stopped early), logged and printed with the table."""
        if self.duplicate_ids is not None:
            self.duplicate_ids.join()  # its warning belongs to the run's log
        if self.manifest.complete:
            with self.stop.saving():
                self.roller.finish()
        result = finish(self.plan, self.outdir, self.manifest, report, self.stop.signal_name)
        if self.print_summary:
            print(format_table(report))
            tokenizer = getattr(self.engine, "tokenizer", None) if self.tally.examples else None
            print(examples_text(str(self.outdir.path), self.tally.examples, tokenizer))
            print(result.message)
        return result


def _check_stop(stop: StopSignal, when: str) -> None:
    if stop.requested:
        raise _Stopped(when)


class _Stopped(KeyboardInterrupt):
    """A stop signal arrived during start-up: stop before the next step (exit 75)."""

    def __init__(self, when: str) -> None:
        super().__init__(f"stopped during {when}")
        self.when = when


def _load_tokenizer(plan: JobPlan) -> Any:
    from batchgen.models.loader import load_tokenizer

    try:
        return load_tokenizer(plan.model_path)
    except Exception as e:  # noqa: BLE001 - any failure to load is the checkpoint's problem
        raise ConfigError(
            f"model.path: cannot load the tokenizer of {plan.model_path!r}: {one_line(e)}"
        ) from e


def _start_engine(plan: JobPlan) -> Engine:
    """The engine for the plan's checkpoint. Whatever stops it from starting (a bad checkpoint, no room for
    the KV cache, not enough memory) is a ConfigError naming the model and the setting to change."""
    from batchgen.engine.core.llm_engine import LLMEngine

    e = plan.cfg.engine
    try:
        return LLMEngine(
            plan.model_path, e, dtype=plan.cfg.model.dtype, implementation=plan.cfg.model.implementation
        )
    except WorkerLost:
        raise
    except MemoryError as err:
        raise ConfigError(
            f"not enough memory to start the engine (engine.kv_cache_memory={e.kv_cache_memory}, "
            f"engine.num_blocks={e.num_blocks}, engine.gpu_memory_utilization={e.gpu_memory_utilization}): "
            f"{one_line(err) or 'MemoryError'}; lower the KV cache size"
        ) from err
    except Exception as err:  # noqa: BLE001 - a model that does not load is a configuration problem
        if type(err).__name__ == "OutOfMemoryError":
            raise ConfigError(
                f"out of device memory starting the engine: {one_line(err)}; lower "
                "engine.gpu_memory_utilization or engine.max_num_batched_tokens"
            ) from err
        where = plan.cfg.model.path or "the embedded tiny model"
        raise ConfigError(f"cannot start the engine for model.path={where!r}: {one_line(err)}") from err


def _require_chat_template(plan: JobPlan, tokenizer: Any) -> None:
    if plan.cfg.data.messages_column and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"data.messages_column is set but the tokenizer of {plan.model_path!r} has no chat template"
        )
