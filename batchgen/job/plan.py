"""Planning a job: everything decided before the model is loaded.

:func:`plan_job` resolves the input files and their row counts, checks the columns, computes this shard's row
range and windows, resolves the checkpoint and fingerprints the configuration. Any problem raises
:class:`~batchgen.errors.ConfigError` (exit status 2, before any work).

Invariants:
- The *fingerprint* hashes exactly the settings that change the output (model files, dtype, the columns
  used, sampling, window size, ``engine.max_model_len``); a rerun into the same output must match it.
  Performance settings (engine memory and batch sizes, device, ``data.group_by_prefix``) and the model's
  path (only its files count) are left out, so they may change between runs.
- Windows depend only on the input, the shard and ``data.window_rows``: a rerun sees the same windows.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow as pa

import batchgen
from batchgen.data.manifest import Manifest
from batchgen.data.parts import PartLayout
from batchgen.data.prompts import PromptSpec, struct_override_problems
from batchgen.data.reader import InputSet, WindowSpec, open_input, plan_windows, shard_range
from batchgen.errors import ConfigError
from batchgen.job.config import DataOptions, JobConfig

DEFAULT_SAMPLING_COLUMN = "sampling"


def sample_input_path() -> str:
    """The small sample Parquet shipped with batchgen (used when data.input is null)."""
    return str(resources.files("batchgen") / "sample_data" / "prompts.parquet")


def model_fingerprint(path: str) -> str:
    """Hash of a checkpoint's configs, tokenizer files and safetensors headers (not the full weights)."""
    h = hashlib.sha256()
    p = Path(path)
    for name in sorted(os.listdir(p)):
        f = p / name
        if not f.is_file():
            continue
        if name.endswith(".json") or name.endswith(".jinja") or name in ("tokenizer.model",):
            h.update(f"{name}\0".encode() + hashlib.sha256(f.read_bytes()).digest())
        elif name.endswith(".safetensors"):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = fh.read(min(n, 100_000_000))
            h.update(f"{name}\0{f.stat().st_size}\0".encode() + hashlib.sha256(header).digest())
    return h.hexdigest()


@dataclass
class JobPlan:
    """Everything decided before the model is loaded."""

    cfg: JobConfig
    input: InputSet
    model_path: str
    columns: list[str]
    """The input columns read: the prompt (or messages) column, then id, kept and sampling columns."""
    prompt_spec: PromptSpec
    row_start: int
    row_end: int
    windows: list[WindowSpec]
    fingerprint: str
    fingerprint_config: dict[str, Any]
    part_layout: PartLayout


# ------------------------------------------------------------------------------------------- columns
def _require_column(inp: InputSet, name: str, key: str) -> None:
    """ConfigError naming `key` unless every input file has column `name`."""
    missing = [f.rel_path for f in inp.files if f.schema.get_field_index(name) < 0]
    if missing:
        avail = ", ".join(inp.columns[:30])
        where = (
            "the input" if len(missing) == len(inp.files) else f"{len(missing)} file(s), e.g. {missing[0]!r}"
        )
        raise ConfigError(f"{key}: column {name!r} is missing from {where} (columns: {avail})")


def _sampling_column(d: DataOptions, inp: InputSet) -> str | None:
    """The per-row sampling column in effect: None when unset, or when it is the default name and absent."""
    name = d.sampling_column
    if not name:
        return None
    if not inp.has_column(name):
        if name == DEFAULT_SAMPLING_COLUMN and inp.column_type(name) is None:
            return None  # the default name, absent: no per-row overrides
        _require_column(inp, name, "data.sampling_column")
    problem = struct_override_problems(inp.column_type(name))  # type: ignore[arg-type]
    if problem:
        raise ConfigError(f"data.sampling_column: column {name!r} {problem}")
    return name


def _check_columns(d: DataOptions, inp: InputSet) -> tuple[list[str], str | None]:
    """(input columns to read, effective sampling column); ConfigError for a column the input lacks."""
    if d.messages_column:
        _require_column(inp, d.messages_column, "data.messages_column")
        source = d.messages_column
    else:
        _require_column(inp, d.prompt_column, "data.prompt_column")
        source = d.prompt_column
    if d.id_column:
        _require_column(inp, d.id_column, "data.id_column")
    for c in d.keep_columns:
        _require_column(inp, c, "data.keep_columns")
    if d.continuation_column:
        _require_column(inp, d.continuation_column, "data.continuation_column")
    sampling_col = _sampling_column(d, inp)
    columns = [source] + ([d.id_column] if d.id_column else []) + list(d.keep_columns)
    columns += [sampling_col] if sampling_col else []
    columns += [d.continuation_column] if d.continuation_column else []
    return list(dict.fromkeys(columns)), sampling_col


# --------------------------------------------------------------------------------------------- model
def _model_path(cfg: JobConfig) -> str:
    """The checkpoint directory: model.path, or the embedded tiny model (built on first use)."""
    if not cfg.model.path:
        from batchgen.models.tiny import tiny_default_checkpoint

        return tiny_default_checkpoint()
    path = os.path.expanduser(cfg.model.path)
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model.path: {cfg.model.path!r} is not a Hugging Face checkpoint directory (no config.json)"
        )
    return path


# -------------------------------------------------------------------------------- what the output records
def _fingerprint_config(cfg: JobConfig, model_fp: str, sampling_col: str | None) -> dict[str, Any]:
    """The settings that change the output (see the module docstring), as recorded in the manifest."""
    d = cfg.data
    score = {"task": "score", "continuation_column": d.continuation_column} if cfg.task == "score" else {}
    return {
        **score,
        "model": {"fingerprint": model_fp, "dtype": cfg.model.dtype},
        "data": {
            "prompt_column": None if d.messages_column else d.prompt_column,
            "messages_column": d.messages_column,
            "id_column": d.id_column,
            "keep_columns": list(d.keep_columns),
            "sampling_column": sampling_col,
            "window_rows": d.window_rows,
        },
        "sampling": cfg.sampling.to_dict(),
        "engine": {"max_model_len": cfg.engine.max_model_len},
    }


def _part_metadata(cfg: JobConfig, inp: InputSet, model_fp: str, sampling_col: str | None) -> dict[str, Any]:
    """The schema metadata of every part (the window's range is added per part)."""
    d = cfg.data
    return {
        "batchgen_version": batchgen.__version__,
        "model": {
            "path": cfg.model.path or "tiny-default",
            "fingerprint": model_fp,
            "dtype": cfg.model.dtype,
        },
        "sampling": cfg.sampling.to_dict(),
        "prompt": {"messages_column": d.messages_column}
        if d.messages_column
        else {"prompt_column": d.prompt_column},
        "sampling_column": sampling_col,
        "id_column": d.id_column,
        "input": {"fingerprint": inp.fingerprint, "num_files": len(inp.files), "num_rows": inp.num_rows},
        "shard": {"index": d.shard.index, "count": d.shard.count},
        "engine": {"max_model_len": cfg.engine.max_model_len},
    }


def _part_layout(cfg: JobConfig, inp: InputSet, metadata: dict[str, Any]) -> PartLayout:
    d = cfg.data

    def plain(t: pa.DataType | None) -> pa.DataType:
        if t is None:
            return pa.null()
        return t.value_type if pa.types.is_dictionary(t) else t

    id_type = plain(inp.column_type(d.id_column)) if d.id_column else pa.int64()
    kept = [
        pa.field(c, inp.column_type(c)) for c in d.keep_columns if not (c == "id" and d.id_column == "id")
    ]
    return PartLayout(
        id_type=id_type,
        kept=kept,
        n=cfg.sampling.n,
        logprobs=cfg.sampling.logprobs is not None,
        metadata=metadata,
    )


def plan_job(cfg: JobConfig) -> JobPlan:
    """Resolve input, columns, shard, windows, model and fingerprints; raises ConfigError on any problem."""
    d = cfg.data
    inp = open_input(d.input if d.input else sample_input_path())
    columns, sampling_col = _check_columns(d, inp)
    row_start, row_end = shard_range(inp.num_rows, d.shard.index, d.shard.count)
    model_path = _model_path(cfg)
    model_fp = model_fingerprint(model_path)
    fp_config = _fingerprint_config(cfg, model_fp, sampling_col)
    spec = PromptSpec(
        prompt_column=d.prompt_column,
        messages_column=d.messages_column,
        id_column=d.id_column,
        sampling_column=sampling_col,
        base_sampling=cfg.sampling,
    )
    return JobPlan(
        cfg=cfg,
        input=inp,
        model_path=model_path,
        columns=columns,
        prompt_spec=spec,
        row_start=row_start,
        row_end=row_end,
        windows=plan_windows(row_start, row_end, d.window_rows),
        fingerprint=hashlib.sha256(json.dumps(fp_config, sort_keys=True, default=str).encode()).hexdigest(),
        fingerprint_config=fp_config,
        part_layout=_part_layout(cfg, inp, _part_metadata(cfg, inp, model_fp, sampling_col)),
    )


def fresh_manifest(plan: JobPlan) -> Manifest:
    """The manifest of this plan with no window finished yet."""
    d = plan.cfg.data
    return Manifest(
        fingerprint=plan.fingerprint,
        config=plan.fingerprint_config,
        input=plan.input.describe(),
        shard={
            "index": d.shard.index,
            "count": d.shard.count,
            "row_start": plan.row_start,
            "row_end": plan.row_end,
        },
        window_rows=d.window_rows,
        num_windows=len(plan.windows),
        batchgen_version=batchgen.__version__,
    )
