"""A window committed by the score and pooling tasks: its part's columns, its record's counts, and the commit
made inside the stop signal's saving block (a second Ctrl-C never interrupts it)."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pyarrow as pa

from batchgen.job.window_output import commit_window


class _Stop:
    def __init__(self) -> None:
        self.depth = 0

    @contextlib.contextmanager
    def saving(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


class _OutDir:
    def __init__(self, stop: _Stop) -> None:
        self.stop, self.commits = stop, []

    def commit(self, index, table, record) -> None:
        self.commits.append((index, table, record, self.stop.depth))


def test_commit_window_part_record_and_saving_block() -> None:
    stop = _Stop()
    out = _OutDir(stop)
    table = pa.table({"uid": ["a", "b", "c"], "text": ["x", "y", "z"], "other": [1, 2, 3]})
    w = SimpleNamespace(table=table, spec=SimpleNamespace(index=4, row_start=30, row_end=33))
    data = SimpleNamespace(id_column=None, keep_columns=["text"])
    cols = {"status": pa.array(["ok", "error", "ok"]), "score": pa.array([1.0, None, 2.0])}
    commit_window(out, stop, w, data, "embed", cols, time.time(), prompt_tokens=12, cached_tokens=3)
    ((index, part, record, depth),) = out.commits
    assert index == 4 and depth == 1 and stop.depth == 0
    assert part.column_names == ["id", "text", "status", "score"]
    assert part.column("id").to_pylist() == [30, 31, 32]  # input positions without an id column
    assert part.schema.metadata[b"batchgen.task"] == b"embed"
    assert (record.rows_ok, record.rows_error, record.prompt_tokens, record.cached_tokens) == (2, 1, 12, 3)
    assert (record.row_start, record.row_end, record.num_output_rows) == (30, 33, 3)
    data = SimpleNamespace(id_column="uid", keep_columns=[])
    commit_window(out, stop, w, data, "score", cols, time.time(), prompt_tokens=0)
    assert out.commits[-1][1].column("id").to_pylist() == ["a", "b", "c"]
