"""What a run still has to do when the output directory already holds some of the job (a resume), and the
check that the input of what it keeps did not change.

Invariants:
- Nothing here is per window of the whole shard: :class:`WindowsTodo` walks the plan's windows lazily
  (window indexes are arithmetic, :class:`~batchgen.data.reader.WindowPlan`) and counts what is left from the
  commit record alone, so a resume holds no list of windows and reads no input to know what to do.
- The input check reads the rows of at most :data:`VERIFY_WINDOWS` of the windows kept (all of them when there
  are that few; else windows spread evenly over the output that are cheap to read — the first kept window
  starting in each input row group, whose read decodes at most a window's rows before it — topped up with
  windows of the first kept window's row group, plus every window with checkpointed rows): its cost does not
  grow with the rows already done (about two windows a check, and one row group). The input's fingerprint (every
  file's size, row count and footer hash, or its store version) covers the rest.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from batchgen.data.manifest import Manifest
from batchgen.data.output_dir import OutputDir
from batchgen.data.reader import WindowSpec, iter_windows
from batchgen.data.values import window_sha256
from batchgen.errors import ConfigError
from batchgen.job.plan import JobPlan

logger = logging.getLogger("batchgen.job")

VERIFY_WINDOWS = 64
"""Most windows whose input rows a resume re-reads and hashes (:func:`verify_skipped_input`)."""


@dataclass
class WindowTodo:
    """A window this run works on: all of it, or its rows not already done (checkpointed, or ok in the part
    when retrying its error rows)."""

    spec: WindowSpec
    retry_part: bool = False
    retry_rows: list[int] = field(default_factory=list)


class WindowsTodo:
    """The windows without a part, and (with ``data.retry_errors``) those whose part has retryable error rows,
    in window order — iterated lazily from the plan's windows and the manifest's records; ``len()`` and
    :attr:`retry_rows` come from the records alone."""

    def __init__(self, plan: JobPlan, manifest: Manifest) -> None:
        self.plan, self.manifest = plan, manifest
        self.retry = plan.cfg.data.retry_errors
        done = manifest.windows
        retried = [r for r in done.values() if r.rows_error and r.retry_rows] if self.retry else []
        self._count = len(plan.windows) - sum(1 for w in done if 0 <= w < len(plan.windows)) + len(retried)
        self.retry_rows = sum(len(r.retry_rows) for r in retried)
        """Error rows to recompute in windows already committed (``data.retry_errors``)."""

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[WindowTodo]:
        done = self.manifest.windows
        for w in self.plan.windows:
            rec = done.get(w.index)
            if rec is None:
                yield WindowTodo(w)
            elif self.retry and rec.rows_error and rec.retry_rows:
                yield WindowTodo(w, retry_part=True, retry_rows=rec.retry_rows)

    def specs(self) -> Iterator[WindowSpec]:
        """The windows' specs, lazily."""
        return (t.spec for t in self)


def windows_to_do(plan: JobPlan, manifest: Manifest, outdir: OutputDir) -> WindowsTodo:
    """The windows without a part, and (with ``data.retry_errors``) those whose part has retryable error rows."""
    return WindowsTodo(plan, manifest)


def _spread(items: list[int], n: int) -> set[int]:
    """At most `n` of `items` (sorted), spread evenly, the first and the last included."""
    if len(items) <= n:
        return set(items)
    step = (len(items) - 1) / (n - 1)
    return {items[round(i * step)] for i in range(n)}


def _row_group_starts(plan: JobPlan) -> list[int]:
    """The global first row of every row group of the input (ascending)."""
    starts = []
    for f in plan.input.files:
        s = f.row_start
        for n in f.row_group_rows:
            starts.append(s)
            s += n
    return starts


def _sample(plan: JobPlan, kept: list[int], partial: set[int]) -> list[int]:
    """At most :data:`VERIFY_WINDOWS` of `kept` (sorted) cheap to read (module doc), plus `partial`."""
    if len(kept) <= VERIFY_WINDOWS:
        return kept
    done, w0, rows = set(kept), plan.row_start, plan.cfg.data.window_rows
    starts = _row_group_starts(plan)
    firsts = {-(-(s - w0) // rows) for s in starts if s >= w0}  # the first window starting in each row group
    picked = _spread(sorted((firsts & done) | {kept[0]}), VERIFY_WINDOWS)
    if (
        len(picked) < VERIFY_WINDOWS
    ):  # few row groups: more of the first one's windows (read in the same pass)
        i = bisect.bisect_right(starts, plan.windows[kept[0]].row_start)
        end = starts[i] if i < len(starts) else plan.row_end
        same = kept[: bisect.bisect_left(kept, -(-(end - w0) // rows))]
        picked |= _spread(same, VERIFY_WINDOWS - len(picked))
    return sorted(picked | partial)


def verify_skipped_input(plan: JobPlan, manifest: Manifest, out_dir: str) -> tuple[int, float]:
    """ConfigError naming the window when the input rows of a window whose output is kept changed; else
    (windows checked, seconds the check took). Reads at most :data:`VERIFY_WINDOWS` windows (module doc)."""
    hashes = {w: r.input_sha256 for w, r in manifest.windows.items() if r.input_sha256}
    partial = {w: p.input_sha256 for w, p in manifest.partial.items() if p.input_sha256}
    hashes.update(partial)
    if not hashes:
        return 0, 0.0
    t0 = time.monotonic()
    n = len(plan.windows)
    picked = _sample(plan, sorted(w for w in hashes if 0 <= w < n), set(w for w in partial if 0 <= w < n))
    specs = (plan.windows[w] for w in picked)
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
    of = f" (a sample of the {len(hashes)}, spread over the output)" if len(picked) < len(hashes) else ""
    logger.info(
        "input unchanged for the %d window(s) already processed%s (checked in %.1f s)", len(picked), of, took
    )
    return len(picked), took
