"""Crash safety: kill -9 a running job at random moments, rerun, and get the uninterrupted output.

Also SIGTERM to a real process: exit status 75, a consistent manifest, and a resume that completes.
The kill moments come from a fixed seed; ``BATCHGEN_TEST_SEED=random`` (or an integer) picks others.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import env_without_slurm, job_config, part_contents, random_seed, windows_done

from batchgen.job.config import JobConfig
from batchgen.job.run import EXIT_INTERRUPTED, EXIT_OK, run_job

NUM_ROWS, WINDOW = 24, 3
ENGINE = {"device": "cpu", "num_blocks": 256, "max_num_seqs": 6}
SAMPLING = {"max_tokens": 6, "temperature": 0.9}


def _config(ckpt: str, inp: Path, out: Path) -> JobConfig:
    return job_config(ckpt, inp, out, data={"window_rows": WINDOW}, engine=ENGINE, sampling=SAMPLING)


def _cli(ckpt: str, inp: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "batchgen.cli", f"model.path={ckpt}", f"data.input={inp}", f"data.output={out}",
        f"data.window_rows={WINDOW}", "data.shard.index=0", "data.shard.count=1", "run.progress=log",
        "run.progress_interval_s=0.2",
        *[f"engine.{k}={v}" for k, v in ENGINE.items()], *[f"sampling.{k}={v}" for k, v in SAMPLING.items()],
    ]  # fmt: skip


@pytest.fixture(scope="module")
def setup(llama_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    heads = ["Summarise the following note in one line:", "Translate into French:", "Classify the topic of:"]
    rows = [
        {"prompt": f"{heads[i % 3]} {' '.join(words[(i + k) % 12] for k in range(3 + i % 5))}"}
        for i in range(NUM_ROWS)
    ]
    inp = root / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp, row_group_size=10)
    ref = root / "ref"
    assert (
        run_job(_config(llama_ckpt, inp, ref), handle_signals=False, print_summary=False).exit_code == EXIT_OK
    )
    return inp, ref


@pytest.mark.slow
def test_kill_at_random_moments_then_resume_is_identical(
    llama_ckpt: str, setup: tuple[Path, Path], tmp_path: Path
) -> None:
    """Trial 0 sends SIGTERM (graceful: exit 75, report says incomplete); the others SIGKILL at random."""
    inp, ref = setup
    expected = part_contents(ref)
    num_windows = NUM_ROWS // WINDOW
    seed = random_seed()
    rng = random.Random(seed)
    for trial, sig in enumerate([signal.SIGTERM, signal.SIGKILL, signal.SIGKILL]):
        out = tmp_path / f"out{trial}"
        target, extra = rng.randrange(1, num_windows - 1), rng.uniform(0.0, 0.3)
        log_path = tmp_path / f"log{trial}.txt"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                _cli(llama_ckpt, inp, out),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env_without_slurm(),
                cwd=tmp_path,
            )
            deadline = time.monotonic() + 120
            while proc.poll() is None and windows_done(out) < target and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(extra)
            proc.send_signal(sig)
            rc = proc.wait(timeout=120)
        text = log_path.read_text()
        killed_at = windows_done(out)
        where = f"seed={seed} trial={trial} {signal.Signals(sig).name} target={target} stopped after {killed_at} windows"
        if sig == signal.SIGTERM and killed_at < num_windows:
            assert rc == EXIT_INTERRUPTED, (where, text[-2000:])
            assert "received SIGTERM" in text and "rerun the same command to resume" in text, where
            m = json.loads((out / "_manifest.json").read_text())
            assert sorted(str(p.relative_to(out)) for p in out.glob("_windows/part-*")) == sorted(
                w["part"] for w in m["windows"].values()
            )  # the committed windows, not yet a part (the default part size holds the whole output)
            assert not list(out.glob("part-*"))
            report = json.loads((out / "_report.json").read_text())
            assert report["status"] == "incomplete" and report["interrupted_by"] == "SIGTERM", where
        res = run_job(_config(llama_ckpt, inp, out), handle_signals=False, print_summary=False)
        assert res.exit_code == EXIT_OK, (where, res.message)
        assert not list(out.glob(".tmp-*")), where
        assert part_contents(out) == expected, where
        m = json.loads((out / "_manifest.json").read_text())
        assert m["complete"] and len(m["windows"]) == num_windows, where
