"""The coordinator of engine replicas with an in-process fake executor (no processes, no model): windows go
to whichever replica frees up, every row's first result counts, a lost replica's unfinished rows (only
those) are rerun by others, the restart bound ends the run with WorkerLost, uneven replicas never hang."""

from __future__ import annotations

from collections import deque

import pytest

from batchgen.data.prompts import PromptRow
from batchgen.data.reader import WindowSpec
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
from batchgen.engine.core.stats import EngineStats
from batchgen.errors import WorkerLost
from batchgen.job.feeder import WindowWork
from batchgen.job.replicas.coordinator import Coordinator
from batchgen.job.replicas.replica import ReplicaReport, ReplicaSetup
from batchgen.sampling_params import SamplingParams


class FakeReplicas:
    """Replica r finishes ``speed[r]`` requests per event round; ``kill(r)`` loses it at the next round."""

    def __init__(self, speed: dict[int, int]) -> None:
        self.speed = speed
        self.queues: dict[int, deque] = {}
        self.pending: list[tuple[str, int, object]] = []
        self.doomed: set[int] = set()
        self.ran: list[tuple[int, int]] = []  # (replica, request id) in the order they finished
        self.starts = 0
        self.rounds = 0

    def start(self, setup: ReplicaSetup) -> None:
        self.starts += 1
        self.queues[setup.replica] = deque()
        self.pending.append(("ready", setup.replica, 64))

    def send(self, r: int, windows) -> None:
        for w in windows:
            self.queues[r].extend(w.requests)

    def kill(self, r: int) -> None:
        self.doomed.add(r)

    def events(self, timeout: float):
        self.rounds += 1
        assert self.rounds < 10_000, "the coordinator does not finish"
        out, self.pending = self.pending, []
        for r in sorted(self.queues):
            if r in self.doomed:
                self.doomed.discard(r)
                del self.queues[r]
                out.append(("lost", r, "killed by the test"))
                continue
            q, done = self.queues[r], []
            for _ in range(min(self.speed[r], len(q))):
                rid, tokens, _params, _lora, _images = q.popleft()
                done.append(RequestOutput(rid, tokens, [CompletionOutput(0, f"t{rid}", [rid], "length")]))
                self.ran.append((r, rid))
            if done:
                st = EngineStats(generated_tokens=len(self.ran), num_blocks=10)
                out.append(("report", r, ReplicaReport(r, done, st, bool(q))))
        return out

    def close(self) -> None:
        self.queues.clear()


def windows(sizes: list[int]):
    """Windows of the given sizes (global row ids consecutive), handed out lazily."""
    start, out = 0, []
    for i, n in enumerate(sizes):
        rows = [PromptRow(p, start + p, start + p, [1, 2, start + p], SamplingParams()) for p in range(n)]
        out.append(WindowWork.create(WindowSpec(i, start, start + n), rows, group_by_prefix=False))
        start += n
    it = iter(out)
    return lambda: next(it, None)


def coordinator(fake: FakeReplicas, sizes: list[int], restarts: int = 3, **kw) -> Coordinator:
    setups = [ReplicaSetup(r, "m", EngineConfig()) for r in sorted(fake.speed)]
    return Coordinator(fake, setups, windows(sizes), tokenizer=None, max_restarts=restarts, **kw)


def test_uneven_replicas_and_windows_every_row_once() -> None:
    fake = FakeReplicas({0: 50, 1: 1})  # replica 1 is 50x slower
    sizes = [7, 3, 9, 1, 8, 8, 2]
    c = coordinator(fake, sizes)
    c.start()
    done = list(c.run())
    assert sorted(w.spec.index for w in done) == list(range(len(sizes)))
    assert all(w.done and all(r is not None for r in w.results) for w in done)
    rids = [rid for _, rid in fake.ran]
    assert sorted(rids) == list(range(sum(sizes)))  # every row ran exactly once
    by_replica = {r: sum(1 for x, _ in fake.ran if x == r) for r in (0, 1)}
    assert by_replica[0] > by_replica[1] > 0  # the fast replica took more windows: no static split
    report = c.replica_report(1.0)
    assert [x["rows"] for x in report] == [by_replica[0], by_replica[1]]
    assert all("threads" in x for x in report)
    assert c.stats.num_blocks == 20


def test_windows_alternate_between_replicas() -> None:
    fake = FakeReplicas({0: 1, 1: 1})
    c = coordinator(fake, [2, 2])
    c.start()
    list(c.run())
    assert {r for r, rid in fake.ran if rid < 2} != {r for r, rid in fake.ran if rid >= 2}


def test_lost_replica_rows_rerun_elsewhere_first_result_kept() -> None:
    fake = FakeReplicas({0: 2, 1: 3})
    sizes = [6, 6, 6, 6]
    outputs: list[int] = []
    c = coordinator(fake, sizes, on_output=lambda w, p, out: outputs.append(out.request_id))
    c.start()
    it = c.run()
    first = next(it)  # some rows of replica 0's windows are back, its windows are not finished
    fake.kill(0)
    rest = list(it)
    assert sorted(w.spec.index for w in [first, *rest]) == [0, 1, 2, 3]
    assert sorted(outputs) == list(range(24))  # each row's result counted once
    ran = [rid for _, rid in fake.ran]
    assert sorted(set(ran)) == list(range(24)) and len(ran) == 24  # rows done before the loss are not rerun
    assert c.restarts == 1 and fake.starts == 3 and c.slots[0].restarts == 1


def test_past_the_bound_worker_lost_keeps_finished_rows() -> None:
    fake = FakeReplicas({0: 1, 1: 1})
    c = coordinator(fake, [4, 4, 4], restarts=0)
    c.start()
    it = c.run()
    fake.kill(1)
    with pytest.raises(WorkerLost, match="run.max_replica_restarts=0"):
        list(it)
    finished = sum(1 for w in c.unfinished_windows() for r in w.results if r is not None)
    assert finished == len(fake.ran) > 0  # what a checkpoint will save


def test_loss_after_the_last_window_is_not_replaced() -> None:
    fake = FakeReplicas({0: 100, 1: 100})
    c = coordinator(fake, [3], restarts=0)
    c.start()
    it = c.run()
    fake.kill(1)  # replica 1 never had a window
    assert [w.spec.index for w in it] == [0]
    assert fake.starts == 2
