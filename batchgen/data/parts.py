"""Part tables: the output rows of one window, built from its prompt rows and the engine's results.

A window's rows may be finished in several runs (checkpoints of a stopped run, retried error rows), so a
part is assembled from *pieces*: :func:`build_rows` turns finished rows into output rows carrying two extra
columns (:data:`~batchgen.data.layout.POSITION_COLUMN`, the row's position in its window, and
:data:`~batchgen.data.layout.RETRY_COLUMN`), and :func:`assemble_part` puts the pieces of a whole window
together in input order and drops the extra columns.

Invariants:
- Rows of a part are in input order; a valid row contributes one output row per sample (``sample_index``
  column when ``n > 1``), an error row contributes ``n`` rows with ``status="error"``: every input row id
  appears exactly ``n`` times in the output (:func:`assemble_part` checks that each position of the window
  appears exactly once).
- A part's content and schema metadata depend only on the configuration, the input and the window — not on
  timing, resume, checkpoints or batch composition (``num_cached_tokens`` excepted: it reports what the
  prefix cache served in the run that produced the row).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from batchgen.data.layout import METADATA_KEY, POSITION_COLUMN, RESERVED_COLUMNS, RETRY_COLUMN
from batchgen.data.prompts import PromptRow
from batchgen.data.structured import parse_column
from batchgen.engine.core.outputs import CompletionOutput, RequestOutput


@dataclass
class PartLayout:
    """The fixed schema of a job's part files and the metadata every part carries."""

    id_type: pa.DataType
    kept: list[pa.Field]
    n: int
    logprobs: bool
    metadata: dict[str, Any]
    id_source: str | None = None
    """Input column the ``id`` values are copied from (as Arrow values, byte for byte), or None: ids are
    the prompt rows' ``id`` (the global row index)."""
    structured: bool = False
    """Structured outputs may be asked for (sampling.json_schema/regex/choice/grammar, or per row): a bool
    ``constraint_satisfied`` column (null for unconstrained rows and errors; False when max_tokens cut it)."""
    json_type: pa.DataType | None = None
    """data.parse_json: the Arrow type of sampling.json_schema; the ``generated_json`` column holds the parsed
    output (null unless the row's output satisfied its constraint)."""

    def schema(self) -> pa.Schema:
        fields = [pa.field("id", self.id_type)]
        if self.n > 1:
            fields.append(pa.field("sample_index", pa.int32()))
        fields += self.kept
        fields += [
            pa.field("generated_text", pa.string()),
            pa.field("token_ids", pa.list_(pa.int32())),
            pa.field("num_prompt_tokens", pa.int32()),
            pa.field("num_generated_tokens", pa.int32()),
            pa.field("num_cached_tokens", pa.int32()),
            pa.field("finish_reason", pa.string()),
            pa.field("status", pa.string()),
            pa.field("error", pa.string()),
        ]
        if self.logprobs:
            fields.append(pa.field("logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))))
        if self.structured or self.json_type is not None:
            fields.append(pa.field("constraint_satisfied", pa.bool_()))
        if self.json_type is not None:
            fields.append(pa.field("generated_json", self.json_type))
        return pa.schema(fields)

    def piece_schema(self) -> pa.Schema:
        """The schema of :func:`build_rows` pieces (and checkpoint files): the part's plus the extra columns."""
        return (
            self.schema()
            .append(pa.field(POSITION_COLUMN, pa.int32()))
            .append(pa.field(RETRY_COLUMN, pa.bool_()))
        )


@dataclass
class PartStats:
    """What a part holds; ok/error counts refer to input rows, token counts to valid rows."""

    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_output_rows: int = 0
    retry_rows: list[int] = field(default_factory=list)
    """Positions of error rows whose error may be retried (``data.retry_errors``)."""


@dataclass
class _Columns:
    """Output columns under construction (one value per output row) and the window position of each row."""

    values: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in RESERVED_COLUMNS})
    positions: list[int] = field(default_factory=list)
    retryable: list[bool] = field(default_factory=list)

    def add(
        self,
        row: PromptRow,
        sample_index: int,
        num_prompt_tokens: int | None,
        num_cached_tokens: int,
        sample: CompletionOutput | None = None,
        error: str | None = None,
        retryable: bool = False,
    ) -> None:
        """One output row: the sample's generation, or (``sample`` None) an error row."""
        v = self.values
        ok = sample is not None
        v["id"].append(row.id)
        v["sample_index"].append(sample_index)
        v["generated_text"].append(sample.text if ok else None)
        v["token_ids"].append([int(t) for t in sample.token_ids] if ok else None)
        v["num_prompt_tokens"].append(num_prompt_tokens)
        v["num_generated_tokens"].append(len(sample.token_ids) if ok else 0)
        v["num_cached_tokens"].append(num_cached_tokens)
        v["finish_reason"].append(sample.finish_reason if ok else "error")
        v["status"].append("ok" if ok else "error")
        v["error"].append(error)
        lps = sample.logprobs if ok else None
        v["logprobs"].append([list(d.items()) for d in lps] if lps is not None else None)
        satisfied = sample.constraint_satisfied if ok else None
        v["constraint_satisfied"].append(satisfied)
        v["generated_json"].append(sample.text if satisfied else None)
        self.positions.append(row.position)
        self.retryable.append(retryable)


def _row_error(row: PromptRow, out: RequestOutput | None) -> tuple[str, bool] | None:
    """Why a row has no generation (its validation error, the engine's error, no result) and whether that
    may be retried, or None."""
    if row.error is not None:
        return row.error, row.retryable
    if out is None:
        return "no result", True
    return (out.error, True) if out.error else None


def _add_error_row(cols: _Columns, row: PromptRow, out: RequestOutput | None, n: int) -> None:
    error, retryable = _row_error(row, out)  # type: ignore[misc]
    num_prompt = row.num_prompt_tokens
    if out is not None and out.prompt_token_ids is not None:
        num_prompt = len(out.prompt_token_ids)
    for k in range(n):
        cols.add(row, k, num_prompt, 0, error=error, retryable=retryable)


def _add_ok_row(cols: _Columns, row: PromptRow, out: RequestOutput, n: int) -> None:
    num_prompt, num_cached = len(out.prompt_token_ids), out.num_cached_tokens
    samples = sorted(out.outputs, key=lambda c: c.index)
    if len(samples) != n:
        raise RuntimeError(f"row {row.row_index}: engine returned {len(samples)} samples, expected {n}")
    for k, c in enumerate(samples):
        if c.finish_reason == "error":
            cols.add(row, k, num_prompt, num_cached, error="generation failed", retryable=True)
        else:
            cols.add(row, k, num_prompt, num_cached, sample=c)


def build_rows(
    layout: PartLayout,
    rows: list[PromptRow],
    results: list[RequestOutput | None],
    kept: pa.Table | None,
    only: Iterable[int] | None = None,
) -> pa.Table:
    """Output rows (:meth:`PartLayout.piece_schema`) of the window positions in `only` (default: all), in
    that order. `results[position]` is the engine's RequestOutput for a valid row (None for rows that failed
    validation); `kept` holds the kept input columns (and the id column, see ``PartLayout.id_source``) of all
    the window's rows, in input order."""
    cols = _Columns()
    for pos in range(len(rows)) if only is None else only:
        row, out = rows[pos], results[pos]
        if _row_error(row, out) is not None:
            _add_error_row(cols, row, out, layout.n)
        else:
            _add_ok_row(cols, row, out, layout.n)  # type: ignore[arg-type]
    schema = layout.piece_schema()
    take = pa.array(cols.positions, type=pa.int64())
    from_input = kept.take(take) if kept is not None else None
    arrays: list[pa.Array | pa.ChunkedArray] = []
    for f in schema:
        if f.name == POSITION_COLUMN:
            arrays.append(pa.array(cols.positions, type=pa.int32()))
        elif f.name == RETRY_COLUMN:
            arrays.append(pa.array(cols.retryable, type=pa.bool_()))
        elif f.name == "id" and layout.id_source is not None and from_input is not None:
            col = from_input.column(layout.id_source)
            arrays.append(col.cast(f.type) if col.type != f.type else col)
        elif from_input is not None and f in layout.kept and f.name in from_input.column_names:
            col = from_input.column(f.name)
            arrays.append(col.cast(f.type) if col.type != f.type else col)
        elif f.name == "generated_json":
            arrays.append(parse_column(cols.values[f.name], f.type))
        else:
            arrays.append(pa.array(cols.values[f.name], type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def part_stats(table: pa.Table, n: int) -> PartStats:
    """Counts of a part (or a piece) with the extra columns: rows per input row, tokens of ok rows."""
    if table.num_rows == 0:
        return PartStats()
    d = table.select(
        [
            POSITION_COLUMN,
            RETRY_COLUMN,
            "status",
            "num_prompt_tokens",
            "num_cached_tokens",
            "num_generated_tokens",
        ]
    ).to_pydict()
    st = PartStats(num_output_rows=table.num_rows)
    by_pos: dict[int, list[int]] = {}
    for i, p in enumerate(d[POSITION_COLUMN]):
        by_pos.setdefault(p, []).append(i)
    for p, idx in sorted(by_pos.items()):
        if all(d["status"][i] == "ok" for i in idx):
            st.rows_ok += 1
            st.prompt_tokens += d["num_prompt_tokens"][idx[0]] or 0
            st.cached_tokens += d["num_cached_tokens"][idx[0]] or 0
        else:
            st.rows_error += 1
            if any(d[RETRY_COLUMN][i] for i in idx if d["status"][i] == "error"):
                st.retry_rows.append(p)
        st.generated_tokens += sum(d["num_generated_tokens"][i] or 0 for i in idx)
    return st


def assemble_part(
    layout: PartLayout, pieces: list[pa.Table], num_rows: int, window_meta: dict[str, Any]
) -> tuple[pa.Table, PartStats]:
    """The part of a window of `num_rows` input rows from pieces covering each position exactly once: rows
    in input order, the extra columns dropped, the layout's metadata plus `window_meta` (and the retryable
    rows, under ``window.retry_rows``, when there are any)."""
    schema = layout.piece_schema()
    pieces = [p.select(schema.names).cast(schema) if not p.schema.equals(schema) else p for p in pieces]
    table = pa.concat_tables(pieces) if pieces else schema.empty_table()
    pos = table.column(POSITION_COLUMN).to_numpy(zero_copy_only=False).astype(np.int64)
    counts = np.bincount(pos, minlength=num_rows) if len(pos) else np.zeros(num_rows, dtype=np.int64)
    if len(counts) != num_rows or not np.all(counts == layout.n):
        bad = np.flatnonzero(counts[:num_rows] != layout.n)[:5].tolist() if len(counts) >= num_rows else []
        raise RuntimeError(
            f"internal error: the pieces of window {window_meta.get('index')} do not cover each of its "
            f"{num_rows} rows exactly once (positions {bad}...)"
        )
    table = table.take(pa.array(np.argsort(pos, kind="stable")))
    st = part_stats(table, layout.n)
    meta = {**layout.metadata, "window": dict(window_meta)}
    if st.retry_rows:
        meta["window"]["retry_rows"] = st.retry_rows
    out = table.drop_columns([POSITION_COLUMN, RETRY_COLUMN])
    out = out.replace_schema_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})
    return out, st


def part_as_piece(part: pa.Table, n: int) -> pa.Table:
    """A committed part read back as a piece: the extra columns re-derived (row i of the part is position
    i // n; retryable rows from the part's metadata)."""
    meta = json.loads((part.schema.metadata or {}).get(METADATA_KEY, b"{}"))
    retry = set((meta.get("window") or {}).get("retry_rows") or [])
    positions = np.arange(part.num_rows, dtype=np.int64) // n
    t = part.replace_schema_metadata(None)
    t = t.append_column(POSITION_COLUMN, pa.array(positions.astype(np.int32), type=pa.int32()))
    status = t.column("status").to_pylist()
    retryable = [bool(s == "error" and int(p) in retry) for s, p in zip(status, positions)]
    return t.append_column(RETRY_COLUMN, pa.array(retryable, type=pa.bool_()))


def build_part(
    layout: PartLayout,
    rows: list[PromptRow],
    results: list[RequestOutput | None],
    kept: pa.Table | None,
    window_meta: dict[str, Any],
) -> tuple[pa.Table, PartStats]:
    """The output table of one window whose every row is in `rows`/`results` (see :func:`build_rows`)."""
    return assemble_part(layout, [build_rows(layout, rows, results, kept)], len(rows), window_meta)
