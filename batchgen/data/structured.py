"""Structured-output columns of a job: ``constraint_satisfied`` and, with ``data.parse_json``, the parsed JSON.

:func:`arrow_type` maps a JSON Schema to an Arrow type so that ``pq.read_table(out)`` gives real columns:
``object`` with ``properties`` → struct (one field per property, in schema order, each nullable: optional
properties are null when absent), ``array`` → list of its ``items`` type, ``string`` (and string ``enum`` /
``const``) → string, ``integer`` → int64, ``number`` → float64, ``boolean`` → bool, ``null`` → null. Anything
else (``anyOf``/``oneOf``, mixed-type enums, ``type`` lists, objects without ``properties``, ``$ref``) becomes a
string holding that value's JSON text, so no value is lost.

:func:`parse_column` turns the generated texts into that type: a row whose output did not satisfy its
constraint (or does not parse, or does not fit the type) gets null.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


def arrow_type(schema: Any) -> pa.DataType:
    """The Arrow type of values valid against ``schema`` (see the module doc)."""
    if not isinstance(schema, Mapping):
        return pa.string()
    t = schema.get("type")
    if t is None and "enum" in schema:
        values = schema["enum"]
        kinds = {type(v) for v in values}
        if kinds == {str}:
            return pa.string()
        if kinds == {int}:
            return pa.int64()
        if kinds <= {int, float}:
            return pa.float64()
        if kinds == {bool}:
            return pa.bool_()
        return pa.string()
    if t is None and "const" in schema:
        return arrow_type({"enum": [schema["const"]]})
    if t == "object" and isinstance(schema.get("properties"), Mapping) and schema["properties"]:
        return pa.struct([pa.field(k, arrow_type(v)) for k, v in schema["properties"].items()])
    if t == "array" and isinstance(schema.get("items"), Mapping):
        return pa.list_(arrow_type(schema["items"]))
    if t == "null":
        return pa.null()
    if isinstance(t, str) and t in _SCALARS:
        return _SCALARS[t]
    return pa.string()


def _fit(value: Any, t: pa.DataType) -> Any:
    """``value`` (parsed JSON) shaped for ``t``: JSON text where ``t`` is string but the value is not."""
    if value is None:
        return None
    if pa.types.is_struct(t):
        if not isinstance(value, dict):
            raise TypeError("not an object")
        return {f.name: _fit(value.get(f.name), f.type) for f in t}
    if pa.types.is_list(t):
        if not isinstance(value, list):
            raise TypeError("not an array")
        return [_fit(v, t.value_type) for v in value]
    if pa.types.is_string(t) and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return value


def parse_column(texts: list[str | None], t: pa.DataType) -> pa.Array:
    """One value of type ``t`` per text: the parsed JSON, or null when the text is null or does not fit."""
    values = []
    for text in texts:
        v = None
        if text is not None:
            try:
                v = _fit(json.loads(text), t)
                pa.array([v], type=t)  # checks ranges (int64 overflow, float for int...)
            except (ValueError, TypeError, OverflowError, pa.ArrowException):
                v = None
        values.append(v)
    return pa.array(values, type=t)
