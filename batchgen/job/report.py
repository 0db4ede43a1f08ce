"""The job report: ``_report.json`` beside the output and a table printed at the end.

Row counts (``rows.*``, ``errors.*``) cover the whole shard output so far (from the manifest, all runs,
checkpointed rows of unfinished windows included); throughput and engine figures (``run.*``, ``tokens.*``,
``kv.*``, ``scheduler.*``, and ``pooling.*`` of a task=embed / task=classify job) cover this run only. An
encoder's pooling job has no paged engine: its ``tokens``, ``kv`` and ``scheduler`` figures are zeros, and the
table shows the pooling figures instead. When the output directory holds a dry run's ``_plan.json``,
``prediction`` sets its predictions (wall time and range, tokens, prefix hit rate) beside this run's figures.
"""

from __future__ import annotations

import json
from typing import Any

from batchgen.data.manifest import Manifest
from batchgen.engine.core.stats import EngineStats


def row_counts(manifest: Manifest) -> dict[str, int]:
    """The report's ``rows`` section: the row counts of `manifest` (committed windows and checkpointed rows)."""
    recs = manifest.windows.values()
    parts = manifest.partial.values()
    return {
        "shard_total": manifest.shard.get("row_end", 0) - manifest.shard.get("row_start", 0),
        "done": manifest.rows_done,
        "ok": sum(r.rows_ok for r in recs) + sum(p.rows_ok for p in parts),
        "error": sum(r.rows_error for r in recs) + sum(p.rows - p.rows_ok for p in parts),
        "retryable": manifest.retry_rows,
        "checkpointed": sum(p.rows for p in parts),
        "output_rows": sum(r.num_output_rows for r in recs),
    }


def error_fraction(manifest: Manifest) -> float:
    """Error rows over the shard's rows (0 for an empty shard)."""
    r = row_counts(manifest)
    return r["error"] / r["shard_total"] if r["shard_total"] else 0.0


def _engine_figures(st: EngineStats) -> dict[str, dict[str, Any]]:
    """The ``tokens``, ``kv`` and ``scheduler`` sections, from the engine stats of this run."""
    return {
        "tokens": {
            "prompt_admitted": st.prompt_tokens,
            "prompt_computed": st.prompt_tokens_computed,
            "prompt_reused": st.prompt_tokens_cached,
            "prompt_copied": st.prompt_tokens_copied,
            "prefix_hit_rate": st.prefix_hit_rate,
            "generated": st.generated_tokens,
        },
        "kv": {
            "num_blocks": st.num_blocks,
            "block_size": st.block_size,
            "pool_bytes": st.num_blocks * st.bytes_per_block,
            "peak_usage": float(st.peak_kv_usage),
            "min_utilization": float(st.min_kv_utilization),
            "peak_fragmentation": float(st.peak_kv_fragmentation),
        },
        "scheduler": {
            "peak_running_seqs": st.peak_running_seqs,
            "preemptions": st.num_preemptions,
            "steps": st.num_steps,
            "cow_copies": st.num_cow_copies,
        },
    }


def build_report(
    *,
    status: str,
    output_dir: str,
    manifest: Manifest,
    wall_time_s: float,
    rows_this_run: int,
    windows_this_run: int,
    engine_stats: EngineStats,
    model: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the report dict (JSON-serialisable); `engine_stats` covers this run only."""
    wall = max(wall_time_s, 1e-9)
    report: dict[str, Any] = {
        "status": status,
        "output_dir": output_dir,
        "model": model,
        "rows": row_counts(manifest),
        "windows": {
            "total": manifest.num_windows,
            "done": len(manifest.windows),
            "this_run": windows_this_run,
        },
        "run": {
            "rows": rows_this_run,
            "wall_time_s": round(wall_time_s, 3),
            "rows_per_s": rows_this_run / wall,
            "generated_tokens_per_s": engine_stats.generated_tokens / wall,
        },
        **_engine_figures(engine_stats),
        "engine_stats": engine_stats.to_dict(),
    }
    report.update(extra or {})
    return report


POOLING_TASKS = ("embed", "classify")


def pooling_figures(prompt_tokens: int, wall_time_s: float) -> dict[str, float]:
    """The report's ``pooling`` section: prompt tokens pooled this run and their rate."""
    return {"prompt_tokens": prompt_tokens, "prompt_tokens_per_s": prompt_tokens / max(wall_time_s, 1e-9)}


def report_text(report: dict[str, Any]) -> str:
    """The report as the JSON text of ``_report.json``."""
    return json.dumps(report, indent=1, default=str) + "\n"


def _si(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def _bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(report: dict[str, Any]) -> str:
    """The end-of-job summary table."""
    r = report["rows"]
    status = report["status"]
    err = report.get("errors") or {}
    if err.get("exceeded"):
        status += (
            f": {err['fraction']:.1%} of the rows are error rows, more than run.max_error_fraction="
            f"{err['max_fraction']:g}"
        )
    lines = [
        ("status", status),
        ("rows ok / error", f"{r['ok']} / {r['error']}  ({r['done']} of {r['shard_total']} rows done)"),
        (
            "windows",
            f"{report['windows']['done']} / {report['windows']['total']} ({report['windows']['this_run']} this run)",
        ),
    ]
    lines += _pooling_lines(report) if report.get("task") in POOLING_TASKS else _generation_lines(report)
    lora = (report.get("lora") or {}).get("rows") or (report.get("lora") or {}).get("rows_this_run")
    if lora:  # every run's rows (committed windows)
        per = ", ".join(
            f"{name} {c['ok']}" + (f" (+{c['error']} errors)" if c["error"] else "")
            for name, c in sorted(lora.items())
        )
        lines.insert(2, ("rows per adapter", per))
    for rep in report.get("replicas") or []:  # a job over several engine replicas
        restarts = f", {rep['restarts']} restart(s)" if rep.get("restarts") else ""
        lines.append((f"replica {rep['replica']}", f"{rep['rows']} rows, {rep['rows_per_s']:.2f} rows/s, "
                      f"{rep['generated_tokens_per_s']:.1f} gen tok/s{restarts}"))  # fmt: skip
    img = report.get("images")
    if img:  # an image-text job: how often the encoder ran for the images the rows showed
        lines.append(("images", f"{img['references']} references, {img['distinct']} distinct, "
                      f"{img['encoded']} encoded"))  # fmt: skip
        lines.append(
            ("image encoder", f"{img['encoder_time_s']:.2f} s ({img['encoder_share']:.1%} of wall time)")
        )
    if report.get("prediction"):  # the dry run's plan beside what happened
        from batchgen.job.plan_report import prediction_lines

        lines += prediction_lines(report["prediction"])
    for i, (msg, count) in enumerate(err.get("top") or []):
        text = f"{count} x {msg}"
        lines.insert(2 + i, ("top errors" if i == 0 else "", text if len(text) <= 100 else text[:97] + "..."))
    if r.get("retryable"):
        lines.insert(2, ("retryable errors", f"{r['retryable']} (rerun with data.retry_errors=true)"))
    w = max(len(k) for k, _ in lines)
    bar = "-" * (w + 2 + max(len(v) for _, v in lines))
    body = "\n".join(f"{k.ljust(w)}  {v}" for k, v in lines)
    return f"{bar}\n{body}\n{bar}"


def _generation_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The token, throughput and engine rows of a generation (or scoring) job's table."""
    t, run, kv, sch = report["tokens"], report["run"], report["kv"], report["scheduler"]
    return [
        ("prompt tokens computed", _si(t["prompt_computed"])),
        ("prompt tokens reused", f"{_si(t['prompt_reused'])}  (prefix hit rate {t['prefix_hit_rate']:.1%})"),
        *([("prompt tokens copied", _si(t["prompt_copied"]))] if t.get("prompt_copied") else []),
        ("generated tokens", _si(t["generated"])),
        ("wall time", f"{run['wall_time_s']:.1f} s"),
        ("rows/s", f"{run['rows_per_s']:.2f}"),
        ("generated tok/s", f"{run['generated_tokens_per_s']:.1f}"),
        ("KV blocks", f"{kv['num_blocks']} x {kv['block_size']} tokens ({_bytes(kv['pool_bytes'])})"),
        ("peak KV usage", f"{kv['peak_usage']:.1%}"),
        ("KV fragmentation (peak)", f"{kv['peak_fragmentation']:.1%}"),
        ("peak concurrent seqs", str(sch["peak_running_seqs"])),
        ("preemptions", str(sch["preemptions"])),
    ]


def _pooling_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The token and throughput rows of a task=embed / task=classify job's table; the engine rows only for a
    decoder on the paged engine (an encoder has none)."""
    t, run, kv = report["tokens"], report["run"], report["kv"]
    pooled = report.get("pooling") or {}
    paged = bool(kv["num_blocks"])
    lines = [("prompt tokens pooled", _si(pooled.get("prompt_tokens", t["prompt_admitted"])))]
    if paged:
        lines += [
            ("prompt tokens computed", _si(t["prompt_computed"])),
            (
                "prompt tokens reused",
                f"{_si(t['prompt_reused'])}  (prefix hit rate {t['prefix_hit_rate']:.1%})",
            ),
        ]
    lines += [
        ("wall time", f"{run['wall_time_s']:.1f} s"),
        ("rows/s", f"{run['rows_per_s']:.2f}"),
        ("prompt tok/s", f"{pooled.get('prompt_tokens_per_s', 0.0):.1f}"),
    ]
    if paged:
        lines += [
            ("KV blocks", f"{kv['num_blocks']} x {kv['block_size']} tokens ({_bytes(kv['pool_bytes'])})"),
            ("peak KV usage", f"{kv['peak_usage']:.1%}"),
        ]
    return lines
