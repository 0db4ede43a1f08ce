"""A corrupt data page: what can still be read is read (the error rows keep their id), and ``batchgen-merge``
on such an output verifies it, or — when the id column itself cannot be decoded — says so in one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, read_parts

from batchgen.job.merge_cli import EXIT_ERROR, EXIT_OK, main
from batchgen.job.run import EXIT_OK as JOB_OK
from batchgen.job.run import run_job


def _input(path: Path, corrupt_column: str) -> None:
    """30 rows in row groups of 10; the data of `corrupt_column` in row group 1 overwritten (footer intact)."""
    table = pa.table(
        {"prompt": [f"row {i} of the input" for i in range(30)], "uid": [f"u{i}" for i in range(30)]}
    )
    pq.write_table(table, path, row_group_size=10, compression="snappy", use_dictionary=False)
    chunk = pq.read_metadata(path).row_group(1).column(table.schema.get_field_index(corrupt_column))
    end = chunk.data_page_offset + chunk.total_compressed_size
    b = bytearray(path.read_bytes())
    b[end - 20 : end - 4] = b"\xff" * 16
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("corrupt", ["prompt", "uid"])
def test_error_rows_keep_readable_ids_and_merge_is_one_line(
    llama_ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture, corrupt: str
) -> None:
    inp = tmp_path / "in.parquet"
    _input(inp, corrupt)
    cfg = job_config(llama_ckpt, inp, tmp_path / "out", data={"id_column": "uid", "window_rows": 30})
    cfg.run.max_error_fraction = 0.5
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == JOB_OK
    out = read_parts(tmp_path / "out")
    status, ids, errors = (out.column(c).to_pylist() for c in ("status", "id", "error"))
    assert [i for i, s in enumerate(status) if s == "error"] == list(range(10, 20))
    assert f"column(s) '{corrupt}'" in errors[10]
    capsys.readouterr()
    code = main([str(tmp_path / "out")])
    err = capsys.readouterr().err
    if corrupt == "prompt":  # the id column was readable: the error rows carry their ids
        assert ids == [f"u{i}" for i in range(30)]
        assert code == EXIT_OK
    else:
        assert ids[10:20] == [None] * 10
        assert code == EXIT_ERROR and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert (
            "cannot read the id column 'uid' of the input 'in.parquet' row group 1 (input rows 10..20)" in err
        )
