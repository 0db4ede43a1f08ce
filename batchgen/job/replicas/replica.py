"""One engine replica of a job with several (``engine.data_parallel_size``, ``run.executor``): the engine loop
that runs in a replica's process or Ray actor, fed whole windows by the coordinator
(:mod:`batchgen.job.replicas.coordinator`).

A replica knows nothing of the input or the output directory: it receives *window requests* (a window's
index and its rows to run, each ``(request id, prompt token ids, sampling params, adapter, images)``, already
in prefix-trie order, the rows of one image together) and hands back the engine's :class:`~batchgen.engine.core.outputs.RequestOutput` of every finished request
with a snapshot of its engine's stats. The coordinator owns every decision about what is done.

Invariants:
- Requests are admitted in the order received, at most ``max_in_flight`` unfinished at a time (the engine is
  kept saturated across window boundaries, as :class:`~batchgen.job.feeder.EngineFeeder` does in one process).
- Every request received is returned exactly once by :meth:`ReplicaCore.run` (finished, or failed with
  ``error`` set); a replica that dies returns nothing more, and the coordinator re-sends what it had not
  returned to another replica.
- The local replica process (:func:`main`, :func:`replica_main`) ignores SIGINT,
  SIGTERM and SIGUSR1 (the coordinator decides when the job stops) and exits when its coordinator does.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from batchgen.driver import Driver, EngineRequest
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.core.stats import EngineStats
from batchgen.errors import WorkerLost
from batchgen.lora_request import LoRARequest
from batchgen.sampling_params import SamplingParams

Request = tuple[int, list[int], SamplingParams, LoRARequest | None, tuple[Any, ...]]
"""``(request id = global row index, prompt token ids, sampling params, LoRA adapter or None, images)``: an
image row's :class:`~batchgen.multimodal.inputs.ImageItem` s (content hash, the processor's pixels, placeholder
span), so the replica's encoder cache keys them by the same hash as one engine does."""


STEP_BUDGET_S = 0.05
"""Seconds of engine steps between two reports of a busy replica (finished rows reach the coordinator, its
progress bar and its checkpoints with at most this delay)."""


@dataclass
class WindowRequests:
    """The rows of one window a replica has to run, in feed order."""

    index: int
    requests: list[Request]


@dataclass
class ReplicaSetup:
    """Everything a replica needs to start its engine (plain data: sent to a process or a Ray actor)."""

    replica: int
    model_path: str
    engine: EngineConfig
    dtype: str = "auto"
    implementation: str = "auto"
    max_in_flight: int = 16
    threads: int | None = None
    """CPU: torch intra-op threads of this replica (its share of the cores); None = torch's default."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment set before the engine starts (``CUDA_VISIBLE_DEVICES`` of a local GPU replica)."""
    step_budget_s: float = STEP_BUDGET_S
    """Seconds of engine steps between two reports while busy (0: a report after every step)."""


@dataclass
class ReplicaReport:
    """What a replica hands back: finished requests and its engine's running totals."""

    replica: int
    outputs: list[RequestOutput]
    stats: EngineStats
    busy: bool
    """Whether requests are still unfinished (or waiting to be admitted) in this replica."""
    images: Any = None
    """An image-text model: its encoder's running totals (:class:`~batchgen.models.vision.EncoderStats`)."""


def start_engine(setup: ReplicaSetup) -> Any:
    """The replica's engine, after applying its environment and thread count."""
    os.environ.update(setup.env)
    if setup.threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(setup.threads)
        torch.set_num_threads(setup.threads)
    from batchgen.engine.core.llm_engine import LLMEngine

    return LLMEngine(setup.model_path, setup.engine, dtype=setup.dtype, implementation=setup.implementation)


class ReplicaCore:
    """An engine fed with windows: :meth:`add` queues a window's requests, :meth:`run` drives the engine (it
    is the replica's :class:`~batchgen.driver.Task`)."""

    def __init__(self, setup: ReplicaSetup, engine: Any = None) -> None:
        self.setup = setup
        self.engine = engine if engine is not None else start_engine(setup)
        self.feed: deque[Request] = deque()
        self.finished: list[RequestOutput] = []
        self.driver = Driver(self.engine, self, setup.max_in_flight)

    @property
    def busy(self) -> bool:
        return bool(self.feed) or self.engine.has_unfinished()

    def add(self, windows: list[WindowRequests]) -> None:
        for w in windows:
            self.feed.extend(w.requests)

    def next_request(self) -> EngineRequest | None:
        if not self.feed:
            return None
        rid, ids, params, lora, images = self.feed.popleft()
        return EngineRequest(rid, ids, params, lora, images=images)

    def finish(self, outputs: list[RequestOutput]) -> None:
        self.finished.extend(outputs)

    def run(self, budget_s: float) -> list[RequestOutput]:
        """Step the engine until ``budget_s`` has passed (at least one step when busy) or nothing is left;
        returns the requests that finished."""
        deadline = time.monotonic() + budget_s
        for _ in self.driver.steps():
            if time.monotonic() >= deadline:
                break
        out, self.finished = self.finished, []
        return out

    def report(self, outputs: list[RequestOutput]) -> ReplicaReport:
        images = getattr(self.engine, "images", None)
        enc = replace(images.stats) if images is not None and images.inputs is not None else None
        return ReplicaReport(self.setup.replica, outputs, self.engine.stats.snapshot(), self.busy, enc)


def replica_main(conn: Any, setup: ReplicaSetup) -> None:
    """A local replica process: start the engine, then serve ``("work", [WindowRequests])`` and ``("exit",)``
    messages from ``conn`` until told to exit or the coordinator is gone. Sends ``("ready", max_model_len)``
    (or ``("failed", message)`` when the engine cannot start), then ``("report", ReplicaReport)`` after each
    slice of work. A thread drains ``conn`` all the time, so the coordinator's sends never wait on this
    process's steps (no deadlock of two full pipes)."""
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    inbox: queue.Queue[tuple] = queue.Queue()
    threading.Thread(target=_drain, args=(conn, inbox), name="batchgen-replica-inbox", daemon=True).start()
    threading.Thread(target=_heartbeat, args=(conn,), name="batchgen-replica-heartbeat", daemon=True).start()
    try:
        core = ReplicaCore(setup)
    except BaseException as e:  # noqa: BLE001 - told to the coordinator, which decides what it means
        msg = " ".join(str(e).split()) or type(e).__name__
        _send(conn, ("failed", f"{type(e).__name__}: {msg}"))
        return
    if not _send(conn, ("ready", int(core.engine.max_model_len))):
        return
    while True:
        try:
            msg = inbox.get(block=not core.busy)
        except queue.Empty:
            msg = None
        if msg is not None:
            if msg[0] == "exit":
                return
            core.add(msg[1])
            continue  # take every message waiting before stepping
        try:
            outs = core.run(setup.step_budget_s)
        except WorkerLost:
            os._exit(75)  # a tensor-parallel rank of this replica died: the replica is lost
        except Exception as e:  # noqa: BLE001 - an engine failure: the coordinator fails the job with it
            _send(conn, ("error", f"{type(e).__name__}: {' '.join(str(e).split())}"))
            return
        if not _send(conn, ("report", core.report(outs))):
            return  # the coordinator is gone


HEARTBEAT_S = 1.0
"""Seconds between a replica's ``("heartbeat", None)`` messages: a replica that stops sending them (a
SIGSTOPped or hung process) is declared lost by the coordinator (:data:`batchgen.job.replicas.coordinator.SILENT_S`)."""
_SEND_LOCK = threading.Lock()


def _send(conn: Any, msg: tuple) -> bool:
    """Send ``msg`` to the coordinator; False when it is gone (the replica then exits quietly)."""
    try:
        with _SEND_LOCK:
            conn.send(msg)
        return True
    except OSError:
        return False


def _heartbeat(conn: Any) -> None:
    while _send(conn, ("heartbeat", None)):
        time.sleep(HEARTBEAT_S)


def _drain(conn: Any, inbox: queue.Queue[tuple]) -> None:
    """Move every message of ``conn`` into ``inbox``; ``("exit",)`` when the coordinator is gone."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(("exit",))


def main(argv: list[str] | None = None) -> None:
    """A local replica process (:class:`~batchgen.job.replicas.local.LocalReplicas` starts
    ``python -c "...main(sys.argv[1:])" FD``) on the inherited socket ``FD``, whose first message is the
    :class:`ReplicaSetup`."""
    from multiprocessing.connection import Connection

    args = sys.argv[1:] if argv is None else argv
    conn = Connection(int(args[0]))
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    try:
        setup = conn.recv()
    except (EOFError, OSError):
        return
    replica_main(conn, setup)
