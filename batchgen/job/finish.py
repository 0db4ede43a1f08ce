"""The end of a run: ``_report.json``, the exit status and the lines printed (summary table, a few example rows,
how to read the output)."""

from __future__ import annotations

import json
import logging
from typing import Any

import batchgen
from batchgen.data.layout import REPORT_NAME
from batchgen.data.manifest import Manifest
from batchgen.data.output_dir import OutputDir
from batchgen.errors import ConfigError
from batchgen.job.plan import JobPlan
from batchgen.job.report import build_report, error_fraction, report_text, row_counts
from batchgen.job.result import EXIT_INTERRUPTED, EXIT_OK, EXIT_TOO_MANY_ERRORS, JobResult, one_line
from batchgen.job.tally import NUM_EXAMPLES, RowTally, all_adapter_rows

logger = logging.getLogger("batchgen.job")


def nothing_to_do(
    plan: JobPlan, outdir: OutputDir, m: Manifest, print_summary: bool, checked: tuple[int, float] = (0, 0.0)
) -> JobResult:
    """Every window is done (or the shard is empty): 0, or 3 when the output's error rows are too many.
    `checked`: (windows whose input was found unchanged, seconds that check took)."""
    d = plan.cfg.data
    if m.num_windows == 0:
        msg = f"nothing to do: shard {d.shard.index}/{d.shard.count} of the input has no rows"
    else:
        msg = f"nothing to do: {outdir.path} already holds the complete output ({m.num_windows} windows"
        msg += f"; input unchanged, checked in {checked[1]:.1f} s)" if checked[0] else ")"
    frac = error_fraction(m)
    rp = outdir.report_location if _report_of_complete_output(plan, outdir, m) else None
    if frac > plan.cfg.run.max_error_fraction:
        msg += (
            f", but {frac:.1%} of its rows are error rows, more than run.max_error_fraction="
            f"{plan.cfg.run.max_error_fraction:g} (exit status {EXIT_TOO_MANY_ERRORS})"
        )
        if m.retry_rows:
            msg += f"; {m.retry_rows} of them may be retried: fix the cause and add data.retry_errors=true"
        logger.error(msg)
        if print_summary:
            print(msg)
        return JobResult(EXIT_TOO_MANY_ERRORS, "failed", str(outdir.path), rp,
                         message=msg)  # fmt: skip
    logger.info(msg)
    if print_summary:
        print(msg)
    return JobResult(EXIT_OK, "complete", str(outdir.path), rp, message=msg)


def _report_of_complete_output(plan: JobPlan, outdir: OutputDir, m: Manifest) -> bool:
    """Make ``_report.json`` describe the complete output `m` when nothing is left to do; whether it does.

    Invariant: a complete output has a report whose row counts are the manifest's. A run killed after its last
    commit, before (or while) writing its report, left none, or an earlier stopped run's ``incomplete`` one:
    such a report is written again from the manifest (this run computed nothing). A report that already
    matches is kept as it is (it holds the figures of the run that finished the output)."""
    try:
        old = json.loads(outdir.loc.read_bytes(REPORT_NAME) or b"null")
    except (ValueError, ConfigError, OSError):
        old = None
    if (
        isinstance(old, dict)
        and old.get("status") in ("complete", "failed")
        and old.get("rows") == row_counts(m)
    ):
        return True
    tally = RowTally()
    tally.lora = bool(plan.cfg.model.lora_modules)  # the rows per adapter, from the manifest
    job_report(plan, outdir, m, tally, (0, 0), None, "complete", 0.0, {"startup_s": 0.0})
    return outdir.has_report()


def job_report(
    plan: JobPlan,
    outdir: OutputDir,
    m: Manifest,
    tally: RowTally,
    this_run: tuple[int, int],
    signal_name: str | None,
    status: str,
    wall: float,
    extra: dict[str, Any],
    stats: Any = None,
) -> dict[str, Any]:
    """Build and write ``_report.json`` (a write failure is only a warning); ``this_run``: the rows and
    windows this run committed. A complete run with too many error rows has status ``failed``."""
    from batchgen.engine.core.stats import EngineStats

    frac = error_fraction(m)
    top = [(tally.error_examples[k], c) for k, c in tally.errors.most_common(3)]
    report = build_report(
        status=status,
        output_dir=str(outdir.path),
        manifest=m,
        wall_time_s=wall,
        rows_this_run=this_run[0],
        windows_this_run=this_run[1],
        engine_stats=stats if stats is not None else EngineStats(),
        model=plan.cfg.model.path or "tiny-default",
        extra={
            "task": plan.cfg.task,
            **extra,
            "interrupted_by": signal_name,
            "shard": m.shard,
            "batchgen_version": batchgen.__version__,
            **({"lora": _lora_rows(m, tally)} if tally.lora else {}),
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
    from batchgen.job.plan_report import prediction_section, read_plan

    planned = read_plan(
        outdir
    )  # a dry run's _plan.json of this configuration: its predictions beside the run
    if planned is not None and "predicted" in planned and planned.get("fingerprint") == plan.fingerprint:
        report["prediction"] = prediction_section(planned, report)
    try:
        outdir.save_report(report_text(report))
    except (
        OSError,
        ConfigError,
    ) as e:  # the output is what counts: a report that cannot be written is a warning
        logger.warning("could not write %s: %s", outdir.report_location, one_line(e))
    return report


def _lora_rows(m: Manifest, tally: RowTally) -> dict[str, Any]:
    """The report's ``lora`` section: rows per adapter of this run, and of every committed window (all runs;
    ``uncounted_windows``: committed windows whose counts are not known)."""
    total, uncounted = all_adapter_rows(m.windows.values())
    out: dict[str, Any] = {"rows_this_run": tally.by_adapter, "rows": total}
    if uncounted:
        out["uncounted_windows"] = uncounted
    return out


def finish(
    plan: JobPlan, outdir: OutputDir, m: Manifest, report: dict[str, Any], signal_name: str | None
) -> JobResult:
    """The result (0 complete, 3 too many error rows, 75 stopped early), its message logged."""
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
        msg = f"done: {len(m.parts)} part(s) in {outdir.path}; report: {outdir.report_location}"
        code, status = EXIT_OK, "complete"
    else:
        left = m.num_windows - len(m.windows)
        why = f"stopped by {signal_name}" if signal_name else "stopped"
        partial = sum(p.rows for p in m.partial.values())
        msg = (
            f"incomplete ({why}): {len(m.windows)}/{m.num_windows} windows complete"
            + (f" and {partial} finished rows of {len(m.partial)} unfinished window(s)" if partial else "")
            + f" saved in {outdir.path}; {left} window(s) left: rerun the same command to resume "
            f"(exit status {EXIT_INTERRUPTED})"
        )
        code, status = EXIT_INTERRUPTED, "incomplete"
    (logger.error if code == EXIT_TOO_MANY_ERRORS else logger.info)(msg)
    return JobResult(code, status, str(outdir.path), outdir.report_location, report, msg)


def examples_text(out: str, examples: list[tuple[list[int], str]], tokenizer: Any) -> str:
    """A few rows of this run (prompt tail → generated text) and how to read the whole output in ``out``."""
    lines = []
    # The longest of the first finished rows: the ones that show most of what the model does.
    shown = sorted(examples, key=lambda e: -len(e[1].split()))[:NUM_EXAMPLES]
    for prompt_ids, text in shown:
        prompt = tokenizer.decode(prompt_ids[-24:], skip_special_tokens=True) if tokenizer else ""
        prompt = " ".join(prompt.split())
        lines.append(f"  …{prompt[-60:]!s} → {' '.join(text.split())[:100]!r}")
    head = ["examples:", *lines] if lines else []
    return "\n".join(
        [
            *head,
            "read the output: " + "  |  ".join(readers_of(out)),
        ]
    )


def readers_of(out: str) -> list[str]:
    """Ways to read the output directory `out` that work here: ``batchgen show`` and pyarrow (installed with
    batchgen), then pandas, polars and duckdb where they are installed."""
    import importlib.util

    ways = [f"batchgen show {out}", f"pyarrow.parquet.read_table({out!r})"]
    if importlib.util.find_spec("pandas") is not None:
        ways.append(f"pandas.read_parquet({out!r})")
    if importlib.util.find_spec("polars") is not None:
        ways.append(f"polars.read_parquet('{out}/**/*.parquet')")
    if importlib.util.find_spec("duckdb") is not None:
        ways.append(f"duckdb: SELECT * FROM read_parquet('{out}/**/*.parquet')")
    return ways
