"""Hostile values in per-row JSON columns and request lines are error rows / error lines, never an exception
that stops the job: nesting beyond the limit, lone surrogates, invalid UTF-8, negative temperatures."""

from __future__ import annotations

import json
import sys

import pytest

from batchgen.data.json_limits import MAX_DEPTH, JsonLimitError, loads_bounded
from batchgen.data.openai_batch import parse_requests
from batchgen.data.prompts import check_messages, parse_overrides

DEEP = "[" * (sys.getrecursionlimit() * 4) + "]" * (sys.getrecursionlimit() * 4)


def _line(cid: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_loads_bounded_refuses_depth_size_and_surrogates() -> None:
    assert loads_bounded('{"a": [1, {"b": "x"}]}') == {"a": [1, {"b": "x"}]}
    assert loads_bounded("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    with pytest.raises(JsonLimitError, match="nested"):
        loads_bounded(DEEP)
    with pytest.raises(JsonLimitError, match="lone surrogate"):
        loads_bounded('{"a": "\\ud800"}')
    with pytest.raises(JsonLimitError, match="invalid UTF-8 byte 0xff"):
        loads_bounded(b'{"a": "\xff"}')
    with pytest.raises(JsonLimitError, match="invalid UTF-8 byte 0xff"):
        loads_bounded(b'{"a": "\xff"}'.decode("utf-8", "surrogateescape"))


def test_deep_json_in_row_columns_is_an_error_row() -> None:
    assert "nested" in check_messages(DEEP)
    assert "nested" in parse_overrides('{"temperature": ' + DEEP + "}")


def test_bad_request_lines_are_error_lines_and_the_others_run() -> None:
    ok = _line("ok", {"messages": [{"role": "user", "content": "hi"}]})
    lines = [
        ok,
        '{"custom_id": "deep", "body": ' + DEEP + "}",
        _line("\ud800x", {"messages": [{"role": "user", "content": "hi"}]}).replace("\\ud800", "\\ud800"),
        '{"custom_id": "bytes", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
        '[{"role": "user", "content": "caf\udce9"}]}}',
        _line("cold", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}),
    ]
    reqs = parse_requests(lines)
    rows = reqs.table.to_pylist()
    errors = {r["custom_id"]: r["request_error"] for r in rows}
    assert errors["ok"] is None
    assert "nested" in errors["deep"]
    assert "lone surrogate" in errors["\\ud800x"]
    assert "invalid UTF-8 byte 0xe9" in errors["bytes"]
    assert "temperature must be >= 0" in errors["cold"]
    for r in rows:  # every custom_id can be written as UTF-8 in the results file
        json.dumps(r, ensure_ascii=False).encode("utf-8")
