"""A second Ctrl-C does not interrupt the save of finished rows (checkpoints after a stop, a window's part)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, signal_after

from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.job import writer as job_writer
from batchgen.job.run import EXIT_INTERRUPTED, run_job


@pytest.mark.parametrize("during", ["checkpoint", "commit"])
def test_second_ctrl_c_during_the_save_keeps_every_finished_row(
    llama_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, during: str
) -> None:
    pq.write_table(pa.table({"prompt": [f"row {i} of the test" for i in range(24)]}), tmp_path / "in.parquet")
    cfg = job_config(llama_ckpt, tmp_path / "in.parquet", tmp_path / "out", data={"window_rows": 12})
    cfg.engine.max_num_seqs = 4  # window 0 finishes before window 1 does
    real = getattr(job_writer.PartWriter, during)

    def interrupted(self, *args):  # the second Ctrl-C lands inside the save
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args)

    monkeypatch.setattr(job_writer.PartWriter, during, interrupted)
    if during == "checkpoint":  # first Ctrl-C mid-run: the finished rows of the open windows are saved
        engine = signal_after(LLMEngine(llama_ckpt, cfg.engine), at=12)
    else:  # first Ctrl-C at the start: the window committed after it must still be written
        engine = signal_after(LLMEngine(llama_ckpt, cfg.engine), at=1)
        cfg.run.stop_grace_s = 600
    res = run_job(cfg, engine=engine, print_summary=False)
    assert res.exit_code == EXIT_INTERRUPTED
    saved = res.report["rows"]
    assert saved["done"] > 0, res.message
    # the rows this run saved, checkpointed ones included, are this run's rows and give its rows/s
    assert res.report["run"]["rows"] == saved["done"] and res.report["run"]["rows_per_s"] > 0
    if during == "commit":
        assert list((tmp_path / "out").glob("_windows/part-*.arrow"))  # committed, in no part yet
