"""Prefix grouping and the engine feed loop: how a job's windows of prompt rows reach the engine.

Grouping: a window's prompts are ordered by their token-id lists, compared lexicographically. That order is
the depth-first order of the prefix trie of the prompts, so prompts that share a prefix are admitted next to
each other and the engine's prefix cache serves the shared blocks (computed once, reused while still cached).

Feeding: :class:`EngineFeeder` keeps the engine saturated across window boundaries. It adds requests in
feed order until ``max_in_flight`` requests are unfinished, taking the next window as soon as the current
one is fully admitted (so the tail of one window overlaps the head of the next), and hands back each window
once all of its requests have finished — results restored to input order.

Reading ahead: :class:`ReadAhead` reads and tokenises the next window in a background thread while the
engine runs the current ones (Parquet reads and fast tokenizers release the GIL, as the forward's kernels do).

Invariants:
- Every valid row of a window that is not already done (``WindowWork.done_positions``: rows finished by an
  earlier run, read back from checkpoints or the part) is added to the engine exactly once; a window is
  reported done exactly once, when every one of those rows has a result (error rows need no engine work).
- Request ids are global row indices, so they are unique within a job.
- After a stop request no new window is started; the rows of windows already started are still admitted and
  finished until the grace deadline (the feeder returns as soon as they are all done), then abandoned (their
  requests aborted) — an abandoned window is never reported done, and its finished rows stay in its results
  (:meth:`EngineFeeder.unfinished_windows`) for the caller to checkpoint.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from batchgen.data.prompts import PromptRow
from batchgen.data.reader import WindowSpec
from batchgen.driver import Driver, EngineRequest
from batchgen.engine.core.interface import Engine
from batchgen.engine.core.outputs import RequestOutput

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """Iterate ``source`` one item ahead in a daemon thread: item k+1 is produced while the caller works on
    item k, never more than one item ahead (a window's rows are held once, plus the next one).

    Items come out in ``source``'s order; an exception raised by ``source`` is raised by the ``next()`` that
    would have returned its item, and ends the iteration. ``source`` is only ever advanced by the thread. The
    thread ends with the iteration, on :meth:`close`, or when this object is garbage-collected (it holds no
    reference to it), after the item it is producing (it is not interrupted)."""

    def __init__(self, source: Iterator[T]) -> None:
        self._want: queue.Queue[bool] = queue.Queue()
        self._got: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._done = False
        args = (source, self._want, self._got)
        threading.Thread(target=_read_ahead, args=args, name="batchgen-read-ahead", daemon=True).start()
        self._want.put(True)

    def __iter__(self) -> ReadAhead[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        ok, item = self._got.get()
        if not ok:
            self._done = True
            if item is not None:
                raise item
            raise StopIteration
        self._want.put(True)  # start producing the next one while the caller works on this one
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._want.put(False)

    def __del__(self) -> None:
        self.close()


def _read_ahead(source: Iterator[Any], want: queue.Queue[bool], got: queue.Queue[tuple[bool, Any]]) -> None:
    """:class:`ReadAhead`'s thread: one item of ``source`` per ``True`` in ``want``; ``(False, None)`` at the
    end, ``(False, exception)`` when ``source`` raised."""
    end = object()
    while want.get():
        try:
            item = next(source, end)
        except BaseException as e:  # handed to the consumer's next()
            got.put((False, e))
            return
        if item is end:
            got.put((False, None))
            return
        got.put((True, item))


def prefix_order(token_ids: Sequence[Sequence[int]]) -> list[int]:
    """Positions sorted by token ids (lexicographic = prefix-trie DFS order); ties keep input order."""
    return sorted(range(len(token_ids)), key=token_ids.__getitem__)


def _adapter_id(row: PromptRow) -> int:
    return 0 if row.lora is None else row.lora.lora_int_id


@dataclass
class WindowWork:
    """A window in flight: its rows (input order), feed order and results so far."""

    spec: WindowSpec
    rows: list[PromptRow]
    extra: Any = None
    """Anything the caller wants back with the finished window (e.g. the kept input columns)."""
    results: list[RequestOutput | None] = field(default_factory=list)
    """``results[position]``: the engine's RequestOutput for a valid row, None for an error row."""
    feed: deque[int] = field(default_factory=deque)
    pending: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    done_positions: frozenset[int] = frozenset()
    """Rows finished before this run (their output rows are in ``pieces``): not fed again."""
    pieces: list[Any] = field(default_factory=list)
    """Output rows of ``done_positions`` (tables with the piece columns of :mod:`batchgen.data.parts`)."""
    checkpointed: set[int] = field(default_factory=set)
    """Rows of this run already written to a checkpoint file."""
    input_sha256: str | None = None

    @classmethod
    def create(
        cls,
        spec: WindowSpec,
        rows: list[PromptRow],
        group_by_prefix: bool,
        extra: Any = None,
        skip: frozenset[int] = frozenset(),
    ) -> WindowWork:
        """The window's valid rows not in `skip` queued for the engine: grouped by LoRA adapter (base model
        first), each group in prefix-trie order; or input order."""
        valid = [r.position for r in rows if r.ok and r.position not in skip]
        if group_by_prefix:
            keys = [(rows[p].image_hashes, rows[p].token_ids) for p in valid]  # rows of one image together
            valid = [valid[i] for i in prefix_order(keys)]  # type: ignore[arg-type]
            if any(rows[p].lora is not None for p in valid):  # stable: prefix order within each adapter
                valid.sort(key=lambda p: _adapter_id(rows[p]))
        return cls(spec, rows, extra, [None] * len(rows), deque(valid), len(valid), done_positions=skip)

    @property
    def done(self) -> bool:
        return self.pending == 0 and not self.feed

    def finished_positions(self) -> list[int]:
        """Positions finished in this run (an error row, or the engine's result is in), ascending."""
        return [
            r.position
            for r in self.rows
            if r.position not in self.done_positions
            and (r.error is not None or self.results[r.position] is not None)
        ]

    @property
    def todo_positions(self) -> list[int]:
        """Positions this run has to finish (every row not done before), ascending."""
        return [r.position for r in self.rows if r.position not in self.done_positions]


class StopFlag(Protocol):
    """What the feeder reads of a stop request (:class:`batchgen.job.signals.StopSignal`)."""

    @property
    def requested(self) -> bool: ...
    @property
    def deadline(self) -> float | None: ...


def pull_window(next_window: Callable[[], WindowWork | None], ready: deque[WindowWork]) -> WindowWork | None:
    """The next window with rows to run, stamped started (None: no windows left); a window without any is
    stamped finished as it comes and appended to `ready`."""
    while (work := next_window()) is not None:
        work.started_at = time.monotonic()
        if not work.done:
            return work
        work.finished_at = work.started_at
        ready.append(work)
    return None


class EngineFeeder:
    """Drive `engine` over the windows produced by `next_window` (None = no more windows).

    ``run()`` yields finished :class:`WindowWork` objects in completion order and returns when every window
    is done, or when a stop was requested and the in-flight windows are finished or past the deadline
    (``self.abandoned`` then lists the windows given up). ``on_output(work, position, output)`` is called for
    each finished request, ``on_step()`` after each engine step. It is the job's :class:`~batchgen.driver.Task`:
    a :class:`~batchgen.driver.Driver` admits its rows and steps the engine.
    """

    def __init__(
        self,
        engine: Engine,
        next_window: Callable[[], WindowWork | None],
        max_in_flight: int,
        stop: StopFlag | None = None,
        on_output: Callable[[WindowWork, int, RequestOutput], None] | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.next_window = next_window
        self.max_in_flight = max(1, int(max_in_flight))
        self.stop = stop
        self.on_output = on_output
        self.on_step = on_step
        self.active: dict[int, WindowWork] = {}  # window index -> work, admitted or admitting
        self.feeding: deque[WindowWork] = deque()
        self.where: dict[int, tuple[WindowWork, int]] = {}  # request id -> (window, position)
        self.abandoned: list[WindowWork] = []
        self.exhausted = False
        self._ready: deque[WindowWork] = deque()

    def unfinished_windows(self) -> list[WindowWork]:
        """Windows pulled but not handed back by :meth:`run`: abandoned after a stop, still active, or
        finished but not yet yielded (when :meth:`run` was left by an exception). Their finished rows are what
        a checkpoint saves."""
        seen: dict[int, WindowWork] = {}
        for w in [*self.abandoned, *self.active.values(), *self._ready]:
            seen.setdefault(w.spec.index, w)
        return sorted(seen.values(), key=lambda w: w.spec.index)

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _past_deadline(self) -> bool:
        if not self._stopping():
            return False
        deadline = self.stop.deadline  # type: ignore[union-attr]
        return deadline is None or time.monotonic() >= deadline

    def _pull(self) -> WindowWork | None:
        """The next window with rows to feed; windows without valid rows finish at once."""
        if self.exhausted or self._stopping():
            return None
        work = pull_window(self.next_window, self._ready)
        if work is None:
            self.exhausted = True
            return None
        self.active[work.spec.index] = work
        return work

    def next_request(self) -> EngineRequest | None:
        """The next row to admit (the driver asks while the engine has room): rows of the window being fed,
        then of the next one; after a stop, only rows of windows already started (``_pull`` starts no new
        window then), and none once the grace deadline has passed."""
        while not self._past_deadline():
            if self.feeding and not self.feeding[0].feed:
                self.feeding.popleft()
            if not self.feeding:
                work = self._pull()
                if work is None:
                    return None
                self.feeding.append(work)
                continue
            work = self.feeding[0]
            pos = work.feed.popleft()
            row = work.rows[pos]
            self.where[row.row_index] = (work, pos)
            return EngineRequest(
                row.row_index, row.token_ids, row.params, row.lora, images=tuple(row.images or ())
            )
        return None

    def finish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            work, pos = self.where.pop(out.request_id)
            work.results[pos] = out
            work.pending -= 1
            if self.on_output is not None:
                self.on_output(work, pos, out)
            if work.done:
                work.finished_at = time.monotonic()
                self.active.pop(work.spec.index, None)
                self._ready.append(work)

    def run(self) -> Iterator[WindowWork]:
        driver = Driver(self.engine, self, self.max_in_flight)
        for _ in driver.steps():
            if self.on_step is not None:
                self.on_step()
            while self._ready:
                yield self._ready.popleft()
            if self._stopping() and (self._past_deadline() or not self.active):
                break  # past the grace period, or every started window is finished
        while self._ready:  # windows without rows to run, pulled after the last step
            yield self._ready.popleft()
        if self.active and not self._stopping():
            raise RuntimeError("the engine has no unfinished requests but windows are still pending")
        self.abandoned = sorted(self.active.values(), key=lambda w: w.spec.index)
        driver.abort()
        self.where.clear()
        self.active.clear()
        self.feeding.clear()
