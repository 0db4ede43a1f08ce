"""The input columns a job reads, checked by :func:`batchgen.data.columns.select_columns` (no model)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.data.columns import ColumnSpec, select_columns
from batchgen.data.reader import open_input
from batchgen.errors import ConfigError


def _input(tmp_path: Path, *tables: pa.Table):
    for i, t in enumerate(tables):
        pq.write_table(t, tmp_path / f"part-{i}.parquet")
    return open_input(str(tmp_path))


def test_columns_in_role_order_with_the_unified_schema(tmp_path: Path) -> None:
    a = pa.table({"prompt": pa.array([None, None], pa.null()), "k": [1, 2], "id": ["a", "b"]})
    b = pa.table({"prompt": ["x", "y"], "k": [3, 4], "id": ["c", "d"]})
    cols = select_columns(
        _input(tmp_path, a, b), ColumnSpec("prompt", id_column="id", keep_columns=("k", "id"))
    )
    assert cols.names == ["prompt", "id", "k"] and cols.sampling_column is None  # default name, absent
    assert cols.schema.field("prompt").type == pa.string()


def test_each_problem_names_its_option(tmp_path: Path) -> None:
    inp = _input(tmp_path, pa.table({"prompt": ["x"], "sampling": [1], "n": [None]}))
    with pytest.raises(ConfigError, match="data.keep_columns: column 'gone' is missing from the input"):
        select_columns(inp, ColumnSpec("prompt", keep_columns=("gone",)))
    with pytest.raises(ConfigError, match="data.sampling_column: column 'sampling' has type int64"):
        select_columns(inp, ColumnSpec("prompt"))
    with pytest.raises(ConfigError, match="data.prompt_column: column 'n' holds only nulls"):
        select_columns(inp, ColumnSpec("n", sampling_column=None))
