"""A window's output part and manifest record for the tasks that run outside the engine feeder (``score`` and
the pooling tasks), committed the same way: one part per window, its record beside it, under
:meth:`~batchgen.job.signals.StopSignal.saving` so that a second Ctrl-C never interrupts a commit."""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from batchgen.data.manifest import WindowRecord


def row_ids(table: pa.Table, id_column: str | None, row_start: int) -> pa.Array:
    """The window's ``id`` column: ``id_column``'s values, else the rows' input positions."""
    if id_column:
        return table.column(id_column).combine_chunks()
    return pa.array(range(row_start, row_start + table.num_rows), pa.int64())


def commit_window(
    outdir: Any,
    stop: Any,
    w: Any,
    data: Any,
    task: str,
    cols: dict[str, pa.Array],
    t0: float,
    prompt_tokens: int,
    cached_tokens: int = 0,
    rows_by_adapter: dict | None = None,
) -> None:
    """Commit window ``w``'s part (``id``, the kept input columns, then ``cols``, which hold ``status``) and
    its record; ``t0``: when the window started (``time.time()``)."""
    arrays: dict[str, Any] = {"id": row_ids(w.table, data.id_column, w.spec.row_start)}
    for c in data.keep_columns:
        if c != "id":
            arrays[c] = w.table.column(c).combine_chunks()
    arrays.update(cols)
    meta = {b"batchgen.task": task.encode(), b"batchgen.window": str(w.spec.index).encode()}
    table = pa.table(arrays).replace_schema_metadata(meta)
    n_ok = sum(1 for s in cols["status"].to_pylist() if s == "ok")
    record = WindowRecord(
        part="",
        row_start=w.spec.row_start,
        row_end=w.spec.row_end,
        num_output_rows=table.num_rows,
        rows_ok=n_ok,
        rows_error=table.num_rows - n_ok,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        generated_tokens=0,
        wall_time_s=round(time.time() - t0, 3),
        rows_by_adapter=rows_by_adapter,
    )
    with stop.saving():
        outdir.commit(w.spec.index, table, record)
