"""Batchgen outputs inside the input directory are not input: the job's own output (also before its manifest
exists, and sharded), and any other output directory nested in the input; an input that is itself an
output directory is read as asked."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import job_config

from batchgen.data.reader import open_input
from batchgen.errors import ConfigError
from batchgen.job.plan import plan_job
from batchgen.job.run import EXIT_OK, run_job


def _input(root: Path) -> Path:
    root.mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["one two", "three four", "five"]}), root / "a.parquet")
    return root


def test_output_inside_the_input_reruns(llama_ckpt: str, tmp_path: Path) -> None:
    inp = _input(tmp_path / "in")
    for shards in (1, 2):
        out = inp / f"out{shards}"
        for index in range(shards):
            cfg = job_config(llama_ckpt, inp, out, data={"shard": {"index": index, "count": shards}})
            for _ in range(2):  # the rerun would read the first run's parts as input
                res = run_job(cfg, handle_signals=False, print_summary=False)
                assert res.exit_code == EXIT_OK, res.message
    assert open_input(str(inp)).num_rows == 3  # other outputs nested in the input are skipped too
    assert open_input(str(inp / "out1")).num_rows == 3  # an output given as the input is read


def test_output_given_only_by_its_directory_before_any_manifest(tmp_path: Path) -> None:
    inp = _input(tmp_path / "in")
    pq.write_table(pa.table({"id": [0], "generated_text": ["x"]}), tmp_path / "in" / "part-000000.parquet")
    (inp / "o").mkdir()
    pq.write_table(pa.table({"id": [0]}), inp / "o" / "part-000000.parquet")
    assert [f.rel_path for f in open_input(str(inp), output=str(inp / "o")).files] == [
        "a.parquet",
        "part-000000.parquet",
    ]


def test_missing_column_lists_the_columns_of_the_file_missing_it(llama_ckpt: str, tmp_path: Path) -> None:
    inp = _input(tmp_path / "in")
    pq.write_table(pa.table({"text": ["x"], "other": [1]}), inp / "b.parquet")
    try:
        plan_job(job_config(llama_ckpt, inp, tmp_path / "out"))
    except ConfigError as e:
        assert "'b.parquet'" in str(e) and "its columns: text, other)" in str(e), e
    else:
        raise AssertionError("a file without the prompt column was accepted")
