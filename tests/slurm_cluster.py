"""Helpers for tests that talk to a real Slurm cluster (the CI one comes from jobs/ci/start-slurm.sh).

Nothing here starts a cluster: :func:`unavailable_reason` says why the tests must be skipped when `sinfo`
cannot reach one. Job waiting polls `squeue` every 0.5 s (`sbatch --wait` polls only every ~10 s).
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

START_HINT = "start one with `sudo bash jobs/ci/start-slurm.sh` (CI does this before pytest)"


def _run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def unavailable_reason(need_accounting: bool = False) -> str | None:
    """None when a Slurm cluster answers and has a usable node, else why not (for pytest.skip)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return f"no Slurm client (sinfo/sbatch) on PATH; {START_HINT}"
    try:
        p = _run("sinfo", "-h", "-o", "%T", timeout=10)
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer within 10 s; {START_HINT}"
    if p.returncode != 0:
        return f"sinfo cannot reach a cluster ({(p.stderr or p.stdout).strip()[:200]}); {START_HINT}"
    states = p.stdout.split()
    if not any(s.rstrip("*~#$@+") in ("idle", "mixed", "allocated", "completing") for s in states):
        return f"no usable Slurm node (states: {', '.join(states) or 'none'}); {START_HINT}"
    if need_accounting:
        q = _run("sacct", "-n", "-X", "-S", "now-1minutes", "-o", "JobID", timeout=15)
        if q.returncode != 0:
            return f"Slurm accounting (sacct) is not available: {q.stderr.strip()[:200]}"
    return None


def sbatch(*args: str, cwd: Path, env: dict[str, str]) -> str:
    """Submit; returns the job id (for an array: the array's job id)."""
    p = subprocess.run(
        ["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    if p.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout.strip().split(";")[0]


def active(job: str) -> list[tuple[str, str]]:
    """(job id, state) of the job's tasks still pending, running or completing (requeued ones included)."""
    p = _run("squeue", "-h", "-j", job, "-o", "%i %T")
    if p.returncode != 0:  # an unknown id (long finished) is an error for squeue
        return []
    return [tuple(line.split()[:2]) for line in p.stdout.splitlines() if line.strip()]  # type: ignore[misc]


def restarts(job: str) -> int:
    """How many times the (non-array) job has been requeued so far (0 when unknown)."""
    p = _run("scontrol", "show", "job", "-o", job)
    m = re.search(r"\bRestarts=(\d+)", p.stdout)
    return int(m.group(1)) if m else 0


def wait(job: str, timeout: float, poll: float = 0.5) -> None:
    """Wait until no task of `job` is pending, running or completing."""
    deadline = time.monotonic() + timeout
    while active(job):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job} still active after {timeout:.0f} s: {active(job)}")
        time.sleep(poll)


@dataclass
class Run:
    """One run of a task as sacct records it (a requeued task has several)."""

    job_id: str
    state: str
    exit_code: str
    start: str
    end: str


def runs(job: str, timeout: float = 30) -> list[Run]:
    """Every run of every task of `job` (sacct -D: duplicates = requeued runs), oldest first.

    Accounting reaches slurmdbd asynchronously, so this waits (up to `timeout`) until no run of the job
    is shown in a non-final state.
    """
    deadline = time.monotonic() + timeout
    while True:
        p = _run("sacct", "-n", "-X", "-D", "-P", "-j", job, "-o", "JobID,State,ExitCode,Start,End")
        out = [Run(*line.split("|")[:5]) for line in p.stdout.splitlines() if line.strip()]
        unsettled = [r for r in out if r.state.split()[0] in ("PENDING", "RUNNING", "COMPLETING")]
        if out and not unsettled or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def slurmctld_log() -> Path | None:
    p = _run("scontrol", "show", "config")
    m = re.search(r"^SlurmctldLogFile\s*=\s*(\S+)", p.stdout, re.M)
    return Path(m.group(1)) if m else None


_TICK = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)\] debug2: Testing job time limits")


def last_time_limit_pass(max_age_s: float = 40) -> dt.datetime | None:
    """When slurmctld last checked time limits (every ~30 s; logged at debug2), if recently, else None.

    `--signal=...@N` warnings are sent only during these passes: the first pass at which
    ``now + N + 30 >= end_time`` sends them.
    """
    log = slurmctld_log()
    if log is None or not log.is_file():
        return None
    with open(log, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 2_000_000))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        m = _TICK.match(line)
        if m:
            t = dt.datetime.fromisoformat(m.group(1))
            return t if (dt.datetime.now() - t).total_seconds() <= max_age_s else None
    return None
