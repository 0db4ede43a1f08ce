"""The input columns a job reads, checked against its input before anything runs.

:func:`select_columns` takes the columns by role (:class:`ColumnSpec`, plain names) and the opened
:class:`~batchgen.data.reader.InputSet`. Invariants of what it returns: every file holds each column read (a
:class:`~batchgen.errors.ConfigError` naming the option and the files otherwise), a per-row sampling column is a
struct (or JSON string) of ``SamplingParams`` overrides, the prompt (or messages) column can hold a prompt, and
the schema is the columns' types unified over the files (:meth:`InputSet.read_schema`). A job in which no row
could ever succeed is refused here, before the model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from batchgen.data.prompts import struct_override_problems
from batchgen.data.reader import InputSet
from batchgen.errors import ConfigError

DEFAULT_SAMPLING_COLUMN = "sampling"
"""The per-row sampling column's default name: absent from the input, it is ignored."""


@dataclass(frozen=True)
class ColumnSpec:
    """The columns a job reads, by role (``data.*`` names; None or empty: not read)."""

    prompt_column: str
    messages_column: str | None = None
    id_column: str | None = None
    keep_columns: tuple[str, ...] = ()
    sampling_column: str | None = DEFAULT_SAMPLING_COLUMN
    continuation_column: str | None = None
    lora_column: str | None = None
    image_column: str | None = None


@dataclass(frozen=True)
class SelectedColumns:
    """The input columns read (the prompt or messages column first, then id, kept, sampling, continuation,
    adapter and image columns), the per-row sampling column in effect, and their unified schema."""

    names: list[str]
    sampling_column: str | None
    schema: pa.Schema


def select_columns(inp: InputSet, spec: ColumnSpec) -> SelectedColumns:
    """The columns ``spec`` reads from ``inp``, checked (see the module docstring)."""
    source = spec.messages_column or spec.prompt_column
    source_key = "data.messages_column" if spec.messages_column else "data.prompt_column"
    sampling = spec.sampling_column
    if sampling == DEFAULT_SAMPLING_COLUMN and not any(
        f.schema.get_field_index(sampling) >= 0 for f in inp.files
    ):
        sampling = None  # the default name, absent from every file: no per-row overrides
    required = [
        (source, source_key),
        (spec.id_column, "data.id_column"),
        *((c, "data.keep_columns") for c in spec.keep_columns),
        (spec.continuation_column, "data.continuation_column"),
        (spec.lora_column, "data.lora_column"),
        (spec.image_column, "data.image_column"),
        (sampling, "data.sampling_column"),
    ]
    for name, key in required:
        if name:
            _require_column(inp, name, key)
    order = [source, spec.id_column, *spec.keep_columns, sampling]
    order += [spec.continuation_column, spec.lora_column, spec.image_column]
    names = list(dict.fromkeys(name for name in order if name))
    schema = inp.read_schema(names)
    _check_types(schema, source, source_key, sampling)
    return SelectedColumns(names, sampling, schema)


def _require_column(inp: InputSet, name: str, key: str) -> None:
    """ConfigError naming `key` unless every input file has column `name`."""
    missing = [f.rel_path for f in inp.files if f.schema.get_field_index(name) < 0]
    if missing:
        first = next(f for f in inp.files if f.rel_path == missing[0])
        avail = ", ".join(first.schema.names[:30])
        if len(missing) == len(inp.files):
            where, cols = "the input", f"columns: {avail}"
        else:
            where, cols = f"{len(missing)} file(s), e.g. {missing[0]!r}", f"its columns: {avail}"
        raise ConfigError(f"{key}: column {name!r} is missing from {where} ({cols})")


def _check_types(schema: pa.Schema, source: str, source_key: str, sampling: str | None) -> None:
    """ConfigError for a prompt (messages) column that can never hold a prompt (every row would fail), or a
    sampling column that cannot hold overrides."""
    _check_prompt_type(source, source_key, schema)
    if sampling is not None:
        problem = struct_override_problems(schema.field(sampling).type)
        if problem:
            raise ConfigError(f"data.sampling_column: column {sampling!r} {problem}")


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view"


def _check_prompt_type(name: str, key: str, schema: pa.Schema) -> None:
    """ConfigError when the prompt (or messages) column's type can never hold a valid prompt: every row
    would be an error row."""
    t = schema.field(name).type
    if key == "data.messages_column":
        if not (_is_text(t) or pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_null(t)):
            raise ConfigError(
                f"data.messages_column: column {name!r} has type {t}; expected a list of "
                "{role, content} structs or a JSON string, so every row would fail"
            )
    elif not (_is_text(t) or pa.types.is_null(t)):
        raise ConfigError(
            f"data.prompt_column: column {name!r} has type {t}, not string, so every row "
            "would fail; choose a string column (or data.messages_column for chat messages)"
        )
    if pa.types.is_null(t):
        raise ConfigError(
            f"{key}: column {name!r} holds only nulls in every input file, so every row would fail"
        )
