"""A changed input is refused also when the output is complete (the recorded per-window hashes are checked
before "nothing to do"), and the message says how long the check took."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import job_config

from batchgen.job.run import EXIT_CONFIG, EXIT_OK, run_job


def _write(path: Path, swap: bool) -> None:
    rows = [f"row {i} of the input" for i in range(12)]
    if swap:  # same values, sizes and statistics: the footer does not change, the rows do
        rows[3], rows[4] = rows[4], rows[3]
    pq.write_table(pa.table({"prompt": rows}), path, compression="none")


def test_in_place_edit_of_a_complete_output_is_refused(llama_ckpt: str, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    _write(inp, swap=False)
    cfg = job_config(llama_ckpt, inp, tmp_path / "out")
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    _write(inp, swap=True)
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_CONFIG and "the input changed since window 0" in res.message, res.message
    _write(inp, swap=False)
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK and "nothing to do" in res.message
    assert "input unchanged, checked in" in res.message
