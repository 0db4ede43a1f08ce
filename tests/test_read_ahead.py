"""The job's read-ahead of windows (batchgen.job.feeder.ReadAhead): order, one item ahead, errors, ending."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from batchgen.job.feeder import ReadAhead


def test_order_and_end() -> None:
    ahead = ReadAhead(iter(range(5)))
    assert list(ahead) == [0, 1, 2, 3, 4]
    assert next(ahead, None) is None


def test_reads_exactly_one_item_ahead() -> None:
    produced: list[int] = []

    def source():
        for i in range(10):
            produced.append(i)
            yield i

    ahead = ReadAhead(source())
    deadline = time.monotonic() + 5
    while not produced and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert produced == [0]  # the first item is read before it is asked for, and nothing more
    assert next(ahead) == 0
    deadline = time.monotonic() + 5
    while len(produced) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert produced == [0, 1]  # item 1 is read while the caller works on item 0
    ahead.close()


def test_error_is_raised_in_order() -> None:
    def source():
        yield 1
        raise ValueError("bad window")

    ahead = ReadAhead(source())
    assert next(ahead) == 1
    with pytest.raises(ValueError, match="bad window"):
        next(ahead)
    assert next(ahead, None) is None


def test_thread_ends_on_close_and_on_collection() -> None:
    def threads() -> int:
        return sum(t.name == "batchgen-read-ahead" for t in threading.enumerate())

    before = threads()
    a = ReadAhead(iter(range(100)))
    b = ReadAhead(iter(range(100)))
    next(a), next(b)
    a.close()
    del b
    gc.collect()
    deadline = time.monotonic() + 5
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads() == before
