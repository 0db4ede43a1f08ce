"""The engine as a Ray Data stage: ``ds.map_batches(batchgen.ray.Generator, fn_constructor_kwargs=..., concurrency=N)``.

:class:`Generator` is a callable class: Ray builds one per actor (one engine each) and calls it on batches.
Each batch comes back with its input columns and the job's output columns: ``generated_text``, ``token_ids``,
``num_prompt_tokens``, ``num_generated_tokens``, ``num_cached_tokens``, ``finish_reason``, ``status``
(``ok``/``error``) and ``error`` (plus ``sample_index`` when ``n > 1``: one output row per sample, the input
columns repeated). Rows are validated and turned into prompts exactly as the job does (prompt or chat
``messages`` column, per-row ``sampling`` overrides, too-long prompts): a bad row becomes an error row, never
an exception that fails the batch. On an image-text checkpoint, ``image_column`` (the job's ``data.image_column``
layouts) and chat image parts give rows their images; a batch's rows of one image run together, and the
actor's encoder cache encodes each distinct image once while it holds it; a bad image is an error row.

How it differs from the job (``batchgen ...``): Ray Data owns the input, the output and the retries, so the
guarantees are Ray's — a batch whose actor dies is retried on another actor and its rows may be written
twice (at-least-once; no manifest, no resume of a stopped pipeline, no exactly-once). Sampling is seeded per
row from ``id_column`` when one is given (the same texts as the job with the same ``data.id_column``);
without it, from the row's position in its batch, which depends on how Ray batches the dataset.

Resources: Ray Data gives each actor one CPU unless ``map_batches`` says otherwise, and an actor holds it for
the whole pipeline. On a CPU node whose CPUs the actors take all of (``concurrency=2`` on a Ray with 2 CPUs)
the read tasks never get one and nothing reaches the actors: the pipeline waits forever. Give the actors
fewer CPUs than the node has (``num_cpus=0.5`` each with ``concurrency=2`` on 2 CPUs; docs/replicas.md). An
actor that has had no batch for :data:`IDLE_WARNING_S` seconds while no CPU of the cluster is free says so,
in one line on stderr (forwarded to the driver by Ray), with that advice.
"""

from __future__ import annotations

import os
import sys
import threading
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

IDLE_WARNING_S = float(os.environ.get("BATCHGEN_RAY_IDLE_WARNING_S", "60"))
"""Seconds an actor waits for its first batch before checking whether the pipeline is starved of CPUs."""


def starved_message(free_cpus: float, total_cpus: float, held_cpus: float, waited_s: float) -> str | None:
    """The one-line warning of an actor that has had no batch for `waited_s` seconds, holding `held_cpus` of
    the cluster's `total_cpus` CPUs while `free_cpus` are free; None when a CPU is free (the read tasks can
    run: the input is only slow)."""
    if free_cpus >= 1 or held_cpus <= 0:
        return None
    return (
        f"batchgen.ray.Generator: no batch after {waited_s:.0f} s and no CPU of the Ray cluster is free (this "
        f"actor holds {held_cpus:g} of {total_cpus:g}): the actors may hold every CPU while Ray Data's read "
        "tasks wait for one; give each actor less, e.g. map_batches(..., concurrency=2, num_cpus=0.5) on 2 "
        "CPUs (docs/replicas.md)"
    )


def _watch_first_batch(arrived: threading.Event, wait_s: float) -> None:
    """In a Ray actor: after `wait_s` seconds without a batch, print :func:`starved_message` if it applies."""
    ray = sys.modules.get(
        "ray"
    )  # in an actor Ray is imported; elsewhere (a plain call) there is nothing to watch
    if ray is None or not ray.is_initialized() or arrived.wait(wait_s):
        return
    try:
        held = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        free = ray.available_resources().get("CPU", 0.0)
        total = ray.cluster_resources().get("CPU", 0.0)
    except Exception:  # noqa: BLE001 - a warning must never fail the actor
        return
    msg = starved_message(free, total, held, wait_s)
    if msg and not arrived.is_set():
        print(msg, file=sys.stderr, flush=True)


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
        image_column: str | None = None,
        storage_options: dict[str, Any] | None = None,
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
        from batchgen.multimodal.rows import image_token_id

        if image_token_id(model) is not None:  # an image-text checkpoint: rows' images through its processor
            limits = (engine or {}).get("limit_mm_per_prompt") or {}
            self.spec.image_column, self.spec.image_checkpoint = image_column, model
            self.spec.max_images, self.spec.storage_options = limits.get("image"), dict(storage_options or {})
            self.spec.processor_kwargs = dict((engine or {}).get("mm_processor_kwargs") or {})
        elif image_column is not None:
            raise ValueError(
                f"image_column={image_column!r} but the model ({model}) is not an image-text checkpoint batchgen "
                "runs; unset image_column or choose such a model"
            )
        self.layout = PartLayout(id_type=pa.int64(), kept=[], n=params.n, logprobs=False, metadata={})
        self._batch_arrived = threading.Event()
        threading.Thread(
            target=_watch_first_batch, args=(self._batch_arrived, IDLE_WARNING_S), daemon=True
        ).start()

    def __call__(self, batch: Any) -> Any:
        """``batch``: a dict of NumPy arrays (Ray Data's default), a pandas DataFrame or a pyarrow Table;
        returns the same kind."""
        self._batch_arrived.set()
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
        keys = [(rows[p].image_hashes, rows[p].token_ids) for p in valid]  # rows of one image together
        feed = [valid[i] for i in prefix_order(keys)]  # type: ignore[arg-type]
        requests = [
            EngineRequest(
                p, rows[p].token_ids, rows[p].params, rows[p].lora, images=tuple(rows[p].images or ())
            )
            for p in feed
        ]

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
