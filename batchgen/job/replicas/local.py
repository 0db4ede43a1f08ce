"""The local executor of engine replicas: one process per replica on this machine (``run.executor=local``).

Each replica is a fresh interpreter (``python -c``: no CUDA context or threads inherited, and no re-import of
the caller's ``__main__``, so a script needs no ``if __name__ == "__main__"`` guard) running
:func:`batchgen.job.replicas.replica.main` in its own session (a Ctrl-C at the terminal reaches only the job, which
decides), talking to the coordinator over one end of a socket pair; the first message is its
:class:`~batchgen.job.replicas.replica.ReplicaSetup`. A replica whose process ends without being told to — killed, out
of memory, a crash — is reported ``lost`` once, after every message it sent before dying has been delivered.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import subprocess
import sys
from multiprocessing.connection import wait
from typing import Any

from batchgen.job.replicas.replica import ReplicaSetup, WindowRequests

REPLICA_MAIN = "import sys; from batchgen.job.replicas.replica import main; main(sys.argv[1:])"
EXIT_WAIT_S = 5.0
"""Seconds a replica told to exit may take before it is killed."""


class LocalReplicas:
    """Replica processes on this machine, by replica slot (see :mod:`batchgen.job.replicas.coordinator` for events)."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, Any] = {}

    def start(self, setup: ReplicaSetup) -> None:
        r = setup.replica
        ours, theirs = mp.Pipe(duplex=True)
        fd = theirs.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-c", REPLICA_MAIN, str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.procs[r], self.conns[r] = proc, ours
        try:
            ours.send(setup)
        except OSError:
            pass  # it died at once: events() reports it

    def pid(self, replica: int) -> int | None:
        proc = self.procs.get(replica)
        return proc.pid if proc is not None else None

    def kill(self, replica: int) -> None:
        """SIGKILL replica ``replica`` (a stopped process too); :meth:`events` then reports it lost."""
        proc = self.procs.get(replica)
        if proc is not None and proc.poll() is None:
            proc.kill()

    def send(self, replica: int, windows: list[WindowRequests]) -> None:
        # plain pickle: the multiprocessing pickler would pass an image's pixel tensors as shared-memory file
        # descriptors, which a replica started as a fresh interpreter cannot take (the send would hang)
        data = pickle.dumps(("work", windows), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.conns[replica].send_bytes(data)
        except (OSError, KeyError):
            pass  # the replica is gone: its end is reported by events()

    def events(self, timeout: float) -> list[tuple[str, int, Any]]:
        by_conn = {conn: r for r, conn in self.conns.items()}
        out: list[tuple[str, int, Any]] = []
        lost: set[int] = set()
        for conn in wait(list(by_conn), timeout):
            if not self._drain(by_conn[conn], out):
                lost.add(by_conn[conn])
        for r, proc in self.procs.items():  # ended without closing its end first (it cannot, but be sure)
            if r not in lost and proc.poll() is not None and not self._drain(r, out):
                lost.add(r)
        for r in sorted(lost):
            proc = self.procs.pop(r)
            self.conns.pop(r).close()
            try:
                code = proc.wait(1.0)
            except subprocess.TimeoutExpired:  # its pipe broke but it lives on: make sure it is gone
                proc.kill()
                code = proc.wait()
            why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
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
        return self.procs[r].poll() is None

    def close(self) -> None:
        """Tell every replica to exit; kill those still running after :data:`EXIT_WAIT_S`."""
        for conn in self.conns.values():
            try:
                conn.send(("exit", None))
            except OSError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns.values():
            conn.close()
        self.procs.clear()
        self.conns.clear()
