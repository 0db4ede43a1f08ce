"""Arrow values as Python values, safely: a value Python cannot decode is one row's error, never the window's.

``Array.to_pylist()`` raises for the whole array when one value cannot be converted (a string that is not
valid UTF-8, a timestamp outside Python's datetime range, ...). :func:`safe_pylist` converts what it can and
reports the rest per row; :func:`window_sha256` hashes a window's input rows without converting anything
that could fail (strings as bytes, times as integers), so a resume can tell whether the rows it skips are
still the rows it processed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pyarrow as pa


def describe_decode_error(e: BaseException) -> str:
    """``not valid UTF-8 at byte N`` for a UnicodeDecodeError, else the exception's own words."""
    if isinstance(e, UnicodeDecodeError):
        return f"not valid UTF-8 at byte {e.start}"
    text = " ".join(str(e).split()) or type(e).__name__
    return f"not convertible to a Python value ({type(e).__name__}: {text[:150]})"


def safe_pylist(column: pa.Array | pa.ChunkedArray) -> tuple[list[Any], list[str | None]]:
    """(values, errors): ``values[i]`` is row i as a Python value (None where it could not be converted) and
    ``errors[i]`` says why it could not (see :func:`describe_decode_error`), or None."""
    try:
        values = column.to_pylist()
        return values, [None] * len(values)
    except Exception:  # noqa: BLE001 - any conversion failure is handled row by row below
        pass
    values, errors = [], []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
            errors.append(None)
        except Exception as e:  # noqa: BLE001
            values.append(None)
            errors.append(describe_decode_error(e))
    return values, errors


def _lossless_type(t: pa.DataType) -> pa.DataType:
    """A type whose Python conversion never fails and keeps every bit: strings as bytes, temporal values as
    integers, dictionaries decoded, nested types mapped element-wise."""
    if pa.types.is_dictionary(t):
        return _lossless_type(t.value_type)
    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t):
        return pa.binary()
    if pa.types.is_timestamp(t) or pa.types.is_date64(t) or pa.types.is_time64(t) or pa.types.is_duration(t):
        return pa.int64()
    if pa.types.is_date32(t) or pa.types.is_time32(t):
        return pa.int32()
    if pa.types.is_list(t):
        return pa.list_(pa.field(t.value_field.name, _lossless_type(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(pa.field(t.value_field.name, _lossless_type(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_lossless_type(t.value_type), t.list_size)
    if pa.types.is_map(t):
        return pa.map_(_lossless_type(t.key_type), _lossless_type(t.item_type))
    if pa.types.is_struct(t):
        return pa.struct(
            [pa.field(t.field(i).name, _lossless_type(t.field(i).type)) for i in range(t.num_fields)]
        )
    return t


def lossless_pylist(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """Row values that never fail to convert (see :func:`_lossless_type`); per row on a failed cast."""
    target = _lossless_type(column.type)
    try:
        return (column.cast(target) if target != column.type else column).to_pylist()
    except Exception:  # noqa: BLE001 - a cast or type we do not handle: fall back to a per-row description
        out = []
        for i in range(len(column)):
            try:
                out.append(column[i].as_py())
            except Exception as e:  # noqa: BLE001
                out.append(("undecodable", repr(column[i])[:500], type(e).__name__))
        return out


def window_sha256(table: pa.Table, unreadable: list[tuple[int, int, str]] | None = None) -> str:
    """Hash of a window's input rows: every column's name, type and values (as :func:`lossless_pylist`),
    and the ranges that could not be read. Independent of chunking and of how the file encodes the values."""
    h = hashlib.sha256()
    h.update(f"rows={table.num_rows}\n".encode())
    for name, col in zip(table.column_names, table.columns):
        h.update(f"{name}\0{col.type}\0".encode())
        h.update(repr(lossless_pylist(col)).encode())
        h.update(b"\n")
    for start, end, _ in unreadable or []:
        h.update(f"unreadable {start} {end}\n".encode())
    return h.hexdigest()


def sanitize_utf8(column: pa.Array | pa.ChunkedArray) -> tuple[pa.Array | pa.ChunkedArray, dict[int, int]]:
    """A string column with every value that is not valid UTF-8 rewritten with U+FFFD for its bad bytes, and
    {row: byte offset of the first bad byte}. Other types, and valid columns, come back unchanged (checked in
    one pass by Arrow): the output must stay readable by every Parquet reader."""
    t = column.type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return column, {}
    try:
        column.validate(full=True)
        return column, {}
    except pa.ArrowInvalid:
        pass
    raw = column.cast(pa.binary() if pa.types.is_string(t) else pa.large_binary()).to_pylist()
    fixed: list[str | None] = []
    bad: dict[int, int] = {}
    for i, v in enumerate(raw):
        if v is None:
            fixed.append(None)
            continue
        try:
            fixed.append(v.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad[i] = e.start
            fixed.append(v.decode("utf-8", errors="replace"))
    return pa.array(fixed, type=t), bad
