"""JSON from untrusted per-row values and request lines, parsed within limits: a value too large or nested too
deeply is a clear error for that row or line (never a RecursionError that kills the job), and text that is not
valid UTF-8 (or holds a lone surrogate) is refused rather than silently replaced."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of arrays/objects accepted (chat messages with content parts need 4)."""
MAX_BYTES = 16 << 20
"""Largest JSON text accepted for one value or request line."""


class JsonLimitError(ValueError):
    """A JSON text beyond :data:`MAX_DEPTH` / :data:`MAX_BYTES`, or not valid UTF-8."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in `text`, outside strings (a scan, no recursion)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif ch in "]}":
            depth -= 1
    return deepest


def check_utf8(text: str) -> None:
    """JsonLimitError when `text` holds a lone surrogate (from ``\\ud800`` escapes or undecodable bytes read
    with ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        what = (
            f"invalid UTF-8 byte 0x{ord(ch) - 0xDC00:02x}"
            if 0xDC80 <= ord(ch) <= 0xDCFF
            else "a lone surrogate"
        )
        raise JsonLimitError(f"{what} at character {e.start + 1}") from None


def loads_bounded(text: str | bytes) -> Any:
    """``json.loads(text)`` within the limits; JsonLimitError (a ValueError) beyond them, ValueError for
    invalid JSON; strings in the result are valid Unicode (no lone surrogates)."""
    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise JsonLimitError(f"larger than {MAX_BYTES} bytes")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonLimitError(f"invalid UTF-8 byte 0x{text[e.start]:02x} at byte {e.start + 1}") from None
    if len(text) > MAX_BYTES:
        raise JsonLimitError(f"larger than {MAX_BYTES} bytes")
    check_utf8(text)
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise JsonLimitError(f"nested {depth} levels deep (at most {MAX_DEPTH})")
    try:
        value = json.loads(text)
    except RecursionError:  # pragma: no cover - the scan above bounds the depth
        raise JsonLimitError(f"nested too deeply (at most {MAX_DEPTH})") from None
    check_utf8(json.dumps(value, ensure_ascii=False))  # \ud800 escapes decode to lone surrogates
    return value
