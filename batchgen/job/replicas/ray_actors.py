"""The Ray executor of engine replicas (``run.executor=ray``): each replica is a Ray actor; the coordinator
(:mod:`batchgen.job.replicas.coordinator`) and the output directory stay in the job's process.

The cluster is ``run.ray_address``, else ``$RAY_ADDRESS``, else a local Ray started for the job. An actor
requests ``engine.tensor_parallel_size`` GPUs on CUDA (Ray sets its ``CUDA_VISIBLE_DEVICES``), or its share
of threads in CPUs. Each actor has at most one call in flight: :meth:`ReplicaActor.work` adds the windows
sent since the last call and steps the engine for its setup's ``step_budget_s``, returning
the finished requests; the next call is made at once while the replica is busy. An actor that dies (its
process killed, its node lost) is reported ``lost``: the coordinator requeues its windows and starts a
replacement actor. Ray's own actor restarts are off (``max_restarts=0``): the coordinator decides.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from batchgen.job.replicas.replica import (
    ReplicaCore,
    ReplicaReport,
    ReplicaSetup,
    WindowRequests,
)

logger = logging.getLogger("batchgen.job")


class ReplicaActor:
    """A replica as a Ray actor (decorated with ``ray.remote`` when the executor starts one)."""

    def __init__(self, setup: ReplicaSetup) -> None:
        self.core: ReplicaCore | None = None
        self.error: str | None = None
        try:
            self.core = ReplicaCore(setup)
        except Exception as e:  # noqa: BLE001 - told to the coordinator by ready(), which decides
            self.error = f"{type(e).__name__}: {' '.join(str(e).split()) or type(e).__name__}"

    def ready(self) -> int | str:
        """The engine's max_model_len, or why the engine could not start."""
        return self.error if self.core is None else int(self.core.engine.max_model_len)

    def pid(self) -> int:
        return os.getpid()

    def work(self, windows: list[WindowRequests]) -> ReplicaReport:
        assert self.core is not None
        self.core.add(windows)
        return self.core.report(self.core.run(self.core.setup.step_budget_s))


def _uses_gpu(setup: ReplicaSetup) -> bool:
    if setup.engine.device.startswith("cuda"):
        return True
    if setup.engine.device != "auto":
        return False
    return float(ray.cluster_resources().get("GPU", 0)) > 0


class RayReplicas:
    """Replica actors on a Ray cluster, by replica slot (see :mod:`batchgen.job.replicas.coordinator` for events)."""

    def __init__(self, address: str | None = None) -> None:
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS") or None
            logger.info("connecting to Ray at %s", address or "a new local instance")
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self.remote_cls = ray.remote(ReplicaActor)
        self.actors: dict[int, Any] = {}
        self.calls: dict[Any, tuple[int, str, Any]] = {}  # ref -> (replica, kind, actor)
        self.waiting: dict[int, list[WindowRequests]] = {}
        self.in_flight: set[int] = set()

    def start(self, setup: ReplicaSetup) -> None:
        r = setup.replica
        gpu = _uses_gpu(setup)
        options: dict[str, Any] = {"max_restarts": 0, "name": None}
        options["num_gpus"] = setup.engine.tensor_parallel_size if gpu else 0
        options["num_cpus"] = 1 if gpu else (setup.threads or 1)
        if gpu:  # Ray assigns the devices: the replica addresses them as cuda:0..T-1
            setup.env = {k: v for k, v in setup.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        actor = self.remote_cls.options(**options).remote(setup)
        self.actors[r] = actor
        self.waiting[r] = []
        self.in_flight.add(r)
        self.calls[actor.ready.remote()] = (r, "ready", actor)

    def pid(self, replica: int) -> int:
        return int(ray.get(self.actors[replica].pid.remote()))

    def send(self, replica: int, windows: list[WindowRequests]) -> None:
        if replica not in self.actors:
            return
        self.waiting[replica].extend(windows)
        if replica not in self.in_flight:
            self._call(replica)

    def _call(self, r: int) -> None:
        windows, self.waiting[r] = self.waiting[r], []
        actor = self.actors[r]
        self.calls[actor.work.remote(windows)] = (r, "work", actor)
        self.in_flight.add(r)

    def events(self, timeout: float) -> list[tuple[str, int, Any]]:
        if not self.calls:
            time.sleep(timeout)
            return []
        refs = list(self.calls)
        done, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if done and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            done += more
        out: list[tuple[str, int, Any]] = []
        for ref in done:
            r, kind, actor = self.calls.pop(ref)
            if self.actors.get(r) is not actor:
                continue  # an answer of a replica already replaced
            self.in_flight.discard(r)
            try:
                value = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                out.append(self._lost(r, f"its Ray actor died: {type(e).__name__}"))
                continue
            except ray.exceptions.RayTaskError as e:  # an error of the engine itself: not a lost actor
                raise RuntimeError(f"engine replica {r} failed: {' '.join(str(e.cause or e).split())}") from e
            if kind == "ready":
                out.append(("failed", r, value) if isinstance(value, str) else ("ready", r, value))
            else:
                out.append(("report", r, value))
                if value.busy or self.waiting[r]:
                    self._call(r)
                continue
            if self.waiting[r]:
                self._call(r)
        return out

    def _lost(self, r: int, reason: str) -> tuple[str, int, Any]:
        actor = self.actors.pop(r)
        self.waiting.pop(r, None)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        return ("lost", r, reason)

    def close(self) -> None:
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors.clear()
        self.calls.clear()
        self.waiting.clear()
        self.in_flight.clear()
