"""The engine's thread policy: one decision (batchgen.runtime.threads) for the Python API and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from batchgen.runtime import threads


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


def test_other_load_is_the_larger_of_cpu_time_and_runnable_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = iter([threads.CpuSample(0.0, 100.0, 5.0), threads.CpuSample(0.5, 100.6, 5.1)])
    monkeypatch.setattr(threads, "cpu_sample", lambda: next(samples))
    monkeypatch.setattr(threads, "running_now", lambda samples=1, interval=0.0: 0.0)
    assert threads.other_load() == pytest.approx(1.0)  # 0.6 CPU-s busy, 0.1 of them ours, in 0.5 s
    samples = iter([threads.CpuSample(0.0, 100.0, 5.0), threads.CpuSample(0.5, 100.1, 5.1)])
    monkeypatch.setattr(threads, "running_now", lambda samples=1, interval=0.0: 3.0)
    assert threads.other_load() == 3.0  # waiting for a CPU takes no CPU time: the runnable count sees it
    monkeypatch.setattr(threads, "cpu_sample", lambda: None)
    monkeypatch.setattr(threads, "running_now", lambda samples=1, interval=0.0: None)
    assert threads.other_load() is None


def test_running_now_reads_the_kernel_count() -> None:
    r = threads.running_now(samples=3, interval=0.001)
    assert r is None or r >= 0
    assert threads.cpu_sample() is None or threads.cpu_sample().busy > 0


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_other_load_measures_processes_that_run_now() -> None:
    """Two busy processes started a moment ago (not yet in the 1-minute load average) are seen."""
    if threads.cpu_sample() is None:
        pytest.skip("no /proc/stat (not Linux)")
    loops = _busy_loops(2)
    try:
        time.sleep(0.3)
        assert threads.other_load() >= 1.0
    finally:
        for p in loops:
            p.kill()
            p.wait()


def test_monitor_changes_the_count_when_two_looks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    busy = [0.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads, "cpu_sample", lambda: threads.CpuSample(clock[0], busy[0], 0.0))
    policy = threads.decide(4, 0.0, {})
    mon = threads.ThreadMonitor(policy, cpus=4, cap=4, period=2.0)

    def look(others: float, after: float = 2.0) -> threads.ThreadPolicy | None:
        clock[0] += after
        busy[0] += others * after
        return mon.poll()

    assert mon.poll() is None  # the first look only takes a sample
    assert look(0.0) is None
    assert look(1.0, after=0.5) is None  # too soon: no look
    assert look(2.0) is None  # a new count once: not yet
    changed = look(2.1)
    assert changed is not None and changed.num_threads == 2 and mon.policy is changed
    assert "re-decided" in changed.reason
    assert look(3.9) is None and look(0.0) is None  # 1, then 4: two looks that disagree change nothing
    assert mon.policy.num_threads == 2
    assert look(0.0) is not None and mon.policy.num_threads == 4  # the load left: every CPU again
    assert look(9.0) is None and look(9.0).num_threads == 1  # never below one thread
    mon.cap = 2
    assert look(0.0) is None and look(0.0).num_threads == 2  # never above the cap


def test_a_look_now_decides_at_the_next_poll_from_the_load_then(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller about to time steps (the dry run's calibration) has the count decided again from a look when it
    asks, returned by the next poll whatever the period and without a second look to agree."""
    clock = [0.0]
    load = [3.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads, "cpu_sample", lambda: threads.CpuSample(clock[0], 0.0, 0.0))
    monkeypatch.setattr(threads, "other_load", lambda *a, **k: load[0])
    mon = threads.ThreadMonitor(threads.decide(4, 0.0, {}), cpus=4, cap=4, period=2.0)
    assert mon.poll() is None and mon.policy.num_threads == 4
    mon.look_now()
    load[0] = 0.0  # the look was taken when asked for, not at the poll
    changed = mon.poll()  # no time has passed: a plain poll would not look
    assert changed is not None and changed.num_threads == 1 and "looked again" in changed.reason
    mon.look_now()
    assert mon.poll().num_threads == 4
    assert mon.poll() is None  # one change per look
    mon.look_now()
    assert mon.poll() is None  # the same count: nothing to change


def test_the_calibration_takes_the_thread_decision_again_before_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dry run tokenizes its whole input between building the engine and calibrating: the calibration has
    the engine look at the load again before its first timed step."""
    from batchgen.job import calibrate

    looked = []

    class Engine:
        def look_at_threads(self) -> None:
            looked.append(True)
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        calibrate.run_calibration(Engine(), [], 1, lambda cal: 1.0, 1)
    assert looked == [True]
    # a prompt-only plan's calibration (embed, classify, score) too, before its first (untimed) chunk
    from batchgen.job import prefill_plan

    calls: list[str] = []
    task = prefill_plan.PrefillTask(
        window_rows=lambda table, start: ([], []), run=lambda rows: calls.append("run"), computed=lambda: None,
        tokenizer=None, max_model_len=64, device="cpu", prefix_caching=False, batch_rows=lambda tokens: 4,
        look_at_threads=lambda: calls.append("look"),
    )  # fmt: skip
    row = calibrate.CalibrationRow(0, [1, 2, 3], None, (0, 0))
    prefill_plan.calibrate(task, [row], (1.0, 3.0, 0.0), 0.05)
    assert calls[:2] == ["look", "run"]


_PROBE = """
import os, subprocess, sys, time
n = len(os.sched_getaffinity(0)) + 2
loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
time.sleep(0.5)
import {module}
for p in loops:
    p.kill()
from batchgen.runtime import threads
print(os.environ.get("OMP_WAIT_POLICY"), threads._wait_policy_at_start, "torch" in sys.modules)
"""


@pytest.mark.parametrize("module", ["batchgen", "batchgen.cli"])
def test_api_and_command_line_export_the_wait_policy_before_torch(module: str) -> None:
    """Importing batchgen (the API) or the command's module takes the same decision before torch loads: on busy
    cores (two busy processes more than this machine's CPUs) OpenMP will start with sleeping waiters."""
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


@pytest.mark.parametrize(("looks", "wait"), [([5.0, 0.0], None), ([5.0, 5.0], "PASSIVE")])
def test_wait_policy_needs_two_busy_looks(monkeypatch: pytest.MonkeyPatch, looks, wait) -> None:
    """The wait policy lasts as long as the process: a burst seen by the first look only (another program
    exiting) leaves libgomp's default; busy on both looks exports PASSIVE."""
    readings = iter(looks)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threads, "openmp_started", lambda: False)
    monkeypatch.setattr(threads, "cpus_available", lambda: 2)
    monkeypatch.setattr(threads, "other_load", lambda window, samples=5: next(readings))
    monkeypatch.setattr(threads, "_wait_policy_at_start", None)
    monkeypatch.setattr(threads, "_prepared_before_openmp", False)
    policy = threads.prepare()
    assert os.environ.get("OMP_WAIT_POLICY") == wait and threads._wait_policy_at_start == wait
    assert policy.wait_policy == (wait or "default")
    assert next(readings, "spent") == "spent"


def test_no_load_measured_where_it_cannot_change_the_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenMP running with one thread (or OMP_NUM_THREADS set): the count and wait policy are fixed, so no
    window is spent measuring; with more threads the load decides. Before OpenMP, a wait policy the user set
    needs no look either."""
    looks = []

    def other_load(window=0.2, samples=5):
        looks.append(window)
        return 0.0

    monkeypatch.setattr(threads, "other_load", other_load)
    monkeypatch.setattr(threads, "openmp_started", lambda: True)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_torch_threads", lambda: 1)
    assert threads.current().num_threads == 1 and looks == []
    monkeypatch.setattr(threads, "_torch_threads", lambda: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.current().num_threads == 3 and looks == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads.current()
    assert looks == [0.2]
    monkeypatch.setattr(threads, "openmp_started", lambda: False)
    monkeypatch.setattr(threads, "_prepared_before_openmp", False)
    monkeypatch.setattr(threads, "_wait_policy_at_start", None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert threads.prepare().wait_policy == "ACTIVE" and looks == [0.2]


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
    monkeypatch.setattr(threads, "other_load", lambda window=0.2, samples=5: 99.0)
    llm = LLM(llama_ckpt, num_blocks=16, device="cpu")
    assert llm.engine.thread_policy == threads.current()
    assert llm.engine.thread_policy.num_threads == 1 == torch.get_num_threads()
    monkeypatch.setattr(threads, "other_load", lambda window=0.2, samples=5: 0.0)
    llm = LLM(llama_ckpt, num_blocks=16, device="cpu")
    assert llm.engine.thread_policy.num_threads == torch.get_num_threads() == threads._torch_threads()
    assert not llm.engine.thread_policy.busy


@pytest.mark.usefixtures("_restore_threads")
def test_a_redecided_count_is_set_between_steps(llama_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine polls its monitor before each forward and sets a new count in the thread that runs it."""
    from batchgen import LLM, SamplingParams

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "other_load", lambda window=0.2, samples=5: 0.0)
    llm = LLM(llama_ckpt, num_blocks=16, device="cpu")
    mon = llm.engine._threads
    assert mon is not None and llm.engine.thread_policy is mon.policy
    looks = iter([None, threads.ThreadPolicy(1, "default", "none", True, "re-decided while running: test")])

    def poll() -> threads.ThreadPolicy | None:
        new = next(looks, None)
        if new is not None:
            mon.policy = new
        return new

    monkeypatch.setattr(mon, "poll", poll)
    llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0.0))
    assert torch.get_num_threads() == 1
    assert llm.engine.thread_policy.reason == "re-decided while running: test"
