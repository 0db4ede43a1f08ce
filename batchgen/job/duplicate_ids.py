"""Duplicate ids in ``data.id_column``: each row's seed derives from its id, so rows sharing an id get the
same seed and identical "independent" samples, and their output rows cannot be told apart by id. The job
warns once, before any work, with the count and an example (it does not refuse: duplicates may be meant)."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.data.reader import iter_windows, plan_windows
from batchgen.job.plan import JobPlan

logger = logging.getLogger("batchgen.job")
_READ_ROWS = 1 << 20  # rows of the id column per read: one column, so a window of this size is small


def count_duplicate_ids(plan: JobPlan) -> tuple[int, object]:
    """(rows of this shard whose id repeats an earlier row's id, one such id); (0, None) without
    ``data.id_column``. Null ids (unreadable or missing) are not counted."""
    column = plan.cfg.data.id_column
    if not column:
        return 0, None
    chunks = []
    specs = plan_windows(plan.row_start, plan.row_end, _READ_ROWS)
    schema = pa.schema([plan.read_schema.field(column)])
    for win in iter_windows(plan.input, specs, [column], schema=schema):
        chunks.extend(win.table.column(column).chunks)
    if not chunks:
        return 0, None
    ids = pa.chunked_array(chunks, type=schema.field(0).type)
    counts = pc.value_counts(ids.drop_null() if ids.null_count else ids)
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    if not len(repeated):
        return 0, None
    extra = pc.sum(pc.subtract(repeated.field("counts"), 1)).as_py()
    return int(extra), repeated.field("values")[0].as_py()


def warn_duplicate_ids(plan: JobPlan) -> int:
    """Log one warning when ids repeat (see the module doc); returns the count."""
    n, example = count_duplicate_ids(plan)
    if n:
        seeded = plan.cfg.sampling.seed is not None
        same = (
            "rows sharing an id get the same seed (seeds derive from (sampling.seed, id)) and sample "
            "identically, and their output rows share the id: make the ids unique (or give such rows a "
            "per-row seed)"
            if seeded
            else "their output rows share the id: make the ids unique"
        )
        logger.warning(
            "data.id_column %r: %d row(s) repeat the id of an earlier row (e.g. %r); %s",
            plan.cfg.data.id_column, n, example, same,
        )  # fmt: skip
    return n
