"""`batchgen show OUT` and the examples in the job summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import job_config

from batchgen.job.run import EXIT_OK, run_job
from batchgen.job.show import format_rows, read_rows


def test_show_reads_only_output_rows(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(
        pa.table({"id": [0, 1], "generated_text": ["a\nb", "c"], "status": ["ok", "ok"]}),
        out / "part-000000.parquet",
    )
    (out / "_manifest.json").write_text("{}")
    rows, total = read_rows(out, 1)
    assert total == 2 and rows == [{"id": 0, "generated_text": "a\nb", "status": "ok"}]
    text = format_rows(rows)
    assert "id=0  status=ok" in text and "a⏎ b" in text


def test_show_command_and_missing_output(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "batchgen.cli", "show", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert (
        bad.returncode == 2 and "batchgen show: cannot read" in bad.stderr and "Traceback" not in bad.stderr
    )


def test_summary_prints_examples_and_how_to_read(llama_ckpt: str, tmp_path: Path, capsys) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["The quick brown fox", "Once upon a time"]}), inp)
    cfg = job_config(llama_ckpt, inp, tmp_path / "out")
    assert run_job(cfg, handle_signals=False, print_summary=True).exit_code == EXIT_OK
    printed = capsys.readouterr().out
    assert "examples:" in printed and "→" in printed
    assert f"batchgen show {tmp_path / 'out'}" in printed and "read_parquet" in printed
    shown = subprocess.run(
        [sys.executable, "-m", "batchgen.cli", "show", str(tmp_path / "out"), "-n", "1"],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0 and "(1 of 2 rows" in shown.stdout
