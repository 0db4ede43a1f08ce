"""Prefix grouping order and the engine feed loop (with a small fake engine)."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from batchgen.data.prompts import PromptRow
from batchgen.data.reader import WindowSpec
from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
from batchgen.job.feeder import EngineFeeder, WindowWork, prefix_order
from batchgen.sampling_params import SamplingParams


def test_prefix_order_is_trie_dfs_order() -> None:
    seqs = [[3, 1], [1, 2, 3], [1, 2], [2], [1, 2, 3, 4], [1], [3, 1]]
    order = prefix_order(seqs)
    assert [seqs[i] for i in order] == sorted(seqs)
    assert order == [5, 2, 1, 4, 3, 0, 6]  # ties keep input order (0 before 6)


def test_prefix_order_groups_shared_prefixes() -> None:
    rng = random.Random(0)
    heads = [[rng.randrange(50) for _ in range(8)] for _ in range(5)]
    seqs = [heads[i % 5] + [rng.randrange(50) for _ in range(3)] for i in range(50)]
    order = prefix_order(seqs)
    # every template's rows end up contiguous
    groups = [tuple(seqs[i][:8]) for i in order]
    changes = sum(1 for a, b in zip(groups, groups[1:]) if a != b)
    assert changes == len(set(groups)) - 1


@dataclass
class FakeEngine:
    """Runs at most `max_num_seqs` requests at a time; request r emits params.max_tokens tokens."""

    max_num_seqs: int = 4
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    added: list = field(default_factory=list)
    peak_unfinished: int = 0
    steps: int = 0
    aborted: list = field(default_factory=list)
    unfinished_at_step: list = field(default_factory=list)

    def add_request(self, rid, prompt, params, **options) -> None:
        self.waiting.append([rid, list(prompt), params, []])
        self.added.append(rid)
        self.peak_unfinished = max(self.peak_unfinished, self.num_unfinished())

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return self.num_unfinished() > 0

    def abort_request(self, rid) -> None:
        self.aborted.append(rid)
        self.waiting = deque(r for r in self.waiting if r[0] != rid)
        self.running = [r for r in self.running if r[0] != rid]

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        self.unfinished_at_step.append((self.num_unfinished(), len(self.added)))
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.popleft())
        done = []
        for r in self.running:
            r[3].append((sum(r[1]) + len(r[3])) % 97)
            if len(r[3]) >= r[2].max_tokens:
                done.append(r)
        for r in done:
            self.running.remove(r)
        return [RequestOutput(r[0], r[1], [CompletionOutput(0, str(r[3]), r[3], "length")], 0) for r in done]


def _window(index: int, start: int, n: int, bad: set[int] = frozenset(), rng=None) -> WindowWork:
    rng = rng or random.Random(index)
    rows = []
    for i in range(n):
        r = PromptRow(i, start + i, start + i)
        if i in bad:
            r.error = "bad"
        else:
            r.token_ids = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            r.params = SamplingParams(max_tokens=rng.randrange(1, 6))
        rows.append(r)
    return WindowWork.create(WindowSpec(index, start, start + n), rows, group_by_prefix=True)


def _run(
    engine: FakeEngine, windows: list[WindowWork], max_in_flight: int, stop=None
) -> tuple[list[WindowWork], EngineFeeder]:
    it = iter(windows)
    feeder = EngineFeeder(engine, lambda: next(it, None), max_in_flight, stop)
    return list(feeder.run()), feeder


def test_feeder_completes_every_window_with_results_in_input_order() -> None:
    wins = [_window(w, w * 10, 10, bad={3} if w == 1 else set()) for w in range(5)]
    wins.append(_window(5, 50, 2, bad={0, 1}))  # a window without valid rows
    engine = FakeEngine(max_num_seqs=4)
    done, feeder = _run(engine, wins, max_in_flight=8)
    assert sorted(w.spec.index for w in done) == list(range(6))
    assert engine.peak_unfinished <= 8
    for w in done:
        for row, res in zip(w.rows, w.results):
            if row.ok:
                assert res.request_id == row.row_index and res.prompt_token_ids == row.token_ids
            else:
                assert res is None
    assert sorted(engine.added) == sorted(r.row_index for w in wins for r in w.rows if r.ok)
    assert not feeder.abandoned


def test_feeder_admits_in_prefix_order_and_overlaps_windows() -> None:
    wins = [_window(w, w * 12, 12) for w in range(3)]
    feed_orders = [list(w.feed) for w in wins]
    engine = FakeEngine(max_num_seqs=2)
    _run(engine, wins, max_in_flight=4)
    expected = [wins[w].rows[p].row_index for w in range(3) for p in feed_orders[w]]
    assert engine.added == expected
    for w in wins:
        keys = [w.rows[p].token_ids for p in feed_orders[w.spec.index]]
        assert keys == sorted(keys)
    # saturation across window boundaries: until the last row is added, 4 requests are always in flight
    total = len(expected)
    assert all(n == 4 for n, added in engine.unfinished_at_step if added < total)


class _Stop:
    def __init__(self) -> None:
        self.requested = False
        self.deadline = None


def test_feeder_stop_abandons_started_windows() -> None:
    wins = [_window(w, w * 10, 10) for w in range(6)]
    engine = FakeEngine(max_num_seqs=2)
    stop = _Stop()
    it = iter(wins)
    feeder = EngineFeeder(engine, lambda: next(it, None), 4, stop)
    done = []
    for w in feeder.run():
        done.append(w.spec.index)
        if len(done) == 2:
            stop.requested = True  # deadline None: abandon at once
    assert done == [0, 1]
    assert feeder.abandoned and all(not w.done for w in feeder.abandoned)
    assert set(engine.aborted) and not engine.has_unfinished()
    assert next(it).spec.index > max(w.spec.index for w in feeder.abandoned)  # nothing new was pulled


def test_feeder_stop_with_grace_finishes_fully_admitted_windows() -> None:
    import time

    wins = [_window(w, w * 6, 6) for w in range(4)]
    engine = FakeEngine(max_num_seqs=3)
    stop = _Stop()
    it = iter(wins)

    def on_step() -> None:
        stop.requested, stop.deadline = True, time.monotonic() + 60

    feeder = EngineFeeder(engine, lambda: next(it, None), 6, stop, on_step=on_step)  # window 0 fully admitted
    done = [w.spec.index for w in feeder.run()]
    # the first window was admitted before the stop; nothing else could be admitted after
    assert done == [0] and not feeder.abandoned


def test_feeder_grace_admits_the_rest_of_started_windows_and_starts_no_new_one() -> None:
    import time

    wins = [_window(w, w * 10, 10) for w in range(3)]
    engine = FakeEngine(max_num_seqs=2)
    stop = _Stop()
    it = iter(wins)

    def on_step() -> None:  # stop after the first step: window 0 is only partly admitted (4 of 10 rows)
        if not stop.requested:
            stop.requested, stop.deadline = True, time.monotonic() + 600

    feeder = EngineFeeder(engine, lambda: next(it, None), 4, stop, on_step=on_step)
    done = [w.spec.index for w in feeder.run()]  # returns when window 0 is done, long before the deadline
    assert done == [0] and not feeder.abandoned
    assert sorted(engine.added) == [r.row_index for r in wins[0].rows]
    assert next(it).spec.index == 1  # window 1 was never started


def test_feeder_grace_past_deadline_abandons_the_started_window() -> None:
    import time

    wins = [_window(w, w * 10, 10) for w in range(2)]
    engine = FakeEngine(max_num_seqs=2)
    stop = _Stop()
    it = iter(wins)

    def on_step() -> None:
        if not stop.requested:
            stop.requested, stop.deadline = True, time.monotonic() + 600
        elif engine.steps == 3:
            stop.deadline = time.monotonic()  # the grace period ends

    feeder = EngineFeeder(engine, lambda: next(it, None), 4, stop, on_step=on_step)
    assert list(feeder.run()) == []
    assert [w.spec.index for w in feeder.abandoned] == [0] and not engine.has_unfinished()
