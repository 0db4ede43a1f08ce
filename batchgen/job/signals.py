"""Stopping a job on a signal: SIGINT, SIGTERM and SIGUSR1 (and submitit's preemption signal in a submitit job).

A signal sets :attr:`StopSignal.requested` and a grace :attr:`StopSignal.deadline` (``run.stop_grace_s``
from now); the feeder stops admitting rows, finishes the rows already admitted until the deadline, the job
saves every finished row (parts and checkpoints) and exits with status 75. A second SIGINT raises
KeyboardInterrupt (abort the rows in flight at once; still 75) — except inside :meth:`StopSignal.saving`,
where the save of finished rows runs: there further SIGINTs are noted and the save completes. The command
(:mod:`batchgen.cli`) keeps a later signal at exit status 75 once the handlers are restored. The handlers are installed for the duration of
:meth:`StopSignal.installed` (the whole of :func:`batchgen.job.run.run_job`, start-up included), and only in
the main thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("batchgen.job")


class StopSignal:
    """Set when the job should stop: ``requested`` and the grace ``deadline`` (time.monotonic)."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self, grace_s: float = 0.0) -> None:
        self.grace_s = grace_s
        self.requested = False
        self.deadline: float | None = None
        self.signal_name: str | None = None
        self._saving = 0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """A block that saves finished rows: a SIGINT inside it does not interrupt it (see the module doc)."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1

    def request(self, name: str = "stop") -> None:
        if not self.requested:
            self.requested = True
            self.signal_name = name
            self.deadline = time.monotonic() + self.grace_s

    def _handler(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            if self._saving:
                logger.warning(
                    "saving the finished rows first: Ctrl-C cannot interrupt the save (kill -9 can)"
                )
                return
            raise KeyboardInterrupt
        self.request(name)
        msg = (
            f"received {name}: no new window is started; "
            + (f"finishing the started windows for up to {self.grace_s:g} s, " if self.grace_s else "")
            + "then saving every finished row and exiting with status 75 (rerun to resume)"
            + ("; press Ctrl-C again to abort at once" if signum == signal.SIGINT else "")
        )
        logger.warning(msg)

    @staticmethod
    def signal_names() -> tuple[tuple[str, ...], str | None]:
        """(signals to handle, signal to hand on to the previous handler after the flush).

        Inside a submitit job, submitit owns SIGTERM (it ignores it: Slurm requeues preempted tasks) and its
        preemption signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default: checkpoint, requeue, exit). We leave
        SIGTERM to it, and treat its signal like SIGUSR1 — stop and flush — then pass it on so submitit
        requeues the task.
        """
        if not os.environ.get("SUBMITIT_EXECUTOR"):
            return StopSignal.SIGNALS, None
        sub = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")
        names = tuple(n for n in StopSignal.SIGNALS if n != "SIGTERM")
        return (*names, sub) if sub not in names else names, sub

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignal]:
        """Install the handlers (main thread only) for the duration of the block, then restore them (and hand
        submitit's preemption signal on to submitit, see :meth:`signal_names`)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        names, hand_on = self.signal_names()
        old = {}
        for name in names:
            sig = getattr(signal, name, None)
            if sig is not None:
                old[sig] = signal.signal(sig, self._handler)
        try:
            yield self
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
            if hand_on is not None and self.signal_name == hand_on:
                sig = getattr(signal, hand_on)
                previous = old.get(sig)
                if callable(previous):
                    previous(sig, None)
