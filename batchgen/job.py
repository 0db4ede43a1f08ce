"""The batch job: Parquet rows → prompts → prefix-grouped engine → Parquet parts, resumable.

``run_job(config)`` does, in order:

1. *Plan* (no model yet): resolve the input files and their row counts, check the columns, compute this
   shard's row range and windows, fingerprint the configuration, open (lock, clean, check) the output
   directory. Any problem here is a :class:`~batchgen.config.ConfigError` → exit status 2, before any work.
2. If the manifest already lists every window: nothing to do (exit 0).
3. Start the engine; stream the unfinished windows through prompts → grouping → engine; each window whose
   rows are all finished becomes one part file, committed atomically, then recorded in the manifest.
4. Write ``report.json``, print the summary table.

Signals: SIGINT, SIGTERM and SIGUSR1 stop admission; windows already started are finished for up to
``run.stop_grace_s`` seconds (default 0: abandoned at once), finished windows are already on disk, and the
job returns exit status 75 (EX_TEMPFAIL: rerun the same command to resume). A second SIGINT aborts at once
(still 75; the manifest is consistent at every instant).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa

import batchgen
from batchgen.config import ConfigError, JobConfig, sampling_kwargs, to_job_config
from batchgen.data.manifest import Manifest, WindowRecord
from batchgen.data.prompts import PromptSpec, build_prompts, struct_override_problems
from batchgen.data.reader import InputSet, iter_windows, open_input, plan_windows, shard_range
from batchgen.data.writer import OutputDir, PartLayout, build_part
from batchgen.grouping import EngineFeeder, WindowWork
from batchgen.progress import Progress
from batchgen.report import build_report, format_table, write_report

logger = logging.getLogger("batchgen.job")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: incomplete, rerun to resume

DEFAULT_SAMPLING_COLUMN = "sampling"


def sample_input_path() -> str:
    """The small sample Parquet shipped with batchgen (used when data.input is null)."""
    return str(resources.files("batchgen") / "sample_data" / "prompts.parquet")


@dataclass
class JobResult:
    """What a job run ended with; ``exit_code`` is the CLI's exit status."""

    exit_code: int
    status: str  # "complete" | "incomplete" | "error"
    output_dir: str
    report_path: str | None = None
    report: dict[str, Any] | None = None
    message: str = ""


# ------------------------------------------------------------------------------------------- signals
class StopSignal:
    """Set when the job should stop: ``requested`` and the grace ``deadline`` (time.monotonic)."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self, grace_s: float = 0.0) -> None:
        self.grace_s = grace_s
        self.requested = False
        self.deadline: float | None = None
        self.signal_name: str | None = None

    def request(self, name: str = "stop") -> None:
        if not self.requested:
            self.requested = True
            self.signal_name = name
            self.deadline = time.monotonic() + self.grace_s

    def _handler(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.request(name)
        msg = (
            f"received {name}: no new rows are admitted; "
            + (f"finishing started windows for up to {self.grace_s:g} s, " if self.grace_s else "")
            + "then saving and exiting with status 75 (rerun to resume)"
            + ("; press Ctrl-C again to abort at once" if signum == signal.SIGINT else "")
        )
        logger.warning(msg)

    @staticmethod
    def signal_names() -> tuple[tuple[str, ...], str | None]:
        """(signals to handle, signal to hand on to the previous handler after the flush).

        Inside a submitit job, submitit owns SIGTERM (it ignores it: Slurm requeues preempted tasks) and its
        preemption signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default: checkpoint, requeue, exit). We leave
        SIGTERM to it, and treat its signal like SIGUSR1 — stop and flush — then pass it on so submitit
        requeues the task.
        """
        import os

        if not os.environ.get("SUBMITIT_EXECUTOR"):
            return StopSignal.SIGNALS, None
        sub = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")
        names = tuple(n for n in StopSignal.SIGNALS if n != "SIGTERM")
        return (*names, sub) if sub not in names else names, sub

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignal]:
        """Install the handlers (main thread only) for the duration of the block, then restore them (and hand
        submitit's preemption signal on to submitit, see :meth:`signal_names`)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        names, hand_on = self.signal_names()
        old = {}
        for name in names:
            sig = getattr(signal, name, None)
            if sig is not None:
                old[sig] = signal.signal(sig, self._handler)
        try:
            yield self
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            if hand_on is not None and self.signal_name == hand_on:
                sig = getattr(signal, hand_on)
                previous = old.get(sig)
                if callable(previous):
                    previous(sig, None)


# ------------------------------------------------------------------------------------------ planning
def model_fingerprint(path: str) -> str:
    """Hash of a checkpoint's configs, tokenizer files and safetensors headers (not the full weights)."""
    h = hashlib.sha256()
    p = Path(path)
    for name in sorted(os.listdir(p)):
        f = p / name
        if not f.is_file():
            continue
        if name.endswith(".json") or name.endswith(".jinja") or name in ("tokenizer.model",):
            h.update(f"{name}\0".encode() + hashlib.sha256(f.read_bytes()).digest())
        elif name.endswith(".safetensors"):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = fh.read(min(n, 100_000_000))
            h.update(f"{name}\0{f.stat().st_size}\0".encode() + hashlib.sha256(header).digest())
    return h.hexdigest()


@dataclass
class JobPlan:
    """Everything decided before the model is loaded."""

    cfg: JobConfig
    input: InputSet
    model_path: str
    columns: list[str]
    prompt_spec: PromptSpec
    row_start: int
    row_end: int
    windows: list[Any]
    fingerprint: str
    fingerprint_config: dict[str, Any]
    layout_meta: dict[str, Any]


def _check_columns(cfg: JobConfig, inp: InputSet) -> tuple[list[str], str | None]:
    d = cfg.data

    def need(name: str, key: str) -> None:
        missing = [f.rel_path for f in inp.files if f.schema.get_field_index(name) < 0]
        if missing:
            avail = ", ".join(inp.columns[:30])
            where = (
                "the input"
                if len(missing) == len(inp.files)
                else f"{len(missing)} file(s), e.g. {missing[0]!r}"
            )
            raise ConfigError(f"{key}: column {name!r} is missing from {where} (columns: {avail})")

    if d.messages_column:
        need(d.messages_column, "data.messages_column")
        source = d.messages_column
    else:
        need(d.prompt_column, "data.prompt_column")
        source = d.prompt_column
    if d.id_column:
        need(d.id_column, "data.id_column")
    for c in d.keep_columns:
        need(c, "data.keep_columns")
    sampling_col = d.sampling_column
    if sampling_col:
        if not inp.has_column(sampling_col):
            if sampling_col == DEFAULT_SAMPLING_COLUMN and inp.column_type(sampling_col) is None:
                sampling_col = None  # the default name, absent: no per-row overrides
            else:
                need(sampling_col, "data.sampling_column")
        if sampling_col:
            problem = struct_override_problems(inp.column_type(sampling_col))
            if problem:
                raise ConfigError(f"data.sampling_column: column {sampling_col!r} {problem}")
    columns = list(dict.fromkeys([source] + ([d.id_column] if d.id_column else []) + list(d.keep_columns)))
    if sampling_col:
        columns = list(dict.fromkeys(columns + [sampling_col]))
    return columns, sampling_col


def plan_job(cfg: JobConfig) -> JobPlan:
    """Resolve input, columns, shard, windows, model and fingerprints; raises ConfigError on any problem."""
    d = cfg.data
    inp = open_input(d.input if d.input else sample_input_path())
    columns, sampling_col = _check_columns(cfg, inp)
    row_start, row_end = shard_range(inp.num_rows, d.shard.index, d.shard.count)
    windows = plan_windows(row_start, row_end, d.window_rows)

    if cfg.model.path:
        model_path = os.path.expanduser(cfg.model.path)
        if not os.path.isdir(model_path) or not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(
                f"model.path: {cfg.model.path!r} is not a Hugging Face checkpoint directory (no config.json)"
            )
    else:
        from batchgen.models.tiny import tiny_default_checkpoint

        model_path = tiny_default_checkpoint()
    mfp = model_fingerprint(model_path)

    sampling = sampling_kwargs(cfg.sampling)
    fp_config = {
        "model": {"fingerprint": mfp, "dtype": cfg.model.dtype},
        "data": {
            "prompt_column": None if d.messages_column else d.prompt_column,
            "messages_column": d.messages_column,
            "id_column": d.id_column,
            "keep_columns": list(d.keep_columns),
            "sampling_column": sampling_col,
            "window_rows": d.window_rows,
        },
        "sampling": sampling,
        "engine": {"max_model_len": cfg.engine.max_model_len},
    }
    fingerprint = hashlib.sha256(json.dumps(fp_config, sort_keys=True, default=str).encode()).hexdigest()
    spec = PromptSpec(
        prompt_column=d.prompt_column,
        messages_column=d.messages_column,
        id_column=d.id_column,
        sampling_column=sampling_col,
        base_sampling=sampling,
    )
    layout_meta = {
        "batchgen_version": batchgen.__version__,
        "model": {"path": cfg.model.path or "tiny-default", "fingerprint": mfp, "dtype": cfg.model.dtype},
        "sampling": sampling,
        "prompt": {"messages_column": d.messages_column}
        if d.messages_column
        else {"prompt_column": d.prompt_column},
        "sampling_column": sampling_col,
        "id_column": d.id_column,
        "input": {"fingerprint": inp.fingerprint, "num_files": len(inp.files), "num_rows": inp.num_rows},
        "shard": {"index": d.shard.index, "count": d.shard.count},
        "engine": {"max_model_len": cfg.engine.max_model_len},
    }
    return JobPlan(
        cfg, inp, model_path, columns, spec, row_start, row_end, windows, fingerprint, fp_config, layout_meta
    )


def _fresh_manifest(plan: JobPlan) -> Manifest:
    d = plan.cfg.data
    return Manifest(
        fingerprint=plan.fingerprint,
        config=plan.fingerprint_config,
        input=plan.input.describe(),
        shard={
            "index": d.shard.index,
            "count": d.shard.count,
            "row_start": plan.row_start,
            "row_end": plan.row_end,
        },
        window_rows=d.window_rows,
        num_windows=len(plan.windows),
        batchgen_version=batchgen.__version__,
    )


def _layout(plan: JobPlan) -> PartLayout:
    d = plan.cfg.data
    inp = plan.input

    def plain(t: pa.DataType | None) -> pa.DataType:
        if t is None:
            return pa.null()
        return t.value_type if pa.types.is_dictionary(t) else t

    id_type = plain(inp.column_type(d.id_column)) if d.id_column else pa.int64()
    kept = [
        pa.field(c, inp.column_type(c)) for c in d.keep_columns if not (c == "id" and d.id_column == "id")
    ]
    return PartLayout(
        id_type=id_type,
        kept=kept,
        n=plan.cfg.sampling.n,
        logprobs=plan.cfg.sampling.logprobs is not None,
        metadata=plan.layout_meta,
    )


# ------------------------------------------------------------------------------------------- running
def _make_engine(plan: JobPlan) -> Any:
    from batchgen.engine.llm_engine import LLMEngine

    cfg = plan.cfg
    try:
        return LLMEngine(plan.model_path, cfg.engine, dtype=cfg.model.dtype)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"cannot start the engine: {e}") from e


def _max_model_len(engine: Any, cfg: JobConfig) -> int:
    for v in (
        getattr(engine, "max_model_len", None),
        getattr(getattr(engine, "stats", None), "max_model_len", None),
    ):
        if isinstance(v, int) and v > 0:
            return v
    return cfg.engine.max_model_len or (1 << 30)


def run_job(
    cfg: Any,
    *,
    engine: Any = None,
    stop: StopSignal | None = None,
    handle_signals: bool = True,
    print_summary: bool = True,
) -> JobResult:
    """Run the job described by `cfg` (a JobConfig or a composed DictConfig).

    `engine` (optional) is an already started engine to use instead of building one (tests). Returns a
    JobResult; configuration/input problems are returned as exit code 2 with the message, not raised.
    """
    t_start = time.monotonic()
    out_dir = "?"
    try:
        cfg = to_job_config(cfg)
        out_dir = cfg.data.output
        plan = plan_job(cfg)
        outdir = OutputDir(cfg.data.output, cfg.data.shard.index, cfg.data.shard.count)
        out_dir = str(outdir.path)
        manifest = outdir.open(_fresh_manifest(plan), overwrite=cfg.data.overwrite)
    except ConfigError as e:
        logger.error("%s", e)
        return JobResult(EXIT_CONFIG, "error", out_dir, message=str(e))

    stop = stop or StopSignal(cfg.run.stop_grace_s)
    with outdir, stop.installed() if handle_signals else contextlib.nullcontext(stop):
        if manifest.complete:
            if manifest.num_windows == 0:
                msg = f"nothing to do: shard {cfg.data.shard.index}/{cfg.data.shard.count} of the input has no rows"
            else:
                msg = f"nothing to do: {out_dir} already holds the complete output ({manifest.num_windows} windows)"
            logger.info(msg)
            if print_summary:
                print(msg)
            rp = outdir.report_path
            return JobResult(EXIT_OK, "complete", out_dir, str(rp) if rp.is_file() else None, message=msg)
        try:
            return _execute(plan, outdir, manifest, engine, stop, t_start, print_summary)
        except ConfigError as e:
            logger.error("%s", e)
            return JobResult(EXIT_CONFIG, "error", out_dir, message=str(e))
        except KeyboardInterrupt:
            msg = f"aborted; finished windows are saved in {out_dir}: rerun the same command to resume"
            logger.warning(msg)
            return JobResult(EXIT_INTERRUPTED, "incomplete", out_dir, message=msg)


def _execute(
    plan: JobPlan,
    outdir: OutputDir,
    manifest: Manifest,
    engine: Any,
    stop: StopSignal,
    t_start: float,
    print_summary: bool,
) -> JobResult:
    cfg = plan.cfg
    todo = [w for w in plan.windows if w.index not in manifest.windows]
    rows_before = sum(r.row_end - r.row_start for r in manifest.windows.values())
    logger.info(
        "input: %d file(s), %d rows; shard %d/%d = rows [%d, %d); %d window(s) of %d rows, %d to do; output: %s",
        len(plan.input.files), plan.input.num_rows, cfg.data.shard.index, cfg.data.shard.count,
        plan.row_start, plan.row_end, len(plan.windows), cfg.data.window_rows, len(todo), outdir.path,
    )  # fmt: skip

    if engine is None:
        if cfg.data.messages_column:  # fail fast, before loading weights, if chat cannot work
            from batchgen.models.loader import load_tokenizer

            if getattr(load_tokenizer(plan.model_path), "chat_template", None) is None:
                raise ConfigError(
                    f"data.messages_column is set but the tokenizer of {plan.model_path!r} has no chat template"
                )
        engine = _make_engine(plan)
    tokenizer = engine.tokenizer
    if cfg.data.messages_column and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("data.messages_column is set but the model's tokenizer has no chat template")
    plan.prompt_spec.max_model_len = _max_model_len(engine, cfg)
    layout = _layout(plan)
    stats0 = (
        dataclasses.replace(engine.stats)
        if dataclasses.is_dataclass(getattr(engine, "stats", None))
        else None
    )

    progress = Progress(
        total=plan.row_end - plan.row_start,
        initial=rows_before,
        mode=cfg.run.progress,
        interval_s=cfg.run.log_interval_s,
    )
    windows_iter = iter_windows(plan.input, todo, plan.columns)

    def next_window() -> WindowWork | None:
        w = next(windows_iter, None)
        if w is None:
            return None
        rows = build_prompts(w.table, w.spec.row_start, plan.prompt_spec, tokenizer)
        kept = w.table.select([f.name for f in layout.kept]) if layout.kept else None
        work = WindowWork.create(w.spec, rows, cfg.data.group_by_prefix, extra=kept)
        errors = sum(1 for r in rows if not r.ok)
        if errors:
            progress.update(errors)
        return work

    def on_output(work: WindowWork, pos: int, out: Any) -> None:
        progress.update(1)

    def on_step() -> None:
        progress.update(0, stats=getattr(engine, "stats", None))

    n = cfg.sampling.n
    max_in_flight = max(1, 2 * cfg.engine.max_num_seqs // n)
    feeder = EngineFeeder(engine, next_window, max_in_flight, stop, on_output, on_step)
    t_run = time.monotonic()
    windows_done = rows_done = 0
    try:
        for work in feeder.run():
            table, st = build_part(
                layout,
                work.rows,
                work.results,
                work.extra,
                {"index": work.spec.index, "row_start": work.spec.row_start, "row_end": work.spec.row_end},
            )
            rec = WindowRecord(
                part="",
                row_start=work.spec.row_start,
                row_end=work.spec.row_end,
                num_output_rows=st.num_output_rows,
                rows_ok=st.rows_ok,
                rows_error=st.rows_error,
                prompt_tokens=st.prompt_tokens,
                cached_tokens=st.cached_tokens,
                generated_tokens=st.generated_tokens,
                wall_time_s=round(work.finished_at - work.started_at, 3),
            )
            outdir.commit(work.spec.index, table, rec)
            windows_done += 1
            rows_done += work.spec.num_rows
    finally:
        progress.close()
    wall = time.monotonic() - t_run

    complete = manifest.complete
    status = "complete" if complete else "incomplete"
    stats = _delta_stats(stats0, getattr(engine, "stats", None))
    report = build_report(
        status=status,
        output_dir=str(outdir.path),
        manifest=manifest,
        wall_time_s=wall,
        rows_this_run=rows_done,
        windows_this_run=windows_done,
        engine_stats=stats,
        model=cfg.model.path or "tiny-default",
        extra={
            "startup_s": round(t_run - t_start, 3),
            "interrupted_by": stop.signal_name,
            "shard": manifest.shard,
            "batchgen_version": batchgen.__version__,
        },
    )
    write_report(outdir.report_path, report)
    if complete:
        msg = f"done: {len(plan.windows)} part(s) in {outdir.path}; report: {outdir.report_path}"
        code = EXIT_OK
    else:
        left = manifest.num_windows - len(manifest.windows)
        why = f"stopped by {stop.signal_name}" if stop.signal_name else "stopped"
        msg = (
            f"incomplete ({why}): {len(manifest.windows)}/{manifest.num_windows} windows saved in {outdir.path}, "
            f"{left} left; rerun the same command to resume (exit status {EXIT_INTERRUPTED})"
        )
        code = EXIT_INTERRUPTED
    logger.info(msg)
    if print_summary:
        print(format_table(report))
        print(msg)
    return JobResult(code, status, str(outdir.path), str(outdir.report_path), report, msg)


def _delta_stats(before: Any, after: Any) -> Any:
    """Engine stats of this job only when the engine was used before (tests reuse one engine)."""
    if after is None or before is None:
        return after
    counters = (
        "num_requests", "num_finished_requests", "num_error_requests", "prompt_tokens", "prompt_tokens_cached",
        "prompt_tokens_computed", "generated_tokens", "num_steps", "num_preemptions", "num_cow_copies",
    )  # fmt: skip
    delta = dataclasses.replace(after)
    for name in counters:
        if hasattr(delta, name):
            setattr(delta, name, getattr(after, name) - getattr(before, name))
    return delta


def exit_code_for(result: JobResult) -> int:
    return result.exit_code
