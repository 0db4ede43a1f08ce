"""Issue 12: the output directory is a dataset. Parquet readers pointed at it read exactly the output rows:
never the manifest, report, logs or checkpoint files, never a checkpointed row twice, never a merged copy.

pyarrow is always tested; pandas, polars and DuckDB when installed (README shows the one-liners).
"""

from __future__ import annotations

import glob
import json
import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, signal_after

from batchgen.job.merge_cli import EXIT_ERROR
from batchgen.job.merge_cli import main as merge_main
from batchgen.job.run import EXIT_INTERRUPTED, EXIT_OK, run_job


@pytest.fixture(scope="module")
def output(llama_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A 2-shard output: shard 0 complete, shard 1 stopped part-way (checkpoint files, a partial manifest).
    Returns the directory and the ids of the committed rows."""
    from batchgen.engine.core.llm_engine import LLMEngine

    root = tmp_path_factory.mktemp("dataset")
    inp = root / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt {i} " + "word " * (i % 5) for i in range(40)]}), inp)
    out = root / "out"
    data = {"window_rows": 10, "part_rows": 10}  # a part per window: each is readable once committed
    cfg = job_config(llama_ckpt, inp, out, data={"shard": {"index": 0, "count": 2}, **data},
                     engine={"max_num_seqs": 4})  # fmt: skip
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    cfg = job_config(llama_ckpt, inp, out, data={"shard": {"index": 1, "count": 2}, **data},
                     engine={"max_num_seqs": 4})  # fmt: skip
    res = run_job(
        cfg, engine=signal_after(LLMEngine(llama_ckpt, cfg.engine), 12, signal.SIGTERM), print_summary=False
    )
    assert res.exit_code == EXIT_INTERRUPTED
    shard1 = out / "shard-00001-of-00002"
    m = json.loads((shard1 / "_manifest.json").read_text())
    assert list(shard1.glob("_checkpoint/*.arrow")) and m["partial"], m
    committed = [i for w in m["windows"].values() for i in range(w["row_start"], w["row_end"])]
    return out, sorted(list(range(20)) + committed)


def test_readers_see_exactly_the_committed_output_rows(output: tuple[Path, list[int]]) -> None:
    out, ids = output
    assert sorted(pq.read_table(out).column("id").to_pylist()) == ids
    names = sorted(os.path.relpath(p, out) for p in glob.glob(f"{out}/**/*.parquet", recursive=True))
    parts = sorted(str(p.relative_to(out)) for p in out.glob("shard-*/part-*.parquet"))
    assert names == parts and "shard-00000-of-00002/part-000001.parquet" in names
    # everything else batchgen writes is named so that readers skip it
    others = [p.relative_to(out) for p in out.rglob("*") if p.is_file() and p.suffix != ".parquet"]
    assert others and all(any(part.startswith(("_", ".")) for part in p.parts) for p in others), others


def test_pandas_polars_duckdb_one_liners(output: tuple[Path, list[int]]) -> None:
    out, ids = output
    tried = 0
    try:
        import pandas as pd

        assert sorted(pd.read_parquet(out)["id"].tolist()) == ids
        tried += 1
    except ImportError:
        pass
    try:
        import polars as pl

        assert sorted(pl.scan_parquet(f"{out}/**/*.parquet").collect()["id"].to_list()) == ids
        tried += 1
    except ImportError:
        pass
    try:
        import duckdb

        rows = duckdb.sql(f"SELECT id FROM read_parquet('{out}/**/*.parquet') ORDER BY id").fetchall()
        assert [r[0] for r in rows] == ids
        tried += 1
    except ImportError:
        pass
    if not tried:
        pytest.skip("none of pandas, polars, duckdb is installed")


def test_a_merged_copy_is_never_written_into_the_output(
    output: tuple[Path, list[int]], tmp_path: Path, capsys
) -> None:
    out, ids = output
    assert merge_main([str(out), "--write", str(out / "merged.parquet"), "--force"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "lies inside the output directory" in err and "read its rows twice" in err
    assert not (out / "merged.parquet").exists()
    assert (
        merge_main([str(out), "--write", str(tmp_path / "merged.parquet"), "--force"]) == 1
    )  # shard 1 unfinished
    assert sorted(pq.read_table(tmp_path / "merged.parquet").column("id").to_pylist()) == ids
    assert sorted(pq.read_table(out).column("id").to_pylist()) == ids
