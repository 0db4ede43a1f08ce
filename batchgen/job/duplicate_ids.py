"""Duplicate ids in ``data.id_column``: each row's seed derives from its id, so rows sharing an id get the
same seed and identical "independent" samples, and their output rows cannot be told apart by id. The job
warns once, with the count and an example (it does not refuse: duplicates may be meant).

Invariants: the check reads the id column of the shard (nothing else) in a background thread started before
the engine, so it never delays the first token; it runs on a fresh output only (a resumed one was checked by
the run that started it) and reads at most :data:`MAX_ROWS` rows (memory stays bounded at any input size; the
warning says when it looked at the first rows only). :meth:`DuplicateIdCheck.join` waits for it (the end of a
run), so a finished job has logged its warning.
"""

from __future__ import annotations

import logging
import threading

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.data.reader import iter_windows, plan_windows
from batchgen.job.plan import JobPlan

logger = logging.getLogger("batchgen.job")
_READ_ROWS = 1 << 20  # rows of the id column per read: one column, so a window of this size is small
MAX_ROWS = 1 << 25
"""Most ids the check reads (about 33M: some hundreds of MB for the distinct values at most)."""


def count_duplicate_ids(plan: JobPlan, max_rows: int = MAX_ROWS) -> tuple[int, object]:
    """(rows among the shard's first `max_rows` whose id repeats an earlier row's id, one such id); (0, None)
    without ``data.id_column``. Null ids (unreadable or missing) are not counted."""
    column = plan.cfg.data.id_column
    if not column:
        return 0, None
    chunks = []
    specs = plan_windows(plan.row_start, min(plan.row_end, plan.row_start + max_rows), _READ_ROWS)
    schema = pa.schema([plan.read_schema.field(column)])
    for win in iter_windows(plan.input, specs, [column], schema=schema):
        chunks.extend(win.table.column(column).chunks)
    if not chunks:
        return 0, None
    ids = pa.chunked_array(chunks, type=schema.field(0).type)
    ids = ids.drop_null() if ids.null_count else ids
    if len(pc.unique(ids)) == len(ids):
        return 0, None
    counts = pc.value_counts(ids)
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    extra = pc.sum(pc.subtract(repeated.field("counts"), 1)).as_py()
    return int(extra), repeated.field("values")[0].as_py()


def warn_duplicate_ids(plan: JobPlan, max_rows: int = MAX_ROWS) -> int:
    """Log one warning when ids repeat (see the module doc); returns the count."""
    n, example = count_duplicate_ids(plan, max_rows)
    if n:
        seeded = plan.cfg.sampling.seed is not None
        same = (
            "rows sharing an id get the same seed (seeds derive from (sampling.seed, id)) and sample "
            "identically, and their output rows share the id: make the ids unique (or give such rows a "
            "per-row seed)"
            if seeded
            else "their output rows share the id: make the ids unique"
        )
        first = f" of the first {max_rows}" if plan.row_end - plan.row_start > max_rows else ""
        logger.warning(
            "data.id_column %r: %d row(s)%s repeat the id of an earlier row (e.g. %r); %s",
            plan.cfg.data.id_column, n, first, example, same,
        )  # fmt: skip
    return n


class DuplicateIdCheck:
    """:func:`warn_duplicate_ids` in a daemon thread (none without ``data.id_column``); an error reading the
    ids is logged at debug level only (the job reads the same rows itself and reports them properly)."""

    def __init__(self, plan: JobPlan) -> None:
        self.count: int | None = None
        self._thread: threading.Thread | None = None
        if plan.cfg.data.id_column:
            self._thread = threading.Thread(target=self._run, args=(plan,), name="duplicate-ids", daemon=True)
            self._thread.start()

    def _run(self, plan: JobPlan) -> None:
        try:
            self.count = warn_duplicate_ids(plan)
        except Exception:  # noqa: BLE001 - a warning only: never the job's failure
            logger.debug("duplicate id check failed", exc_info=True)

    def join(self) -> int | None:
        """Wait for the check; the number of repeated ids (None when it did not run or failed)."""
        if self._thread is not None:
            self._thread.join()
        return self.count
