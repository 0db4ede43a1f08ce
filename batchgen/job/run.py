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
   atomically (its checkpointed rows folded in), then recorded in the manifest; consecutive committed windows
   are rolled into parts of ``data.part_size`` (:mod:`batchgen.data.part_roll`). While
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
from typing import Any

from batchgen import startup_trace
from batchgen.data.manifest import Manifest
from batchgen.data.output_dir import OutputDir, on_disk_full
from batchgen.data.part_roll import PartRoller
from batchgen.data.remote_output import open_output_dir
from batchgen.engine.config import parse_bytes
from batchgen.engine.interface import Engine
from batchgen.engine.outputs import RequestOutput
from batchgen.errors import ConfigError, WorkerLost
from batchgen.job.config import POOLING_TASKS, to_job_config
from batchgen.job.duplicate_ids import DuplicateIdCheck
from batchgen.job.early_failure import FirstSuccessGate, preflight
from batchgen.job.feeder import EngineFeeder, ReadAhead, WindowWork
from batchgen.job.finish import examples_text, finish, job_report, nothing_to_do
from batchgen.job.input_versions import input_versions_unchanged
from batchgen.job.openai_batch import is_batch_file
from batchgen.job.plan import RETRY_KEYS, JobPlan, fresh_manifest, plan_job
from batchgen.job.progress import Progress
from batchgen.job.replica_job import run_replicas, uses_replicas
from batchgen.job.report import format_table
from batchgen.job.result import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, JobResult, one_line
from batchgen.job.result import EXIT_OK as EXIT_OK  # re-exported: the exit statuses are run_job's
from batchgen.job.result import EXIT_TOO_MANY_ERRORS as EXIT_TOO_MANY_ERRORS
from batchgen.job.resume import WindowsTodo, verify_skipped_input, windows_to_do
from batchgen.job.signals import StopSignal
from batchgen.job.tally import RowTally
from batchgen.job.windows import iter_window_work
from batchgen.job.writer import PartWriter

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
    if is_batch_file(_data_input(cfg)):  # an OpenAI batch file: converted, run as a job, results written
        from batchgen.job.openai_batch import run_openai_batch

        def inner(c: Any) -> JobResult:
            return run_job(
                c, engine=engine, stop=stop, handle_signals=handle_signals, print_summary=print_summary
            )

        return run_openai_batch(cfg, inner)
    job = _Job(cfg, engine, stop, print_summary)
    with stop.installed() if handle_signals else contextlib.nullcontext(stop):
        try:
            return _run_guarded(job, stop)
        finally:
            job.close()


def _run_guarded(job: _Job, stop: StopSignal) -> JobResult:
    """``job.run()``, every failure mapped to its exit status and one line (the module docstring)."""
    try:
        return job.run()
    except ConfigError as e:
        return job.fail(EXIT_CONFIG, "error", str(e))
    except _Stopped as e:
        return job.fail(
            EXIT_INTERRUPTED,
            "incomplete",
            f"stopped by {stop.signal_name or 'a signal'} during {e.when}; nothing new was written: rerun the "
            "same command to resume",
            warn=True,
        )
    except WorkerLost as e:
        _note_exit_reason("worker-lost")
        saved = job.save_finished_rows()
        where = f"; every finished row is saved in {job.out_dir}" if saved else ""
        return job.fail(
            EXIT_INTERRUPTED,
            "incomplete",
            f"stopped: {one_line(e)}{where}; rerun the same command (or let Slurm requeue) to resume",
        )
    except KeyboardInterrupt:
        saved = job.save_finished_rows()
        where = f"; every finished row is saved in {job.out_dir}" if saved else ""
        return job.fail(
            EXIT_INTERRUPTED, "incomplete", f"aborted{where}: rerun the same command to resume", warn=True
        )
    except Exception as e:  # noqa: BLE001 - the job's boundary: one clear line, the right status
        if on_disk_full(e) and not debug_tracebacks():
            return job.fail(
                EXIT_INTERRUPTED,
                "incomplete",
                f"disk full writing {job.out_dir} ({one_line(e)}): every row committed so far is kept; "
                "free space and rerun the same command to resume",
            )
        if debug_tracebacks():
            raise
        saved = job.save_finished_rows()
        logger.debug("unexpected error", exc_info=True)
        return job.fail(
            EXIT_FAILED,
            "error",
            f"failed: {type(e).__name__}: {one_line(e)}"
            + (f" (finished rows are saved in {job.out_dir}; rerun to resume)" if saved else "")
            + " — set HYDRA_FULL_ERROR=1 for the traceback",
        )


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


class _Job:
    """One run of a job: the state the steps of :func:`run_job` share (module docstring). The parts live in
    their own modules: what to do (:mod:`.resume`), reading windows (:mod:`.windows`), counting rows
    (:mod:`.tally`), stopping an impossible job (:mod:`.early_failure`), writing (:mod:`.writer`), the end
    (:mod:`.finish`)."""

    def __init__(self, cfg: Any, engine: Engine | None, stop: StopSignal, print_summary: bool) -> None:
        self.cfg, self.engine, self.stop, self.print_summary = cfg, engine, stop, print_summary
        self.t_start = time.monotonic()
        self.out_dir = "?"
        self.plan: JobPlan | None = None
        self.outdir: OutputDir | None = None
        self.manifest: Manifest | None = None
        self.writer: PartWriter | None = None
        self.gate: FirstSuccessGate | None = None
        self.feeder: EngineFeeder | None = None
        self.progress: Progress | None = None
        self.tally = RowTally()
        self.duplicate_ids: DuplicateIdCheck | None = None
        self.roller: PartRoller | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.outdir is not None:
            self.outdir.close()

    def fail(self, code: int, status: str, msg: str, warn: bool = False) -> JobResult:
        (logger.warning if warn else logger.error)("%s", msg)
        report = None
        if code == EXIT_INTERRUPTED and self.manifest is not None and self.outdir is not None:
            with contextlib.suppress(Exception):
                report = self._report("incomplete", 0.0, {})
        return JobResult(code, status, self.out_dir, None, report, msg)

    def run(self) -> JobResult:
        job = to_job_config(self.cfg)
        self.stop.grace_s = job.run.stop_grace_s
        self.out_dir = job.data.output
        plan = self.plan = plan_job(job)
        self.tally.lora = bool(job.model.lora_modules)
        startup_trace.mark("plan")
        d = job.data
        outdir = self.outdir = open_output_dir(
            d.output, d.shard.index, d.shard.count, dict(d.storage_options), d.lease_ttl_s
        )
        self.writer = PartWriter(plan, outdir, last_checkpoint=self.t_start)
        self.out_dir = str(outdir.path)
        self._check_stop("start-up")
        m = self.manifest = outdir.open(
            fresh_manifest(plan),
            overwrite=job.data.overwrite,
            retry_keys=RETRY_KEYS,
            retry_errors=job.data.retry_errors,
        )
        todo = windows_to_do(plan, m, outdir)
        # changed input is refused also when nothing is left to do; unchanged store versions (ETags) need no
        # re-read of the rows
        unchanged = input_versions_unchanged(outdir.previous_input, plan.input.describe())
        checked = (0, 0.0) if unchanged else verify_skipped_input(plan, m, self.out_dir)
        self.roller = PartRoller(outdir, parse_bytes(d.part_size), d.part_rows)
        with self.stop.saving():
            self.roller.open()  # a part a killed run left half written is finished first
        if not todo:
            return nothing_to_do(plan, outdir, m, self.print_summary, checked)
        if not m.committed_anything:  # a resumed output was checked by the run that started it
            self.duplicate_ids = DuplicateIdCheck(plan)
        self._check_stop("start-up")
        return self._execute(todo)

    def _check_stop(self, when: str) -> None:
        if self.stop.requested:
            raise _Stopped(when)

    # ------------------------------------------------------------------------------------ execution
    def _execute(self, todo: WindowsTodo) -> JobResult:
        plan, m, writer = self.plan, self.manifest, self.writer
        assert plan is not None and m is not None and writer is not None
        nothing_ok_yet = not any(r.rows_ok for r in m.windows.values()) and not any(
            p.rows_ok for p in m.partial.values()
        )
        closed = plan.cfg.run.max_error_fraction < 1.0 and nothing_ok_yet
        self.gate = FirstSuccessGate(closed, self._commit, self.tally)
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
        self.progress = self._progress(initial=m.rows_done - retry_rows)
        self._generate(engine, self.window_source(first, ahead))
        self.progress.close()
        self.progress = None
        return self._end(engine, before, t_run)

    def _commit(self, work: WindowWork) -> None:
        """Commit a finished window, then roll the parts it completes."""
        assert self.writer is not None and self.roller is not None
        self.writer.commit(work)
        self.roller.roll_ready()

    def _log_input(self, todo: WindowsTodo, retry_rows: int) -> None:
        plan, outdir = self.plan, self.outdir
        assert plan is not None and outdir is not None
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
        plan, outdir, gate = self.plan, self.outdir, self.gate
        assert plan is not None and outdir is not None and gate is not None
        tokenizer = self.engine.tokenizer if self.engine is not None else _load_tokenizer(plan)
        _require_chat_template(plan, tokenizer)
        plan.prompt_spec.max_model_len = plan.cfg.engine.max_model_len or plan.model_max_len
        tokenizer_ref = [tokenizer]
        works = iter_window_work(plan, outdir, todo, tokenizer_ref, self.roller)
        first = preflight(works, plan, gate.closed)
        self._check_stop("start-up")
        return works, first, tokenizer_ref

    def _started_engine(self) -> Engine:
        assert self.plan is not None
        engine = self.engine
        if engine is None:
            engine = self.engine = _start_engine(self.plan)
            startup_trace.mark("model_loaded")
        self._check_stop("start-up")
        return engine

    def _progress(self, initial: int) -> Progress:
        assert self.plan is not None
        plan = self.plan
        return Progress(
            total=plan.row_end - plan.row_start,
            initial=initial,
            mode=plan.cfg.run.progress,
            interval_s=plan.cfg.run.log_interval_s,
        )

    def _generate(self, engine: Engine, next_window: Any) -> None:
        """Feed every window through the engine, committing each as it finishes; on a stop, save the
        finished rows; at the end, commit the windows still held (or stop: nothing succeeded)."""
        assert self.plan is not None and self.gate is not None
        cfg = self.plan.cfg
        max_in_flight = max(1, 2 * cfg.engine.max_num_seqs // cfg.sampling.n)
        self.feeder = EngineFeeder(
            engine, next_window, max_in_flight, self.stop, on_output=self._on_output, on_step=self._on_step
        )
        for work in self.feeder.run():
            with self.stop.saving():
                self.gate.window_finished(work)
        if self.stop.requested:
            self.save_finished_rows()
        elif self.gate.held:
            self.gate.check(final=True)
            self.gate.release()

    def _execute_score(self, todo: WindowsTodo) -> JobResult:
        """``task=score``: log-likelihoods instead of generations (:mod:`batchgen.job.score`), a window at a
        time (the unit of resume)."""
        from batchgen.job.score import run_score_windows

        plan, m, writer = self.plan, self.manifest, self.writer
        assert plan is not None and self.outdir is not None and m is not None and writer is not None
        engine = self._started_engine()
        before = engine.stats.snapshot()
        t_run = time.monotonic()
        self.progress = self._progress(initial=m.rows_done)
        try:
            specs = todo.specs()
            writer.windows_done, writer.rows_done = run_score_windows(
                plan,
                self.outdir,
                engine,
                specs,
                self.stop,
                self.progress,
                self.tally.adapter_row,
                after_commit=self.roller.roll_ready if self.roller is not None else None,
            )
        finally:
            self.progress.close()
            self.progress = None
        return self._end(engine, before, t_run)

    def _execute_pool(self, todo: WindowsTodo) -> JobResult:
        """``task=embed`` / ``task=classify``: pooled vectors instead of generations (:mod:`batchgen.job.pool`),
        a window at a time (the unit of resume)."""
        from batchgen.job.pool import run_pool_windows, start_runner

        plan, m, writer = self.plan, self.manifest, self.writer
        assert plan is not None and self.outdir is not None and m is not None and writer is not None
        runner = start_runner(plan)
        self._check_stop("start-up")
        stats = runner.engine.stats if runner.engine is not None else None
        before = stats.snapshot() if stats is not None else None
        t_run = time.monotonic()
        self.progress = self._progress(initial=m.rows_done)
        try:
            specs = todo.specs()
            writer.windows_done, writer.rows_done = run_pool_windows(
                plan,
                self.outdir,
                runner,
                specs,
                self.stop,
                self.progress,
                after_commit=self.roller.roll_ready if self.roller is not None else None,
            )
        finally:
            self.progress.close()
            self.progress = None
        wall = time.monotonic() - t_run
        status = "complete" if m.complete else "incomplete"
        delta = stats.delta(before) if stats is not None else None
        extra = {"startup_s": round(t_run - self.t_start, 3)}
        return self._finish(self._report(status, wall, extra, delta))

    def _end(self, engine: Engine, before: Any, t_run: float) -> JobResult:
        """Report and result of a run whose work started at ``t_run`` (engine stats since ``before``)."""
        assert self.manifest is not None
        wall = time.monotonic() - t_run
        status = "complete" if self.manifest.complete else "incomplete"
        report = self._report(
            status, wall, {"startup_s": round(t_run - self.t_start, 3)}, engine.stats.delta(before)
        )
        return self._finish(report)

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
        if self.progress is not None:
            self.progress.update(1)

    def _on_output(self, work: WindowWork, pos: int, out: RequestOutput) -> None:
        ok = self.tally.engine_output(out)
        self.tally.adapter_row(work.rows[pos].lora_name, ok)
        if self.progress is not None:
            self.progress.update(1)
        assert self.gate is not None
        if ok and self.gate.closed:
            self.gate.open()

    def _on_step(self) -> None:
        assert self.progress is not None and self.engine is not None
        assert self.gate is not None and self.writer is not None
        self.progress.update(0, stats=self.engine.stats)
        if self.gate.closed:
            self.gate.check()
            return
        if self.writer.checkpoint_due():
            self.writer.checkpoint(list(self.feeder.active.values()) if self.feeder else [])

    def save_finished_rows(self) -> bool:
        """After a stop or an error: commit held windows and checkpoint every finished row of the windows in
        flight. Best effort (a full disk, a second Ctrl-C); returns whether anything is on disk."""
        if self.outdir is None or self.manifest is None or self.feeder is None:
            return False
        assert self.gate is not None and self.writer is not None
        try:
            with self.stop.saving():
                if self.gate.held:
                    self.gate.open()
                self.writer.checkpoint(self.feeder.unfinished_windows())
        except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - keep the first error's message
            logger.warning("could not save every finished row (%s)", one_line(e) or type(e).__name__)
        return self.manifest.committed_anything

    # ------------------------------------------------------------------------------------------ end
    def _report(self, status: str, wall: float, extra: dict[str, Any], stats: Any = None) -> dict[str, Any]:
        plan, outdir, m, writer = self.plan, self.outdir, self.manifest, self.writer
        assert plan is not None and outdir is not None and m is not None and writer is not None
        this_run = (writer.rows_done, writer.windows_done)
        return job_report(
            plan, outdir, m, self.tally, this_run, self.stop.signal_name, status, wall, extra, stats
        )

    def _finish(self, report: dict[str, Any]) -> JobResult:
        """The result (0 complete, 3 too many error rows, 75 stopped early), logged and printed with the table."""
        plan, outdir, m = self.plan, self.outdir, self.manifest
        assert plan is not None and outdir is not None and m is not None
        if self.duplicate_ids is not None:
            self.duplicate_ids.join()  # its warning belongs to the run's log
        if m.complete and self.roller is not None:
            with self.stop.saving():
                self.roller.finish()
        result = finish(plan, outdir, m, report, self.stop.signal_name)
        if self.print_summary:
            print(format_table(report))
            tokenizer = getattr(self.engine, "tokenizer", None) if self.tally.examples else None
            print(examples_text(str(outdir.path), self.tally.examples, tokenizer))
            print(result.message)
        return result


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
    from batchgen.engine.llm_engine import LLMEngine

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
