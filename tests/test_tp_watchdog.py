"""The tensor-parallel watchdog never ends the process: a worker lost mid-step aborts the process group, so the
blocked collective raises in the engine's thread (and the job maps that to its exit status)."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import torch

from batchgen.engine.worker import tp_launch


class _DeadProc:
    returncode = -9

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def kill(self) -> None:
        pass


def test_lost_worker_mid_step_aborts_the_group_instead_of_exiting(monkeypatch) -> None:
    aborted = threading.Event()
    monkeypatch.setattr(tp_launch, "GRACE_S", 0.0)
    monkeypatch.setattr(tp_launch, "abort_process_group", lambda channel: aborted.set())
    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(AssertionError(f"os._exit({code})")))
    channel = SimpleNamespace(lost=None, post=lambda message: None)
    group = tp_launch.TPGroup(channel, torch.device("cpu"), [_DeadProc()])  # type: ignore[arg-type]
    group.runner = SimpleNamespace(in_step=True)  # type: ignore[assignment]
    try:
        assert aborted.wait(5.0), "the watchdog did not abort the process group"
        assert channel.lost == "tensor-parallel worker rank 1 was killed by signal 9"
        time.sleep(0.5)  # it aborts once, and the thread is still alive (no exit)
    finally:
        group.close()
