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
   ``run.checkpoint_interval_s`` and on a stop signal; a window whose every row is finished becomes one
   part file (its checkpointed rows folded in), committed atomically, then recorded in the manifest. While
   the output holds no successful row, nothing is written until one succeeds: if the first
   :data:`EARLY_ROWS` rows of the run all fail in the engine, the job stops with exit 2 and an empty output.
5. Write ``_report.json``, print the summary table. Exit 0, or 3 when error rows exceed
   ``run.max_error_fraction``.

Exit statuses (README's table): 0 complete; 1 an unexpected error (one line; the traceback with
``HYDRA_FULL_ERROR=1`` or ``BATCHGEN_DEBUG=1``); 2 invalid configuration, input or output directory;
3 complete, but more error rows than ``run.max_error_fraction``; 75 incomplete — stopped by a signal, or the
disk is full — rerun the same command to resume.

Signals (:mod:`batchgen.job.signals`, installed for the whole run, start-up included): SIGINT, SIGTERM and
SIGUSR1 stop admission; rows in flight are finished for up to ``run.stop_grace_s`` seconds (default 0:
abandoned at once), every finished row is checkpointed, and the job returns 75. A second SIGINT aborts at
once (still 75; finished rows are checkpointed if possible, the manifest is consistent at every instant).

What a stop can lose: a signal loses only the rows in flight (at most ``2 * engine.max_num_seqs /
sampling.n`` requests, each with the tokens generated so far); a kill -9, a power cut or a full disk loses
those plus the rows finished since the last checkpoint (at most ``run.checkpoint_interval_s`` seconds of
work).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import batchgen
from batchgen.data.manifest import Manifest, WindowRecord
from batchgen.data.output_dir import OutputDir, on_disk_full
from batchgen.data.parts import assemble_part, build_rows, part_as_piece
from batchgen.data.prompts import PromptRow, build_prompts
from batchgen.data.reader import Window, WindowSpec, iter_windows
from batchgen.data.values import sanitize_utf8, window_sha256
from batchgen.engine.interface import Engine
from batchgen.engine.outputs import RequestOutput
from batchgen.errors import ConfigError
from batchgen.job.config import to_job_config
from batchgen.job.feeder import EngineFeeder, ReadAhead, WindowWork
from batchgen.job.plan import RETRY_KEYS, JobPlan, fresh_manifest, plan_job
from batchgen.job.progress import Progress
from batchgen.job.report import build_report, error_fraction, format_table, write_report
from batchgen.job.signals import StopSignal

logger = logging.getLogger("batchgen.job")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_TOO_MANY_ERRORS = 3
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: incomplete (a signal, a full disk), rerun to resume

EARLY_ROWS = 64
"""While the output holds no successful row: how many rows must all fail (in the preflight, or in the engine)
before the job is stopped as impossible (exit 2)."""

_RETRYABLE_LEGACY = re.compile(
    r"engine\.max_model_len|KV blocks|chat template failed|tokenizer failed|^no result$|^generation failed$"
    r"|input unreadable"
)


NUM_EXAMPLES = 3  # rows shown in the summary


@dataclass
class JobResult:
    """What a job run ended with; ``exit_code`` is the CLI's exit status."""

    exit_code: int
    status: str  # "complete" | "incomplete" | "failed" | "error"
    output_dir: str
    report_path: str | None = None
    report: dict[str, Any] | None = None
    message: str = ""


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
    job = _Job(cfg, engine, stop, print_summary)
    with stop.installed() if handle_signals else contextlib.nullcontext(stop):
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
                    f"disk full writing {job.out_dir} ({_one_line(e)}): every row committed so far is kept; "
                    "free space and rerun the same command to resume",
                )
            if debug_tracebacks():
                raise
            saved = job.save_finished_rows()
            logger.debug("unexpected error", exc_info=True)
            return job.fail(
                EXIT_FAILED,
                "error",
                f"failed: {type(e).__name__}: {_one_line(e)}"
                + (f" (finished rows are saved in {job.out_dir}; rerun to resume)" if saved else "")
                + " — set HYDRA_FULL_ERROR=1 for the traceback",
            )
        finally:
            job.close()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _error_key(msg: str) -> str:
    """An error message with its numbers blanked, to count errors of one kind together."""
    return re.sub(r"\d+", "N", msg)[:120]


@dataclass
class _Todo:
    """A window this run works on: all of it, or its rows not already done (checkpointed, or ok in the part
    when retrying its error rows)."""

    spec: WindowSpec
    retry_part: bool = False
    retry_rows: list[int] = field(default_factory=list)


class _Job:
    """One run of a job: the state the steps of :func:`run_job` share (module docstring)."""

    def __init__(self, cfg: Any, engine: Engine | None, stop: StopSignal, print_summary: bool) -> None:
        self.cfg, self.engine, self.stop, self.print_summary = cfg, engine, stop, print_summary
        self.t_start = time.monotonic()
        self.out_dir = "?"
        self.plan: JobPlan | None = None
        self.outdir: OutputDir | None = None
        self.manifest: Manifest | None = None
        self.feeder: EngineFeeder | None = None
        self.progress: Progress | None = None
        # while the output holds no successful row: commits are held back (see the module docstring)
        self.hold = False
        self.held: list[WindowWork] = []
        self.rows_finished = 0
        self.engine_done = 0
        self.engine_ok = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.engine_errors: collections.Counter[str] = collections.Counter()
        self.error_examples: dict[str, str] = {}
        self.examples: list[tuple[list[int], str]] = []  # (prompt token ids, text) of the first ok rows
        self.last_checkpoint = time.monotonic()
        self.windows_done = 0
        self.rows_done = 0

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
        outdir = self.outdir = OutputDir(job.data.output, job.data.shard.index, job.data.shard.count)
        self.out_dir = str(outdir.path)
        self._check_stop("start-up")
        self.manifest = outdir.open(
            fresh_manifest(plan),
            overwrite=job.data.overwrite,
            retry_keys=RETRY_KEYS,
            retry_errors=job.data.retry_errors,
            legacy_fingerprint=plan.legacy_fingerprint,
        )
        todo = self._todo()
        if not todo:
            return self._nothing_to_do()
        self._verify_skipped_input(todo)
        self._check_stop("start-up")
        return self._execute(todo)

    def _check_stop(self, when: str) -> None:
        if self.stop.requested:
            raise _Stopped(when)

    # ----------------------------------------------------------------------------------- what to do
    def _todo(self) -> list[_Todo]:
        plan, m = self.plan, self.manifest
        assert plan is not None and m is not None
        retry = plan.cfg.data.retry_errors
        out = []
        for w in plan.windows:
            rec = m.windows.get(w.index)
            if rec is None:
                out.append(_Todo(w))
            elif retry and rec.rows_error:
                rows = rec.retry_rows or (
                    self._legacy_retry_rows(w.index) if rec.input_sha256 is None else []
                )
                if rows:
                    out.append(_Todo(w, retry_part=True, retry_rows=rows))
        return out

    def _legacy_retry_rows(self, window: int) -> list[int]:
        """Retryable rows of a part written by batchgen <= 0.1 (which did not record them): by message."""
        assert self.outdir is not None and self.plan is not None
        t = self.outdir.read_part(window)
        n = self.plan.cfg.sampling.n
        errs = t.column("error").to_pylist()
        return sorted({i // n for i, e in enumerate(errs) if e is not None and _RETRYABLE_LEGACY.search(e)})

    def _verify_skipped_input(self, todo: list[_Todo]) -> None:
        """ConfigError naming the window when the input rows of a window whose output is kept changed."""
        plan, m = self.plan, self.manifest
        assert plan is not None and m is not None
        hashes = {w: r.input_sha256 for w, r in m.windows.items() if r.input_sha256}
        hashes.update({w: p.input_sha256 for w, p in m.partial.items() if p.input_sha256})
        if not hashes:
            return
        t0 = time.monotonic()
        specs = [w for w in plan.windows if w.index in hashes]
        for win in iter_windows(plan.input, specs, plan.columns, schema=plan.read_schema):
            if win.unreadable or window_sha256(win.table) != hashes[win.index]:
                files = [
                    f.rel_path
                    for f in plan.input.files
                    if f.row_start < win.spec.row_end and f.row_start + f.num_rows > win.spec.row_start
                ]
                raise ConfigError(
                    f"the input changed since window {win.index} (input rows {win.spec.row_start}..{win.spec.row_end}"
                    f" in {', '.join(repr(f) for f in files[:3])}) was processed: the content of its rows differs "
                    f"from what {self.out_dir!r} was generated from. Restore the original input, or pass "
                    "data.overwrite=true to start over"
                )
        logger.info(
            "input unchanged for the %d window(s) already processed (checked in %.1f s)",
            len(specs), time.monotonic() - t0,
        )  # fmt: skip

    # -------------------------------------------------------------------------------- nothing to do
    def _nothing_to_do(self) -> JobResult:
        plan, outdir, m = self.plan, self.outdir, self.manifest
        assert plan is not None and outdir is not None and m is not None
        d = plan.cfg.data
        if m.num_windows == 0:
            msg = f"nothing to do: shard {d.shard.index}/{d.shard.count} of the input has no rows"
        else:
            msg = f"nothing to do: {outdir.path} already holds the complete output ({m.num_windows} windows)"
        frac = error_fraction(m)
        rp = outdir.report_path
        if frac > plan.cfg.run.max_error_fraction:
            msg += (
                f", but {frac:.1%} of its rows are error rows, more than run.max_error_fraction="
                f"{plan.cfg.run.max_error_fraction:g} (exit status {EXIT_TOO_MANY_ERRORS})"
            )
            if m.retry_rows:
                msg += (
                    f"; {m.retry_rows} of them may be retried: fix the cause and add data.retry_errors=true"
                )
            logger.error(msg)
            if self.print_summary:
                print(msg)
            return JobResult(EXIT_TOO_MANY_ERRORS, "failed", str(outdir.path), str(rp) if rp.is_file() else None,
                             message=msg)  # fmt: skip
        logger.info(msg)
        if self.print_summary:
            print(msg)
        return JobResult(
            EXIT_OK, "complete", str(outdir.path), str(rp) if rp.is_file() else None, message=msg
        )

    # ------------------------------------------------------------------------------------- windows
    def _windows(self, todo: list[_Todo], tokenizer_ref: list[Any]) -> Iterator[WindowWork]:
        """Each window to do as a WindowWork: read, prompts built with ``tokenizer_ref[0]``, rows already done
        skipped (their output rows loaded as pieces)."""
        plan, outdir = self.plan, self.outdir
        assert plan is not None and outdir is not None
        by_index = {t.spec.index: t for t in todo}
        extra_cols = list(dict.fromkeys([f.name for f in plan.part_layout.kept] + (
            [plan.cfg.data.id_column] if plan.cfg.data.id_column else [])))  # fmt: skip
        for win in iter_windows(plan.input, [t.spec for t in todo], plan.columns, schema=plan.read_schema):
            yield self._work(win, by_index[win.index], tokenizer_ref[0], extra_cols)

    def _work(self, win: Window, t: _Todo, tokenizer: Any, extra_cols: list[str]) -> WindowWork:
        plan, outdir, m = self.plan, self.outdir, self.manifest
        assert plan is not None and outdir is not None and m is not None
        n = plan.cfg.sampling.n
        pieces: list[pa.Table] = []
        if t.retry_part:
            part = part_as_piece(outdir.read_part(win.index), n)
            retry = set(t.retry_rows)
            keep = [i for i, p in enumerate(part.column("_position").to_pylist()) if p not in retry]
            pieces.append(part.take(pa.array(keep, type=pa.int64())))
        for piece in outdir.checkpoint_pieces(win.index):
            if plan.cfg.data.retry_errors:  # checkpointed error rows caused by settings are recomputed too
                piece = piece.filter(pc.invert(piece.column("_retryable")))
            pieces.append(piece)
        done: set[int] = set()
        for p in pieces:
            done.update(p.column("_position").to_pylist())
        rows = build_prompts(win.table, win.spec.row_start, plan.prompt_spec, tokenizer, win.unreadable)
        extra = win.table.select(extra_cols) if extra_cols else None
        for i, name in enumerate(extra_cols):
            # the id and kept columns are copied into the output as they are, except text that is not UTF-8:
            # its row is an error row, and the value is written with U+FFFD for the bad bytes (readable)
            fixed, bad = sanitize_utf8(extra.column(i))  # type: ignore[union-attr]
            if bad:
                extra = extra.set_column(i, name, fixed)  # type: ignore[union-attr]
                for pos, byte in bad.items():
                    r = rows[pos]
                    r.fail(f"column {name!r} is not valid UTF-8 at byte {byte}")
                    r.token_ids = r.params = None
        work = WindowWork.create(
            win.spec, rows, plan.cfg.data.group_by_prefix, extra=extra, skip=frozenset(done)
        )
        work.pieces = pieces
        work.input_sha256 = None if win.unreadable else window_sha256(win.table)
        return work

    def _preflight(self, works: Iterator[WindowWork], tokenizer: Any) -> list[WindowWork]:
        """Read windows until :data:`EARLY_ROWS` rows to do are in hand; ConfigError when every one of them
        fails before generation (or could never fit in a KV pool of ``engine.num_blocks``). Returns the
        windows read (they are fed first)."""
        plan = self.plan
        assert plan is not None
        got: list[WindowWork] = []
        rows: list[PromptRow] = []
        for work in works:
            got.append(work)
            rows += [work.rows[p] for p in work.todo_positions]
            if len(rows) >= EARLY_ROWS:
                break
        if not rows or not self.hold:
            return got
        e = plan.cfg.engine
        failing: list[str] = []
        for r in rows:
            if r.error is not None:
                failing.append(r.error)
            elif e.num_blocks is not None:
                p = r.params
                longest = min(len(r.token_ids or []) + ((p.max_tokens if p else None) or plan.prompt_spec.max_model_len),
                              plan.prompt_spec.max_model_len)  # fmt: skip
                need = -(-longest // e.block_size)
                if need > e.num_blocks:
                    failing.append(
                        f"prompt ({len(r.token_ids or [])} tokens) plus max_tokens needs {need} KV blocks but "
                        f"engine.num_blocks={e.num_blocks}"
                    )
        if len(failing) == len(rows):
            raise ConfigError(self._impossible(len(rows), failing, "before generation"))
        return got

    def _impossible(self, n: int, errors: list[str], when: str) -> str:
        counts = collections.Counter(_error_key(x) for x in errors)
        example = {}
        for x in errors:
            example.setdefault(_error_key(x), x)
        top = "; ".join(f"{c} x {example[k]!r}" for k, c in counts.most_common(3))
        return (
            f"every row fails {when}: all {n} of the first rows did ({top}). The configuration makes the job "
            "impossible; fix it (engine.max_model_len, engine.num_blocks / kv_cache_memory, sampling.max_tokens, "
            "the chat template, data.prompt_column ...) and rerun — nothing was written. To write such rows as "
            "error rows anyway, set run.max_error_fraction=1"
        )

    # ------------------------------------------------------------------------------------ execution
    def _execute(self, todo: list[_Todo]) -> JobResult:
        plan, outdir, m = self.plan, self.outdir, self.manifest
        assert plan is not None and outdir is not None and m is not None
        cfg = plan.cfg
        self.hold = cfg.run.max_error_fraction < 1.0 and not any(
            r.rows_ok for r in m.windows.values()
        ) and not any(p.rows_ok for p in m.partial.values())  # fmt: skip
        retry_rows = sum(len(t.retry_rows) for t in todo)
        d = cfg.data
        logger.info(
            "input: %d file(s), %d rows; shard %d/%d = rows [%d, %d); %d window(s) of %d rows, %d to do%s; output: %s",
            len(plan.input.files), plan.input.num_rows, d.shard.index, d.shard.count, plan.row_start,
            plan.row_end, len(plan.windows), d.window_rows, len(todo),
            f" ({retry_rows} error rows to retry)" if retry_rows else "", outdir.path,
        )  # fmt: skip
        if cfg.task == "score":
            return self._execute_score(todo)

        tokenizer = self.engine.tokenizer if self.engine is not None else _load_tokenizer(plan)
        _require_chat_template(plan, tokenizer)
        plan.prompt_spec.max_model_len = cfg.engine.max_model_len or plan.model_max_len
        tokenizer_ref = [tokenizer]
        works = self._windows(todo, tokenizer_ref)
        first = self._preflight(works, tokenizer)
        self._check_stop("start-up")

        engine = self.engine
        if engine is None:
            engine = self.engine = _start_engine(plan)
        self._check_stop("start-up")
        tokenizer_ref[0] = engine.tokenizer
        plan.prompt_spec.max_model_len = engine.max_model_len
        ahead = ReadAhead(works)  # the next window is read and tokenised while the engine runs
        before = engine.stats.snapshot()

        t_run = time.monotonic()
        self.progress = Progress(
            total=plan.row_end - plan.row_start,
            initial=m.rows_done - retry_rows,
            mode=cfg.run.progress,
            interval_s=cfg.run.log_interval_s,
        )
        queue = iter(first)

        def next_window() -> WindowWork | None:
            work = next(queue, None) or next(ahead, None)
            if work is not None:
                for p in work.todo_positions:
                    r = work.rows[p]
                    if r.error is not None:
                        self._count(False, r.error)
            return work

        max_in_flight = max(1, 2 * cfg.engine.max_num_seqs // cfg.sampling.n)
        self.feeder = EngineFeeder(
            engine, next_window, max_in_flight, self.stop, on_output=self._on_output, on_step=self._on_step
        )
        for work in self.feeder.run():
            self._window_finished(work)
        if self.stop.requested:
            self.save_finished_rows()
        elif self.held:
            self._check_impossible(final=True)
            self._release_held()
        self.progress.close()
        self.progress = None
        wall = time.monotonic() - t_run
        stats = engine.stats.delta(before)
        status = "complete" if m.complete else "incomplete"
        report = self._report(status, wall, {"startup_s": round(t_run - self.t_start, 3)}, stats)
        return self._finish(report)

    def _execute_score(self, todo: list[_Todo]) -> JobResult:
        """``task=score``: log-likelihoods instead of generations (:mod:`batchgen.job.score`), a window at a
        time (the unit of resume)."""
        from batchgen.job.score import run_score_windows

        plan, m = self.plan, self.manifest
        assert plan is not None and self.outdir is not None and m is not None
        engine = self.engine
        if engine is None:
            engine = self.engine = _start_engine(plan)
        self._check_stop("start-up")
        before = engine.stats.snapshot()
        t_run = time.monotonic()
        cfg = plan.cfg
        self.progress = Progress(
            total=plan.row_end - plan.row_start,
            initial=m.rows_done,
            mode=cfg.run.progress,
            interval_s=cfg.run.log_interval_s,
        )
        try:
            specs = [t.spec for t in todo]
            self.windows_done, self.rows_done = run_score_windows(
                plan, self.outdir, engine, specs, self.stop, self.progress
            )
        finally:
            self.progress.close()
            self.progress = None
        wall = time.monotonic() - t_run
        status = "complete" if m.complete else "incomplete"
        report = self._report(
            status, wall, {"startup_s": round(t_run - self.t_start, 3)}, engine.stats.delta(before)
        )
        return self._finish(report)

    def _count(self, ok: bool, error: str | None) -> None:
        self.rows_finished += 1
        if not ok and error is not None:
            key = _error_key(error)
            self.errors[key] += 1
            self.error_examples.setdefault(key, error)
        if self.progress is not None:
            self.progress.update(1)

    def _on_output(self, work: WindowWork, pos: int, out: RequestOutput) -> None:
        ok = not out.error and all(c.finish_reason != "error" for c in out.outputs)
        self._count(ok, out.error or (None if ok else "generation failed"))
        self.engine_done += 1
        self.engine_ok += ok
        if ok and len(self.examples) < 8 * NUM_EXAMPLES and out.outputs:
            self.examples.append((out.prompt_token_ids, out.outputs[0].text))
        if not ok:
            key = _error_key(out.error or "generation failed")
            self.engine_errors[key] += 1
        if ok and self.hold:
            self.hold = False
            self._release_held()

    def _on_step(self) -> None:
        assert self.progress is not None and self.engine is not None
        self.progress.update(0, stats=self.engine.stats)
        if self.hold:
            self._check_impossible()
            return
        interval = self.plan.cfg.run.checkpoint_interval_s  # type: ignore[union-attr]
        if interval > 0 and time.monotonic() - self.last_checkpoint >= interval:
            self._checkpoint(list(self.feeder.active.values()) if self.feeder else [])

    def _check_impossible(self, final: bool = False) -> None:
        """While nothing has succeeded: ConfigError once the first EARLY_ROWS rows the engine finished (or,
        at the end, all of them) failed there."""
        if self.engine_ok == 0 and (self.engine_done >= EARLY_ROWS or (final and self.engine_done)):
            errors = [self.error_examples[k] for k, c in self.engine_errors.items() for _ in range(c)]
            self.held.clear()
            raise ConfigError(self._impossible(self.engine_done, errors, "in the engine"))

    def _release_held(self) -> None:
        held, self.held = self.held, []
        for work in held:
            self._commit(work)

    def _window_finished(self, work: WindowWork) -> None:
        if self.hold:
            self.held.append(work)
            self._check_impossible()
        else:
            self._commit(work)

    # --------------------------------------------------------------------------------------- writing
    def _commit(self, work: WindowWork) -> None:
        plan, outdir = self.plan, self.outdir
        assert plan is not None and outdir is not None
        spec = work.spec
        fresh = build_rows(plan.part_layout, work.rows, work.results, work.extra, only=work.todo_positions)
        meta = {"index": spec.index, "row_start": spec.row_start, "row_end": spec.row_end}
        table, st = assemble_part(plan.part_layout, [*work.pieces, fresh], spec.num_rows, meta)
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
            retry_rows=st.retry_rows,
            input_sha256=work.input_sha256,
        )
        outdir.commit(spec.index, table, record)
        self.windows_done += 1
        self.rows_done += len(work.todo_positions)

    def _checkpoint(self, works: list[WindowWork]) -> int:
        """Write the rows finished (and not yet checkpointed) of unfinished windows; returns how many."""
        plan, outdir = self.plan, self.outdir
        assert plan is not None and outdir is not None
        self.last_checkpoint = time.monotonic()
        total = 0
        for work in sorted(works, key=lambda w: w.spec.index):
            new = [p for p in work.finished_positions() if p not in work.checkpointed]
            if not new:
                continue
            piece = build_rows(plan.part_layout, work.rows, work.results, work.extra, only=new)
            ok = sum(
                1
                for p in new
                if work.rows[p].error is None and not (work.results[p] and work.results[p].error)  # type: ignore[union-attr]
            )
            outdir.write_checkpoint(work.spec.index, piece, len(new), ok, work.input_sha256)
            work.checkpointed.update(new)
            total += len(new)
        if total:
            logger.info("checkpointed %d finished row(s) of %d unfinished window(s)", total, len(works))
        return total

    def save_finished_rows(self) -> bool:
        """After a stop or an error: commit held windows and checkpoint every finished row of the windows in
        flight. Best effort (a full disk, a second Ctrl-C); returns whether anything is on disk."""
        if self.outdir is None or self.manifest is None or self.feeder is None:
            return False
        try:
            if self.held:
                self._release_held()
                self.hold = False
            self._checkpoint(self.feeder.unfinished_windows())
        except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - keep the first error's message
            logger.warning("could not save every finished row (%s)", _one_line(e) or type(e).__name__)
        return self.manifest.committed_anything

    # ------------------------------------------------------------------------------------------ end
    def _report(self, status: str, wall: float, extra: dict[str, Any], stats: Any = None) -> dict[str, Any]:
        from batchgen.engine.stats import EngineStats

        plan, outdir, m = self.plan, self.outdir, self.manifest
        assert plan is not None and outdir is not None and m is not None
        frac = error_fraction(m)
        top = [(self.error_examples[k], c) for k, c in self.errors.most_common(3)]
        report = build_report(
            status=status,
            output_dir=str(outdir.path),
            manifest=m,
            wall_time_s=wall,
            rows_this_run=self.rows_done,
            windows_this_run=self.windows_done,
            engine_stats=stats if stats is not None else EngineStats(),
            model=plan.cfg.model.path or "tiny-default",
            extra={
                **extra,
                "interrupted_by": self.stop.signal_name,
                "shard": m.shard,
                "batchgen_version": batchgen.__version__,
                "errors": {
                    "fraction": frac,
                    "max_fraction": plan.cfg.run.max_error_fraction,
                    "exceeded": status == "complete" and frac > plan.cfg.run.max_error_fraction,
                    "top": top,
                },
            },
        )
        if report["errors"]["exceeded"]:
            report["status"] = "failed"
        try:
            write_report(outdir.report_path, report)
        except OSError as e:  # the output is what counts: a report that cannot be written is only a warning
            logger.warning("could not write %s: %s", outdir.report_path, _one_line(e))
        return report

    def _finish(self, report: dict[str, Any]) -> JobResult:
        """The result (0 complete, 3 too many error rows, 75 stopped early), logged and printed with the table."""
        plan, outdir, m = self.plan, self.outdir, self.manifest
        assert plan is not None and outdir is not None and m is not None
        err = report["errors"]
        if m.complete and err["exceeded"]:
            msg = (
                f"failed: {report['rows']['error']} of {report['rows']['shard_total']} rows ({err['fraction']:.1%}) "
                f"are error rows, more than run.max_error_fraction={err['max_fraction']:g}; output and report in "
                f"{outdir.path} (exit status {EXIT_TOO_MANY_ERRORS})"
            )
            if m.retry_rows:
                msg += f"; {m.retry_rows} may be retried: fix the cause and rerun with data.retry_errors=true"
            code, status = EXIT_TOO_MANY_ERRORS, "failed"
        elif m.complete:
            msg = f"done: {len(plan.windows)} part(s) in {outdir.path}; report: {outdir.report_path}"
            code, status = EXIT_OK, "complete"
        else:
            left = m.num_windows - len(m.windows)
            why = f"stopped by {self.stop.signal_name}" if self.stop.signal_name else "stopped"
            msg = (
                f"incomplete ({why}): {len(m.windows)}/{m.num_windows} windows complete and "
                f"{sum(p.rows for p in m.partial.values())} finished rows of {left} unfinished window(s) saved "
                f"in {outdir.path}; rerun the same command to resume (exit status {EXIT_INTERRUPTED})"
            )
            code, status = EXIT_INTERRUPTED, "incomplete"
        (logger.error if code == EXIT_TOO_MANY_ERRORS else logger.info)(msg)
        if self.print_summary:
            print(format_table(report))
            print(self._examples_text())
            print(msg)
        return JobResult(code, status, str(outdir.path), str(outdir.report_path), report, msg)

    def _examples_text(self) -> str:
        """A few rows of this run (prompt tail → generated text) and how to read the whole output."""
        out = str(self.outdir.path) if self.outdir is not None else self.out_dir
        lines = []
        tokenizer = getattr(self.engine, "tokenizer", None) if self.examples else None
        # The longest of the first finished rows: the ones that show most of what the model does.
        shown = sorted(self.examples, key=lambda e: -len(e[1].split()))[:NUM_EXAMPLES]
        for prompt_ids, text in shown:
            prompt = tokenizer.decode(prompt_ids[-24:], skip_special_tokens=True) if tokenizer else ""
            prompt = " ".join(prompt.split())
            lines.append(f"  …{prompt[-60:]!s} → {' '.join(text.split())[:100]!r}")
        head = ["examples:", *lines] if lines else []
        return "\n".join(
            [
                *head,
                f"read the output: batchgen show {out}  |  pandas.read_parquet({out!r})  |  "
                f"duckdb: SELECT * FROM read_parquet('{out}/**/*.parquet')",
            ]
        )


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
            f"model.path: cannot load the tokenizer of {plan.model_path!r}: {_one_line(e)}"
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
    except MemoryError as err:
        raise ConfigError(
            f"not enough memory to start the engine (engine.kv_cache_memory={e.kv_cache_memory}, "
            f"engine.num_blocks={e.num_blocks}, engine.gpu_memory_utilization={e.gpu_memory_utilization}): "
            f"{_one_line(err) or 'MemoryError'}; lower the KV cache size"
        ) from err
    except Exception as err:  # noqa: BLE001 - a model that does not load is a configuration problem
        if type(err).__name__ == "OutOfMemoryError":
            raise ConfigError(
                f"out of device memory starting the engine: {_one_line(err)}; lower "
                "engine.gpu_memory_utilization or engine.max_num_batched_tokens"
            ) from err
        where = plan.cfg.model.path or "the embedded tiny model"
        raise ConfigError(f"cannot start the engine for model.path={where!r}: {_one_line(err)}") from err


def _require_chat_template(plan: JobPlan, tokenizer: Any) -> None:
    if plan.cfg.data.messages_column and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"data.messages_column is set but the tokenizer of {plan.model_path!r} has no chat template"
        )
