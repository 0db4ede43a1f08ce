"""The ``batchgen`` command: help, --cfg job, Hydra's errors, exit codes, the embedded default run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import env_without_slurm


def _run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchgen.cli", *args],
        cwd=cwd,
        env=env_without_slurm(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_option_with_its_doc(tmp_path: Path) -> None:
    p = _run(["--help"], tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for key in (
        "model.path=null", "data.input=null", "data.window_rows=1024", "data.shard.index=0", "engine.block_size=16",
        "engine.kv_cache_memory=2GiB", "sampling.max_tokens=16", "sampling.seed=0", "run.stop_grace_s=0.0",
    ):  # fmt: skip
        assert key in out, key
    assert "Rows per window" in out and "$SLURM_ARRAY_TASK_ID" in out
    assert "sampling: default, greedy" in out and "Exit status" in out
    assert list(tmp_path.iterdir()) == []  # --help writes nothing


def test_cfg_job_prints_the_resolved_config(tmp_path: Path) -> None:
    p = _run(
        ["--cfg", "job", "sampling.max_tokens=7"],
        tmp_path,
        {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "5"},
    )
    assert p.returncode == 0, p.stderr
    assert "max_tokens: 7" in p.stdout
    assert "index: 2" in p.stdout and "count: 5" in p.stdout and "oc.env" not in p.stdout
    assert list(tmp_path.iterdir()) == []


def test_misspelt_key_or_wrong_type_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """README's table: a configuration error is exit status 2 and one line, for a plain typo or wrong type as
    for ``+``."""
    for args, want in (  # other spellings: tests/test_cli_args.py, in process; `+`: the test below
        (
            ["data.windw_rows=5"],
            "unknown configuration key: data.windw_rows (did you mean data.window_rows?)",
        ),
        (["data.window_rows=abc"], "data.window_rows=abc: Value 'abc' of type 'str' could not be converted"),
    ):
        p = _run([*args, "data.output=out"], tmp_path)
        said = p.stdout + p.stderr
        assert p.returncode == 2 and want in said and len(said.strip().splitlines()) == 1, (args, said)
        assert "+data" not in said
    assert list(tmp_path.iterdir()) == []


def test_missing_input_exits_2_and_leaves_nothing(tmp_path: Path) -> None:
    p = _run(["data.input=missing.parquet", "data.output=out"], tmp_path)
    assert p.returncode == 2
    assert "data.input: 'missing.parquet' does not exist" in p.stdout + p.stderr
    assert list(tmp_path.iterdir()) == []  # Hydra's log directory is removed again


@pytest.mark.slow
def test_embedded_default_runs_with_no_arguments(tmp_path: Path) -> None:
    from batchgen.models.tiny import tiny_default_checkpoint

    tiny_default_checkpoint()  # built once per test session (in $BATCHGEN_CACHE, set by conftest)
    t0 = time.monotonic()
    p = _run([], tmp_path, {"COLUMNS": "120"})
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "batchgen_output"
    assert f"report: {Path('batchgen_output') / '_report.json'}" in p.stdout
    assert "prefix hit rate" in p.stdout and "rows ok / error" in p.stdout
    report = json.loads((out / "_report.json").read_text())
    assert report["status"] == "complete" and report["rows"]["ok"] == report["rows"]["shard_total"] >= 64
    assert report["tokens"]["prefix_hit_rate"] > 0.5
    assert sorted(p.name for p in out.glob("part-*.parquet")) == ["part-000000.parquet"]
    assert (out / "_logs").is_dir() and sorted(x.name for x in tmp_path.iterdir()) == ["batchgen_output"]
    # README: the sample's per-row `sampling` column (max_tokens 24) wins over the job's sampling.max_tokens (16)
    generated = pq.read_table(out, columns=["num_generated_tokens"]).column(0).to_pylist()
    assert max(generated) > 16
    print(f"embedded default run: {elapsed:.1f} s")


def test_demo_per_row_sampling_column_can_be_ignored(tmp_path: Path) -> None:
    """README's quick start: with data.sampling_column=null the command line's sampling.max_tokens counts."""
    p = _run(["sampling.max_tokens=3", "data.sampling_column=null", "run.progress=off"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    t = pq.read_table(tmp_path / "batchgen_output", columns=["num_generated_tokens", "status"])
    assert set(t.column("status").to_pylist()) == {"ok"} and max(t.column(0).to_pylist()) == 3


def test_unknown_key_added_with_plus_exits_2_naming_it(tmp_path: Path) -> None:
    p = _run(["+data.windw_rows=8", "data.output=out"], tmp_path)
    assert p.returncode == 2, p.stderr
    text = p.stdout + p.stderr
    assert "unknown configuration key: data.windw_rows (did you mean data.window_rows?)" in text
    assert "Traceback" not in text and list(tmp_path.iterdir()) == []


def test_sweep_into_one_output_directory_reports_one_line(tmp_path: Path) -> None:
    """Two jobs of a sweep whose input is missing: one line per failed job, the first one's status, no
    traceback (the job itself fails before the model loads)."""
    p = _run(
        ["-m", "data.input=missing.parquet", "data.output=out/${hydra:job.num}", "sampling.max_tokens=2,3"],
        tmp_path,
    )
    text = p.stdout + p.stderr
    assert p.returncode == 2, text
    assert "Traceback" not in text
    lines = [ln for ln in text.splitlines() if ln.startswith("batchgen: job ")]
    assert [ln.split(" (")[0] for ln in lines] == ["batchgen: job 0", "batchgen: job 1"], text
    assert all("exited with status 2: data.input: 'missing.parquet' does not exist" in ln for ln in lines)
