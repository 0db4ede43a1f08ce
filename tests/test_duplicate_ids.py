"""Duplicate ids: the job warns once, before any work, with the count and an example (seeds derive from ids,
so rows sharing one sample identically)."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, read_parts

from batchgen.job.run import EXIT_OK, run_job


def test_duplicate_ids_warn_once_with_the_count(
    llama_ckpt: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "in").mkdir()
    uid_a = ["a", "b", "a", "c", None]
    pq.write_table(pa.table({"prompt": ["same prompt"] * 5, "uid": uid_a}), tmp_path / "in" / "1.parquet")
    pq.write_table(
        pa.table({"prompt": ["same prompt"] * 3, "uid": ["b", "d", None]}), tmp_path / "in" / "2.parquet"
    )
    cfg = job_config(
        llama_ckpt, tmp_path / "in", tmp_path / "out", data={"id_column": "uid", "window_rows": 3}
    )
    cfg.run.max_error_fraction = 1.0  # null ids are error rows
    with caplog.at_level(logging.WARNING, logger="batchgen.job"):
        assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    warnings = [r.getMessage() for r in caplog.records if "repeat the id" in r.getMessage()]
    assert len(warnings) == 1 and "2 row(s) repeat the id of an earlier row" in warnings[0], warnings
    assert "sample identically" in warnings[0]
    out = read_parts(tmp_path / "out").to_pydict()
    assert out["token_ids"][0] == out["token_ids"][2]  # what the warning is about: same id, same sample

    caplog.clear()
    unique = job_config(llama_ckpt, tmp_path / "in", tmp_path / "out2")  # ids = row indices
    with caplog.at_level(logging.WARNING, logger="batchgen.job"):
        assert run_job(unique, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    assert not [r for r in caplog.records if "repeat the id" in r.getMessage()]
