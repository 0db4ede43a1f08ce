"""The coordinator of a job over several engine replicas: hands windows to replicas as they free up, collects
their finished rows, replaces lost replicas.

The replicas (:mod:`batchgen.job.replicas.replica`) run in other processes — local ones
(:class:`~batchgen.job.replicas.local.LocalReplicas`) or Ray actors (:mod:`batchgen.job.replicas.ray_actors`); an
*executor* starts them, carries messages and reports their events: ``("ready", replica, max_model_len)``,
``("report", replica, ReplicaReport)``, ``("lost", replica, reason)`` (the process or actor is gone) and
``("failed", replica, message)`` (its engine could not start: the job exits 2) and ``("error", replica,
message)`` (its engine raised: the job exits 1).

Invariants:
- Windows are handed out from one queue: a replica holding fewer than :data:`DEPTH` unfinished windows gets
  the next one (no static split: a replica that finishes early takes more; a window's rows stay together on
  one replica, in prefix-trie order, so its prefix groups share that replica's cache).
- The coordinator owns every result: a row's first result is kept, any later one ignored; a window is handed
  back by :meth:`Coordinator.run` exactly once, when every row has its result.
- A lost replica's unfinished windows go back to the front of the queue with only their rows still without a
  result; a replacement starts in its slot. Past ``max_restarts`` losses :class:`~batchgen.errors.WorkerLost`
  is raised (the job saves what is finished and exits 75; a rerun resumes exactly once).
- ``run()`` returns once every window is done — however unevenly the replicas finish — or, after a stop
  request, once the windows started are finished or the grace deadline is past (``abandoned`` lists the rest).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.core.stats import _COUNTERS, EngineStats
from batchgen.errors import ConfigError, WorkerLost
from batchgen.job.feeder import StopFlag, WindowWork, pull_window
from batchgen.job.replicas.replica import ReplicaReport, ReplicaSetup, WindowRequests

logger = logging.getLogger("batchgen.job")

DEPTH = 2
"""Windows a replica holds at most: the one it runs and the next (no idle gap at a window boundary)."""
POLL_S = 0.25
"""Longest wait for a replica's event before the coordinator's own work (progress, checkpoints, signals)."""
SILENT_S = 60.0
"""A ready replica holding windows that sent nothing (not even its heartbeat) for this long — a stopped or
hung process — is killed, so it is reported lost and its windows are requeued."""

_SUMMED = (*_COUNTERS, "num_blocks", "running_seqs", "waiting_seqs", "swapped_seqs", "peak_running_seqs",
           "kv_blocks_used")  # fmt: skip
_MAXED = ("peak_kv_usage", "kv_fragmentation", "peak_kv_fragmentation", "block_size", "bytes_per_block",
          "max_model_len")  # fmt: skip


def combine_stats(parts: list[EngineStats]) -> EngineStats:
    """The stats of several engines as one: counters, pool sizes and sequence counts (peaks included) summed,
    KV usage recomputed over the summed pools, peaks of usage and fragmentation the highest, the lowest
    utilization the lowest."""
    out = EngineStats()
    if not parts:
        return out
    for f in fields(EngineStats):
        vals = [getattr(p, f.name) for p in parts]
        if f.name in _SUMMED:
            setattr(out, f.name, sum(vals))
        elif f.name in _MAXED:
            setattr(out, f.name, max(vals))
        elif f.name in ("kv_utilization", "min_kv_utilization"):
            setattr(out, f.name, min(vals))
    out.kv_usage = out.kv_blocks_used / out.num_blocks if out.num_blocks else 0.0
    return out


def add_stats(a: EngineStats, b: EngineStats) -> EngineStats:
    """Counters of ``a`` plus those of ``b`` (an engine that replaced ``a``'s); gauges are ``b``'s."""
    out = replace(b)
    for name in _COUNTERS:
        setattr(out, name, getattr(a, name) + getattr(b, name))
    return out


@dataclass
class ReplicaImages:
    """The job report's ``images`` section over several replicas: image slots and encoder runs summed, distinct
    images those of the rows handed out (an image whose rows went to two replicas counts once), the encoder's
    share of the replicas' time (its seconds over wall time x replicas)."""

    parts: list[Any]
    distinct: int
    replicas: int

    def report(self, wall_time_s: float) -> dict[str, Any]:
        refs = sum(p.references for p in self.parts)
        if not refs:
            return {}
        seconds = sum(p.encoder_seconds for p in self.parts)
        return {
            "images": {
                "references": refs,
                "distinct": self.distinct,
                "encoded": sum(p.encoded for p in self.parts),
                "encoder_time_s": round(seconds, 4),
                "encoder_share": seconds / max(wall_time_s * self.replicas, 1e-9),
            }
        }


@dataclass
class ReplicaSlot:
    """One replica slot: its current process or actor and what the slot did in this run."""

    setup: ReplicaSetup
    ready: bool = False
    windows: list[int] = field(default_factory=list)
    """Indexes of the windows handed to this slot's current replica and not finished."""
    stats: EngineStats = field(default_factory=EngineStats)
    """The current replica's engine totals; ``retired``: those of the replicas it replaced."""
    retired: EngineStats = field(default_factory=EngineStats)
    rows: int = 0
    windows_done: int = 0
    restarts: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    """When the current replica last sent anything (its heartbeat included)."""
    images: Any = None
    """An image-text model: the current replica's encoder totals; ``retired_images``: its predecessors'."""
    retired_images: list[Any] = field(default_factory=list)

    def total_stats(self) -> EngineStats:
        return add_stats(self.retired, self.stats)


class Coordinator:
    """Runs windows from ``next_window`` (None = no more) on the replicas of ``setups`` through ``executor``.

    Offers what the job reads of an :class:`~batchgen.job.feeder.EngineFeeder` (``run()``, ``active``,
    ``abandoned``, ``unfinished_windows()``) and of an engine (``tokenizer``, ``stats``: the replicas' totals
    combined)."""

    def __init__(
        self,
        executor: Any,
        setups: list[ReplicaSetup],
        next_window: Callable[[], WindowWork | None],
        tokenizer: Any,
        stop: StopFlag | None = None,
        max_restarts: int = 0,
        on_output: Callable[[WindowWork, int, RequestOutput], None] | None = None,
        on_step: Callable[[], None] | None = None,
        on_ready: Callable[[int], None] | None = None,
    ) -> None:
        self.executor, self.next_window, self.tokenizer, self.stop = executor, next_window, tokenizer, stop
        self.slots = {s.replica: ReplicaSlot(s) for s in setups}
        self.max_restarts = max_restarts
        self.on_output, self.on_step, self.on_ready = on_output, on_step, on_ready
        self.active: dict[int, WindowWork] = {}  # pulled, not finished: handed out or waiting in `requeue`
        self.requeue: deque[WindowWork] = deque()
        self.order: dict[int, list[int]] = {}  # window index -> positions in feed order
        self.where: dict[int, tuple[WindowWork, int]] = {}  # request id -> (window, position)
        self.abandoned: list[WindowWork] = []
        self.exhausted = False
        self.restarts = 0
        self._ready: deque[WindowWork] = deque()
        self.image_hashes: set[str] = set()

    # ------------------------------------------------------------------------------------ engine-like
    @property
    def stats(self) -> EngineStats:
        return combine_stats([s.total_stats() for s in self.slots.values()])

    @property
    def busy_engines(self) -> int:
        """Replicas holding unfinished windows (at least 1): the engines stepping side by side."""
        return max(1, sum(bool(s.windows) for s in self.slots.values()))

    @property
    def images(self) -> ReplicaImages | None:
        """The replicas' encoder figures as one (None: no replica runs an image-text model)."""
        parts = [x for s in self.slots.values() for x in (*s.retired_images, s.images) if x is not None]
        return ReplicaImages(parts, len(self.image_hashes), len(self.slots)) if parts else None

    @property
    def max_model_len(self) -> int:
        return max((s.stats.max_model_len for s in self.slots.values()), default=0)

    def unfinished_windows(self) -> list[WindowWork]:
        """Windows pulled but not handed back by :meth:`run` (see EngineFeeder.unfinished_windows)."""
        seen: dict[int, WindowWork] = {}
        for w in [*self.abandoned, *self.active.values(), *self._ready]:
            seen.setdefault(w.spec.index, w)
        return sorted(seen.values(), key=lambda w: w.spec.index)

    def replica_report(self, wall_s: float) -> list[dict[str, Any]]:
        """Per replica: rows and windows finished in this run, generated tokens, throughput, restarts, and on the
        CPU the torch threads it computed with (None: torch's default)."""
        wall = max(wall_s, 1e-9)
        out = []
        for r, s in sorted(self.slots.items()):
            gen = s.total_stats().generated_tokens
            out.append({"replica": r, "rows": s.rows, "windows": s.windows_done, "generated_tokens": gen,
                        "rows_per_s": s.rows / wall, "generated_tokens_per_s": gen / wall,
                        "restarts": s.restarts, "threads": s.setup.threads})  # fmt: skip
        return out

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start every replica and wait until each is ready (a stop request ends the wait)."""
        for s in self.slots.values():
            self.executor.start(s.setup)
        while not all(s.ready for s in self.slots.values()) and not self._stopping():
            self._handle(self.executor.events(POLL_S))

    def close(self) -> None:
        self.executor.close()

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _past_deadline(self) -> bool:
        deadline = self.stop.deadline if self.stop is not None else None
        return deadline is None or time.monotonic() >= deadline

    # ------------------------------------------------------------------------------------ the loop
    def run(self) -> Iterator[WindowWork]:
        """Yield every window as it finishes (completion order); see the module docstring for the end."""
        while True:
            if not self._stopping():
                self._hand_out()
            while self._ready:
                yield self._ready.popleft()
            if self._stopping():
                running = any(s.windows for s in self.slots.values())
                if self._past_deadline() or not running:
                    break
            elif self.exhausted and not self.active:
                break
            self._handle(self.executor.events(POLL_S))
            self._check_silent()
            if self.on_step is not None:
                self.on_step()
            while self._ready:
                yield self._ready.popleft()
        self.abandoned = sorted(self.active.values(), key=lambda w: w.spec.index)
        self.active.clear()
        self.requeue.clear()

    def _pull(self) -> WindowWork | None:
        """The next window with rows to run (a requeued one first); windows without any finish at once."""
        if self.requeue:
            return self.requeue.popleft()
        if self.exhausted:
            return None
        work = pull_window(self.next_window, self._ready)
        if work is None:
            self.exhausted = True
            return None
        self.order[work.spec.index] = list(work.feed)
        for row in work.rows:  # the job's distinct images, whichever replicas encode them
            self.image_hashes.update(row.image_hashes)
        work.feed.clear()  # the rows are the replica's to feed; `pending` counts them until done
        self.active[work.spec.index] = work
        return work
        return None

    def _hand_out(self) -> None:
        """Give windows, one at a time, to the ready replica holding the fewest (the lowest slot first)."""
        while True:
            free = [(len(s.windows), r) for r, s in self.slots.items() if s.ready and len(s.windows) < DEPTH]
            if not free:
                return
            r = min(free)[1]
            slot = self.slots[r]
            work = self._pull()
            if work is None:
                return
            requests = []
            for pos in self.order[work.spec.index]:
                if work.results[pos] is None:
                    row = work.rows[pos]
                    self.where[row.row_index] = (work, pos)
                    requests.append(
                        (row.row_index, row.token_ids, row.params, row.lora, tuple(row.images or ()))
                    )
            slot.windows.append(work.spec.index)
            self.executor.send(r, [WindowRequests(work.spec.index, requests)])

    def _check_silent(self) -> None:
        """Kill a replica that holds windows and has been silent for :data:`SILENT_S` (its executor then
        reports it lost); executors without ``kill`` are left to their own liveness checks."""
        kill = getattr(self.executor, "kill", None)
        now = time.monotonic()
        for r, slot in self.slots.items():
            if kill is not None and slot.ready and slot.windows and now - slot.last_seen > SILENT_S:
                logger.warning(
                    "engine replica %d sent nothing for %.0f s: declared lost", r, now - slot.last_seen
                )
                slot.last_seen = now
                kill(r)

    def _handle(self, events: list[tuple[str, int, Any]]) -> None:
        for kind, r, payload in events:
            slot = self.slots[r]
            slot.last_seen = time.monotonic()
            if kind == "heartbeat":
                continue
            if kind == "ready":
                slot.ready = True
                if self.on_ready is not None:
                    self.on_ready(int(payload))
            elif kind == "report":
                self._report(slot, payload)
            elif kind == "lost":
                self._lost(slot, str(payload))
            elif kind == "failed":
                raise ConfigError(f"engine replica {r} could not start: {payload}")
            elif kind == "error":
                raise RuntimeError(f"engine replica {r} failed: {payload}")

    def _report(self, slot: ReplicaSlot, report: ReplicaReport) -> None:
        slot.stats = report.stats
        if report.images is not None:
            slot.images = report.images
        for out in report.outputs:
            loc = self.where.pop(out.request_id, None)
            if loc is None:
                continue  # already has its result (a requeued row finished twice): the first one counts
            work, pos = loc
            work.results[pos] = out
            work.pending -= 1
            slot.rows += 1
            if self.on_output is not None:
                self.on_output(work, pos, out)
            if work.done:
                work.finished_at = time.monotonic()
                self.active.pop(work.spec.index, None)
                if work.spec.index in slot.windows:
                    slot.windows.remove(work.spec.index)
                slot.windows_done += 1
                self._ready.append(work)

    def _lost(self, slot: ReplicaSlot, reason: str) -> None:
        """Requeue the lost replica's unfinished windows and start its replacement (or raise WorkerLost)."""
        r = slot.setup.replica
        slot.retired, slot.stats = slot.total_stats(), EngineStats()
        if slot.images is not None:
            slot.retired_images.append(slot.images)
            slot.images = None
        back = sorted((self.active[i] for i in slot.windows if i in self.active), key=lambda w: w.spec.index)
        slot.windows, slot.ready = [], False
        if not back and self.exhausted and not self.requeue:
            logger.warning("engine replica %d was lost (%s) after its last window: not replaced", r, reason)
            return
        for work in reversed(back):
            self.requeue.appendleft(work)
        self.restarts += 1
        slot.restarts += 1
        if self.restarts > self.max_restarts:
            raise WorkerLost(
                f"engine replica {r} was lost ({reason}); {self.restarts} replica(s) lost in this run, more than "
                f"run.max_replica_restarts={self.max_restarts}"
            )
        logger.warning(
            "engine replica %d was lost (%s): its %d unfinished window(s) go back to the queue; starting a "
            "replacement (%d of run.max_replica_restarts=%d)",
            r, reason, len(back), self.restarts, self.max_restarts,
        )  # fmt: skip
        self.executor.start(slot.setup)
