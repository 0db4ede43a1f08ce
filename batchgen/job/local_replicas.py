"""The local executor of engine replicas: one process per replica on this machine (``run.executor=local``).

Processes are started with the ``spawn`` method (a fresh interpreter: no CUDA context or threads inherited)
and talk to the coordinator over a pipe each (:func:`batchgen.job.replica.replica_main`). A replica whose
process ends without being told to — killed, out of memory, a crash — is reported ``lost`` once, after every
message it sent before dying has been delivered.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import wait
from typing import Any

from batchgen.job.replica import ReplicaSetup, WindowRequests, replica_main

EXIT_WAIT_S = 5.0
"""Seconds a replica told to exit may take before it is killed."""


class LocalReplicas:
    """Replica processes on this machine, by replica slot (see :mod:`batchgen.job.coordinator` for events)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}

    def start(self, setup: ReplicaSetup) -> None:
        r = setup.replica
        ours, theirs = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(
            target=replica_main, args=(theirs, setup), name=f"batchgen-replica-{r}", daemon=True
        )
        proc.start()
        theirs.close()
        self.procs[r], self.conns[r] = proc, ours

    def pid(self, replica: int) -> int | None:
        proc = self.procs.get(replica)
        return proc.pid if proc is not None else None

    def send(self, replica: int, windows: list[WindowRequests]) -> None:
        try:
            self.conns[replica].send(("work", windows))
        except (OSError, KeyError):
            pass  # the replica is gone: its end is reported by events()

    def events(self, timeout: float) -> list[tuple[str, int, Any]]:
        by_handle = {}
        for r, conn in self.conns.items():
            by_handle[conn] = r
            by_handle[self.procs[r].sentinel] = r
        out: list[tuple[str, int, Any]] = []
        lost: set[int] = set()
        for h in wait(list(by_handle), timeout):
            r = by_handle[h]
            if r in lost or r not in self.conns:
                continue
            if not self._drain(r, out):
                lost.add(r)
        for r in sorted(lost):
            proc = self.procs.pop(r)
            self.conns.pop(r).close()
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
            code = proc.exitcode
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            out.append(("lost", r, f"its process ended: {why}"))
        return out

    def _drain(self, r: int, out: list[tuple[str, int, Any]]) -> bool:
        """Move replica ``r``'s waiting messages into ``out``; False when its process has ended."""
        conn = self.conns[r]
        try:
            while conn.poll(0):
                kind, payload = conn.recv()
                out.append((kind, r, payload))
        except (EOFError, OSError):
            return False
        return self.procs[r].is_alive()

    def close(self) -> None:
        """Tell every replica to exit; kill those still running after :data:`EXIT_WAIT_S`."""
        for conn in self.conns.values():
            try:
                conn.send(("exit", None))
            except OSError:
                pass
        for proc in self.procs.values():
            proc.join(EXIT_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns.values():
            conn.close()
        self.procs.clear()
        self.conns.clear()
