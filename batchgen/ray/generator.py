"""The engine as a Ray Data stage: ``ds.map_batches(batchgen.ray.Generator, fn_constructor_kwargs=..., concurrency=N)``.

:class:`Generator` is a callable class: Ray builds one per actor (one engine each) and calls it on batches.
Each batch comes back with its input columns and the job's output columns: ``generated_text``, ``token_ids``,
``num_prompt_tokens``, ``num_generated_tokens``, ``num_cached_tokens``, ``finish_reason``, ``status``
(``ok``/``error``) and ``error`` (plus ``sample_index`` when ``n > 1``: one output row per sample, the input
columns repeated). Rows are validated and turned into prompts exactly as the job does (prompt or chat
``messages`` column, per-row ``sampling`` overrides, too-long prompts): a bad row becomes an error row, never
an exception that fails the batch.

How it differs from the job (``batchgen ...``): Ray Data owns the input, the output and the retries, so the
guarantees are Ray's — a batch whose actor dies is retried on another actor and its rows may be written
twice (at-least-once; no manifest, no resume of a stopped pipeline, no exactly-once). Sampling is seeded per
row from ``id_column`` when one is given (the same texts as the job with the same ``data.id_column``);
without it, from the row's position in its batch, which depends on how Ray batches the dataset.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pyarrow as pa

from batchgen.data.layout import POSITION_COLUMN, RESERVED_COLUMNS, RETRY_COLUMN
from batchgen.data.parts import PartLayout, build_rows
from batchgen.data.prompts import PromptSpec, build_prompts
from batchgen.driver import EngineRequest, run_requests
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.outputs import RequestOutput
from batchgen.job.config import JOB_SEED
from batchgen.job.feeder import prefix_order
from batchgen.sampling_params import SamplingParams


class Generator:
    """Generate for every row of a Ray Data batch (module docstring).

    ``model``: a Hugging Face checkpoint directory (None = the embedded tiny model); ``sampling``: fields of
    :class:`~batchgen.sampling_params.SamplingParams` (``seed`` defaults to the job's, 0); ``engine``: fields
    of :class:`~batchgen.engine.config.EngineConfig`; the column names are the job's ``data.*`` keys.
    """

    def __init__(
        self,
        model: str | None = None,
        sampling: dict[str, Any] | None = None,
        engine: dict[str, Any] | None = None,
        prompt_column: str = "prompt",
        messages_column: str | None = None,
        id_column: str | None = None,
        sampling_column: str | None = "sampling",
        dtype: str = "auto",
        model_impl: str = "auto",
    ) -> None:
        from batchgen.engine.core.llm_engine import LLMEngine

        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine or {}) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        if (engine or {}).get("data_parallel_size", 1) != 1:
            raise ValueError("engine.data_parallel_size: use map_batches(concurrency=N) for N engines")
        params = SamplingParams(**{"seed": JOB_SEED, **(sampling or {})})
        if model is None:
            from batchgen.models.tiny import tiny_default_checkpoint

            model = tiny_default_checkpoint()
        self.engine = LLMEngine(model, EngineConfig(**(engine or {})), dtype=dtype, implementation=model_impl)
        self.spec = PromptSpec(
            prompt_column=prompt_column,
            messages_column=messages_column,
            id_column=id_column,
            sampling_column=sampling_column,
            base_sampling=params,
        )
        self.spec.max_model_len = self.engine.max_model_len
        self.layout = PartLayout(id_type=pa.int64(), kept=[], n=params.n, logprobs=False, metadata={})

    def __call__(self, batch: Any) -> Any:
        """``batch``: a dict of NumPy arrays (Ray Data's default), a pandas DataFrame or a pyarrow Table;
        returns the same kind."""
        table, kind = _to_arrow(batch)
        clash = sorted(set(table.column_names) & (set(RESERVED_COLUMNS) - {"id"}))
        if clash:
            raise ValueError(f"input columns {clash} have the names of output columns: rename them")
        sampling_column = self.spec.sampling_column
        if sampling_column and sampling_column not in table.column_names:
            self.spec.sampling_column = None  # like the job: an absent column of the default name is ignored
        try:
            rows = build_prompts(table, 0, self.spec, self.engine.tokenizer)
        finally:
            self.spec.sampling_column = sampling_column
        results = self._generate(rows)
        id_col = self.spec.id_column
        layout = self.layout
        if id_col and id_col in table.column_names:
            layout = replace(layout, id_type=table.schema.field(id_col).type)
        piece = build_rows(layout, rows, results, None)
        out = table.take(piece.column(POSITION_COLUMN))
        for name in piece.column_names:
            if name in (POSITION_COLUMN, RETRY_COLUMN, "id"):
                continue
            out = out.append_column(name, piece.column(name))
        return _from_arrow(out, kind)

    def _generate(self, rows: list[Any]) -> list[RequestOutput | None]:
        """The engine's result of every valid row (prefix-trie order in, input order out)."""
        results: list[RequestOutput | None] = [None] * len(rows)
        valid = [r.position for r in rows if r.ok]
        feed = [valid[i] for i in prefix_order([rows[p].token_ids for p in valid])]
        requests = [EngineRequest(pos, rows[pos].token_ids, rows[pos].params, rows[pos].lora) for pos in feed]

        def collect(finished: list[RequestOutput]) -> None:
            for out in finished:
                results[int(out.request_id)] = out

        run_requests(self.engine, requests, collect)
        return results


def _to_arrow(batch: Any) -> tuple[pa.Table, str]:
    if isinstance(batch, pa.Table):
        return batch, "arrow"
    if isinstance(batch, dict):
        return pa.table({k: pa.array(list(v) if v.dtype == object else v) for k, v in batch.items()}), "numpy"
    return pa.Table.from_pandas(batch, preserve_index=False), "pandas"


def _from_arrow(table: pa.Table, kind: str) -> Any:
    if kind == "arrow":
        return table
    if kind == "pandas":
        return table.to_pandas()
    import numpy as np

    out = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
            if col.null_count == 0:
                out[name] = col.to_numpy()
                continue
        values = col.to_pylist()
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        out[name] = arr
    return out
