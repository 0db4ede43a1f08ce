"""The engine's thread policy: one decision (batchgen.threads) for the Python API and the command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from batchgen import threads


def test_idle_cores_keep_spinning_and_use_every_cpu() -> None:
    p = threads.decide(2, 0.3, {})
    assert (p.num_threads, p.wait_policy, p.binding, p.busy) == (2, "default", "none", False)


def test_threads_are_the_cpus_other_processes_leave_free() -> None:
    assert threads.decide(2, 1.0, {}).num_threads == 1  # one core taken: one thread, on the free one
    assert threads.decide(16, 4.2, {}).num_threads == 12
    assert threads.decide(16, 4.2, {}, max_threads=8).num_threads == 8  # torch's own count caps it
    p = threads.decide(2, 15.0, {})
    assert (p.num_threads, p.wait_policy, p.busy) == (1, "PASSIVE", True)
    assert "busy" in p.reason


def test_once_openmp_started_its_wait_policy_is_what_it_has() -> None:
    p = threads.decide(4, 6.5, {}, openmp_wait=None, started=True)
    assert (p.num_threads, p.wait_policy) == (1, "default")
    p = threads.decide(4, 6.5, {"OMP_WAIT_POLICY": "PASSIVE"}, openmp_wait="passive", started=True)
    assert p.wait_policy == "PASSIVE"


def test_what_the_user_set_wins() -> None:
    env = {"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "3", "OMP_PROC_BIND": "close"}
    p = threads.decide(2, 9.0, env)
    assert (p.num_threads, p.wait_policy, p.binding) == (3, "ACTIVE", "close")
    assert threads.decide(2, None, {}).busy is False  # no load figure: taken as idle
    assert threads.decide(2, None, {}).num_threads == 2


def test_other_load_sees_a_load_the_average_has_not_caught_up_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "load_average", lambda: 0.2)
    monkeypatch.setattr(threads, "running_now", lambda samples=1, interval=0.0: 1.0)
    assert threads.other_load() == 1.0
    monkeypatch.setattr(threads, "running_now", lambda samples=1, interval=0.0: None)
    assert threads.other_load() == 0.2


def test_running_now_reads_the_kernel_count() -> None:
    r = threads.running_now(samples=3, interval=0.001)
    assert r is None or r >= 0


_PROBE = """
import os, sys
os.getloadavg = lambda: (99.0, 0.0, 0.0)
import {module}
from batchgen import threads
print(os.environ.get("OMP_WAIT_POLICY"), threads._wait_policy_at_start, "torch" in sys.modules)
"""


@pytest.mark.parametrize("module", ["batchgen", "batchgen.cli"])
def test_api_and_command_line_export_the_wait_policy_before_torch(module: str) -> None:
    """Importing batchgen (the API) or the command's module takes the same decision before torch loads: on busy
    cores OpenMP will start with sleeping waiters."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout.split()
    assert out[-3:] == ["PASSIVE", "PASSIVE", "False"]


@pytest.fixture
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("_restore_threads")
def test_llm_applies_the_policy_where_the_engine_is_built(
    llama_ckpt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On busy cores LLM runs one thread; on idle ones torch's own count (the same decision as the command's)."""
    from batchgen import LLM

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "other_load", lambda samples=1: 99.0)
    llm = LLM(llama_ckpt, num_blocks=16, device="cpu")
    assert llm.engine.thread_policy == threads.current()
    assert llm.engine.thread_policy.num_threads == 1 == torch.get_num_threads()
    monkeypatch.setattr(threads, "other_load", lambda samples=1: 0.0)
    llm = LLM(llama_ckpt, num_blocks=16, device="cpu")
    assert llm.engine.thread_policy.num_threads == torch.get_num_threads() == threads._torch_threads()
    assert not llm.engine.thread_policy.busy
