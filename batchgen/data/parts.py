"""Part tables: the output rows of one window, built from its prompt rows and the engine's results.

Invariants:
- Rows of a part are in input order; a valid row contributes one output row per sample (``sample_index``
  column when ``n > 1``), an error row contributes ``n`` rows with ``status="error"``: every input row id
  appears exactly ``n`` times in the output.
- A part's content and schema metadata depend only on the configuration, the input and the window — not on
  timing, resume or batch composition (``num_cached_tokens`` excepted: it reports what the prefix cache
  served in the run that produced the window).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from batchgen.data.layout import METADATA_KEY, RESERVED_COLUMNS
from batchgen.data.prompts import PromptRow
from batchgen.data.structured import parse_column
from batchgen.engine.outputs import CompletionOutput, RequestOutput


@dataclass
class PartLayout:
    """The fixed schema of a job's part files and the metadata every part carries."""

    id_type: pa.DataType
    kept: list[pa.Field]
    n: int
    logprobs: bool
    metadata: dict[str, Any]
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


@dataclass
class PartStats:
    """What a part holds; ok/error counts refer to input rows, token counts to valid rows."""

    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_output_rows: int = 0


@dataclass
class _Columns:
    """Output columns under construction (one value per output row) and the window position of each row."""

    values: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in RESERVED_COLUMNS})
    positions: list[int] = field(default_factory=list)

    def add(
        self,
        row: PromptRow,
        sample_index: int,
        num_prompt_tokens: int | None,
        num_cached_tokens: int,
        sample: CompletionOutput | None = None,
        error: str | None = None,
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


def _row_error(row: PromptRow, out: RequestOutput | None) -> str | None:
    """Why a row has no generation (its validation error, the engine's error, no result), or None."""
    if row.error is not None:
        return row.error
    if out is None:
        return "no result"
    return out.error or None


def _add_error_row(cols: _Columns, st: PartStats, row: PromptRow, out: RequestOutput | None, n: int) -> None:
    error = _row_error(row, out)
    num_prompt = row.num_prompt_tokens
    if out is not None and out.prompt_token_ids is not None:
        num_prompt = len(out.prompt_token_ids)
    for k in range(n):
        cols.add(row, k, num_prompt, 0, error=error)
    st.rows_error += 1


def _add_ok_row(cols: _Columns, st: PartStats, row: PromptRow, out: RequestOutput, n: int) -> None:
    num_prompt, num_cached = len(out.prompt_token_ids), out.num_cached_tokens
    st.rows_ok += 1
    st.prompt_tokens += num_prompt
    st.cached_tokens += num_cached
    samples = sorted(out.outputs, key=lambda c: c.index)
    if len(samples) != n:
        raise RuntimeError(f"row {row.row_index}: engine returned {len(samples)} samples, expected {n}")
    for k, c in enumerate(samples):
        st.generated_tokens += len(c.token_ids)
        if c.finish_reason == "error":
            cols.add(row, k, num_prompt, num_cached, error="generation failed")
        else:
            cols.add(row, k, num_prompt, num_cached, sample=c)


def _table(
    layout: PartLayout, cols: _Columns, kept: pa.Table | None, window_meta: dict[str, Any]
) -> pa.Table:
    """The part table: generated columns from `cols`, kept input columns taken from `kept` row by row."""
    schema = layout.schema()
    kept_rows = (
        kept.take(pa.array(cols.positions, type=pa.int64())) if kept is not None and layout.kept else None
    )
    arrays: list[pa.Array | pa.ChunkedArray] = []
    for f in schema:
        if kept_rows is not None and f.name in kept_rows.column_names and f in layout.kept:
            col = kept_rows.column(f.name)
            arrays.append(col.cast(f.type) if col.type != f.type else col)
        elif f.name == "generated_json":
            arrays.append(parse_column(cols.values[f.name], f.type))
        else:
            arrays.append(pa.array(cols.values[f.name], type=f.type))
    meta = {**layout.metadata, "window": window_meta}
    return pa.Table.from_arrays(
        arrays, schema=schema.with_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})
    )


def build_part(
    layout: PartLayout,
    rows: list[PromptRow],
    results: list[RequestOutput | None],
    kept: pa.Table | None,
    window_meta: dict[str, Any],
) -> tuple[pa.Table, PartStats]:
    """The output table of one window: rows in input order, ``layout.n`` output rows per input row.

    `results[position]` is the engine's RequestOutput for a valid row (None for rows that failed
    validation); `kept` holds the kept input columns of the window's rows (input order).
    """
    cols, st = _Columns(), PartStats()
    for row in rows:
        out = results[row.position]
        if _row_error(row, out) is not None:
            _add_error_row(cols, st, row, out, layout.n)
        else:
            _add_ok_row(cols, st, row, out, layout.n)  # type: ignore[arg-type]
    st.num_output_rows = len(cols.positions)
    return _table(layout, cols, kept, window_meta), st
