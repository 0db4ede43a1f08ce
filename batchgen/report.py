"""The job report: ``report.json`` beside the output and a table printed at the end.

Row counts (``rows.*``) cover the whole shard output so far (from the manifest, all runs); throughput and
engine figures (``run.*``, ``tokens.*``, ``kv.*``, ``scheduler.*``) cover this run only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen.data.manifest import Manifest, atomic_write_bytes


def _stat(stats: Any, name: str, default: Any = 0) -> Any:
    if stats is None:
        return default
    if isinstance(stats, dict):
        return stats.get(name, default)
    return getattr(stats, name, default)


def build_report(
    *,
    status: str,
    output_dir: str,
    manifest: Manifest,
    wall_time_s: float,
    rows_this_run: int,
    windows_this_run: int,
    engine_stats: Any = None,
    model: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the report dict (JSON-serialisable)."""
    recs = manifest.windows.values()
    rows_done = sum(r.row_end - r.row_start for r in recs)
    shard_rows = manifest.shard.get("row_end", 0) - manifest.shard.get("row_start", 0)
    wall = max(wall_time_s, 1e-9)
    computed = int(_stat(engine_stats, "prompt_tokens_computed"))
    cached = int(_stat(engine_stats, "prompt_tokens_cached"))
    generated = int(_stat(engine_stats, "generated_tokens"))
    admitted = int(_stat(engine_stats, "prompt_tokens"))
    bytes_per_block = int(_stat(engine_stats, "bytes_per_block"))
    num_blocks = int(_stat(engine_stats, "num_blocks"))
    report: dict[str, Any] = {
        "status": status,
        "output_dir": output_dir,
        "model": model,
        "rows": {
            "shard_total": shard_rows,
            "done": rows_done,
            "ok": sum(r.rows_ok for r in recs),
            "error": sum(r.rows_error for r in recs),
            "output_rows": sum(r.num_output_rows for r in recs),
        },
        "windows": {
            "total": manifest.num_windows,
            "done": len(manifest.windows),
            "this_run": windows_this_run,
        },
        "run": {
            "rows": rows_this_run,
            "wall_time_s": round(wall_time_s, 3),
            "rows_per_s": rows_this_run / wall,
            "generated_tokens_per_s": generated / wall,
        },
        "tokens": {
            "prompt_admitted": admitted,
            "prompt_computed": computed,
            "prompt_reused": cached,
            "prefix_hit_rate": cached / admitted if admitted else 0.0,
            "generated": generated,
        },
        "kv": {
            "num_blocks": num_blocks,
            "block_size": int(_stat(engine_stats, "block_size")),
            "pool_bytes": num_blocks * bytes_per_block,
            "peak_usage": float(_stat(engine_stats, "peak_kv_usage", 0.0)),
            "min_utilisation": float(_stat(engine_stats, "min_kv_utilization", 1.0)),
            "peak_fragmentation": float(_stat(engine_stats, "peak_kv_fragmentation", 0.0)),
        },
        "scheduler": {
            "peak_running_seqs": int(_stat(engine_stats, "peak_running_seqs")),
            "preemptions": int(_stat(engine_stats, "num_preemptions")),
            "steps": int(_stat(engine_stats, "num_steps")),
            "cow_copies": int(_stat(engine_stats, "num_cow_copies")),
        },
    }
    if engine_stats is not None:
        to_dict = getattr(engine_stats, "to_dict", None)
        report["engine_stats"] = to_dict() if callable(to_dict) else dict(engine_stats)
    if extra:
        report.update(extra)
    return report


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(report, indent=1, default=str) + "\n").encode())


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
    r, t, run, kv, sch = report["rows"], report["tokens"], report["run"], report["kv"], report["scheduler"]
    lines = [
        ("status", report["status"]),
        ("rows ok / error", f"{r['ok']} / {r['error']}  ({r['done']} of {r['shard_total']} rows done)"),
        (
            "windows",
            f"{report['windows']['done']} / {report['windows']['total']} ({report['windows']['this_run']} this run)",
        ),
        ("prompt tokens computed", _si(t["prompt_computed"])),
        ("prompt tokens reused", f"{_si(t['prompt_reused'])}  (prefix hit rate {t['prefix_hit_rate']:.1%})"),
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
    w = max(len(k) for k, _ in lines)
    bar = "-" * (w + 2 + max(len(v) for _, v in lines))
    body = "\n".join(f"{k.ljust(w)}  {v}" for k, v in lines)
    return f"{bar}\n{body}\n{bar}"
