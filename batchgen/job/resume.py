"""What a run still has to do when the output directory already holds some of the job (a resume), and the
check that the input of what it keeps did not change."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from batchgen.data.manifest import Manifest
from batchgen.data.output_dir import OutputDir
from batchgen.data.reader import WindowSpec, iter_windows
from batchgen.data.values import window_sha256
from batchgen.errors import ConfigError
from batchgen.job.plan import JobPlan

logger = logging.getLogger("batchgen.job")


@dataclass
class WindowTodo:
    """A window this run works on: all of it, or its rows not already done (checkpointed, or ok in the part
    when retrying its error rows)."""

    spec: WindowSpec
    retry_part: bool = False
    retry_rows: list[int] = field(default_factory=list)


def windows_to_do(plan: JobPlan, manifest: Manifest, outdir: OutputDir) -> list[WindowTodo]:
    """The windows without a part, and (with ``data.retry_errors``) those whose part has retryable error rows."""
    retry = plan.cfg.data.retry_errors
    out = []
    for w in plan.windows:
        rec = manifest.windows.get(w.index)
        if rec is None:
            out.append(WindowTodo(w))
        elif retry and rec.rows_error and rec.retry_rows:
            out.append(WindowTodo(w, retry_part=True, retry_rows=rec.retry_rows))
    return out


def verify_skipped_input(plan: JobPlan, manifest: Manifest, out_dir: str) -> tuple[int, float]:
    """ConfigError naming the window when the input rows of a window whose output is kept changed; else
    (windows checked, seconds the check took)."""
    hashes = {w: r.input_sha256 for w, r in manifest.windows.items() if r.input_sha256}
    hashes.update({w: p.input_sha256 for w, p in manifest.partial.items() if p.input_sha256})
    if not hashes:
        return 0, 0.0
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
                f"from what {out_dir!r} was generated from. Restore the original input, or pass "
                "data.overwrite=true to start over"
            )
    took = time.monotonic() - t0
    logger.info(
        "input unchanged for the %d window(s) already processed (checked in %.1f s)", len(specs), took
    )
    return len(specs), took
