"""Exit statuses keep the requeue contract: a signal from the first instant of start-up, and a second signal
while a stopped job shuts down, both end with 75 (retry), never 130/138/143; a signal once the job has ended
leaves its status (0 for a complete output)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import env_without_slurm

ARGS = ["engine.device=cpu", "engine.num_blocks=128", "hydra.run.dir=.", "hydra.output_subdir=null"]


def wait_until_caught(proc: subprocess.Popen, sig: signal.Signals, timeout: float = 60) -> None:
    """Poll (every 5 ms) until `proc` catches `sig` (its bit in /proc/PID/status SigCgt), it exits or `timeout`
    passes: the first instant at which the command can answer the signal, whatever the machine's load."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return
        caught = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.005)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_right_at_start_exits_75(tmp_path: Path, sig: signal.Signals) -> None:
    """The signal as soon as the command has a handler for it (the first lines of batchgen.cli, before its
    imports): exit 75 and no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", f"data.input={tmp_path}/in.parquet", f"data.output={tmp_path}/o"],
        cwd=tmp_path, env=env_without_slurm(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    wait_until_caught(proc, sig)
    proc.send_signal(sig)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, (proc.returncode, text[-2000:])
    assert "Traceback" not in text


@pytest.mark.slow
def test_a_second_signal_while_stopping_keeps_75(llama_ckpt: str, tmp_path: Path) -> None:
    pq.write_table(
        pa.table({"prompt": [f"row {i} about a long story" for i in range(64)]}), tmp_path / "in.parquet"
    )  # work for many seconds one sequence at a time: the signals must come while it runs, however fast the CPU
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", f"model.path={llama_ckpt}", f"data.input={tmp_path}/in.parquet",
         f"data.output={tmp_path}/out", "data.window_rows=4", "engine.max_num_seqs=1", "sampling.max_tokens=64",
         "run.progress=log", *ARGS],
        cwd=tmp_path, env={**env_without_slurm(), "BATCHGEN_TRACE_STARTUP": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    head = ""
    for line in proc.stdout:
        head += line
        if line.startswith("batchgen-startup: plan"):
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    for delay in (0.3, 0.2, 0.2):
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=180)
    assert proc.returncode == 75, (proc.returncode, (head + text)[-3000:])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_after_the_job_completed_keeps_0(
    llama_ckpt: str, tmp_path: Path, sig: signal.Signals
) -> None:
    """The signal arrives the moment the job has returned (every row committed, the report written), while the
    command shuts down: it exits 0, not 143/138 (a Slurm script would count a complete task as failed)."""
    pq.write_table(pa.table({"prompt": ["one", "two"]}), tmp_path / "in.parquet")
    script = (
        "import os, sys\n"
        "from batchgen.runtime import startup_trace\n"
        "real = startup_trace.mark\n"
        "def mark(what, *a, **k):\n"
        f"    if what == 'done': os.kill(os.getpid(), {int(sig)})\n"
        "    return real(what, *a, **k)\n"
        "startup_trace.mark = mark\n"
        "from batchgen.cli import main\n"
        "sys.argv = ['batchgen', *sys.argv[1:]]\n"
        "main()\n"
    )
    args = [
        f"model.path={llama_ckpt}",
        f"data.input={tmp_path}/in.parquet",
        f"data.output={tmp_path}/o",
        *ARGS,
    ]
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=tmp_path, env=env_without_slurm(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "done: 1 part(s)" in proc.stdout
