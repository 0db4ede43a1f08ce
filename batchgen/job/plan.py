"""Planning a job: everything decided before the model is loaded.

:func:`plan_job` resolves the input files and their row counts, checks the columns, computes this shard's row
range and windows, resolves the checkpoint and fingerprints the configuration. Any problem raises
:class:`~batchgen.errors.ConfigError` (exit status 2, before any work).

Invariants:
- The *fingerprint* hashes exactly the settings that change the output (model files, dtype, the columns
  used, sampling, window size, ``engine.max_model_len``, the chat template of a chat job); a rerun into the
  same output must match it — except :data:`RETRY_KEYS`, which may change with ``data.retry_errors=true``.
  Performance settings (engine memory and batch sizes, device, ``data.group_by_prefix``) and the model's
  path (only its files count) are left out, so they may change between runs.
- Windows depend only on the input, the shard and ``data.window_rows``: a rerun sees the same windows.
- Every file of the input holds the columns the job reads, with types that unify (:meth:`InputSet.read_schema`),
  and the prompt column can hold a prompt (a string, or for chat a list or a JSON string): a job in which
  no row could ever succeed is refused here, before the model loads.
"""

from __future__ import annotations

import dataclasses
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
from batchgen.data.structured import arrow_type
from batchgen.engine.config import parse_bytes
from batchgen.errors import ConfigError
from batchgen.job.config import POOLING_TASKS, DataOptions, JobConfig
from batchgen.lora_request import LoRARequest
from batchgen.multimodal.rows import image_options

DEFAULT_SAMPLING_COLUMN = "sampling"
RETRY_KEYS = ("engine.max_model_len", "model.chat_template")
"""Fingerprint keys that may change when resuming with ``data.retry_errors=true``: they decide which rows
fail (too long, template errors), and fixing them is what a retry is for."""
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def sample_input_path() -> str:
    """The small sample Parquet shipped with batchgen (used when data.input is null)."""
    return str(resources.files("batchgen") / "sample_data" / "prompts.parquet")


def _file_digests(path: str) -> dict[str, bytes]:
    """name → digest of each checkpoint file that defines the model: configs, tokenizer files, chat
    templates, and the size and header of each safetensors file (not the full weights)."""
    out: dict[str, bytes] = {}
    p = Path(path)
    if p.is_file():  # a GGUF file: its size and its header (metadata and tensor table come first)
        with open(p, "rb") as fh:
            return {p.name: f"{p.stat().st_size}\0".encode() + hashlib.sha256(fh.read(1 << 24)).digest()}
    for name in sorted(os.listdir(p)):
        f = p / name
        if not f.is_file():
            continue
        if name.endswith(".json") or name.endswith(".jinja") or name in ("tokenizer.model",):
            out[name] = hashlib.sha256(f.read_bytes()).digest()
        elif name.endswith(".safetensors"):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = fh.read(min(n, 100_000_000))
            out[name] = f"{f.stat().st_size}\0".encode() + hashlib.sha256(header).digest()
    return out


def _chat_template_text(path: str) -> str | None:
    p = Path(path)
    parts = []
    try:
        cfg = json.loads((p / "tokenizer_config.json").read_text())
        if cfg.get("chat_template") is not None:
            parts.append(json.dumps(cfg["chat_template"], sort_keys=True))
    except (OSError, ValueError):
        pass
    for name in _TEMPLATE_FILES:
        if (p / name).is_file():
            parts.append(f"{name}\0" + (p / name).read_text(errors="replace"))
    return "\n".join(parts) if parts else None


def model_identity(path: str) -> tuple[str, str | None, dict[str, str]]:
    """(fingerprint without the chat template, chat template hash or None, short per-file hashes).

    The chat template is hashed on its own so that fixing a template that failed rows can be resumed with
    ``data.retry_errors=true``; the per-file hashes name what changed when a resume is refused."""
    digests = _file_digests(path)
    h = hashlib.sha256()
    for name, digest in digests.items():
        if name in _TEMPLATE_FILES:
            continue
        if name == "tokenizer_config.json":
            try:
                cfg = json.loads((Path(path) / name).read_text())
                cfg.pop("chat_template", None)
                digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).digest()
            except (OSError, ValueError):
                pass
        h.update(f"{name}\0".encode() + digest)
    template = _chat_template_text(path)
    tfp = hashlib.sha256(template.encode()).hexdigest()[:16] if template is not None else None
    return h.hexdigest(), tfp, {k: v.hex()[-12:] for k, v in digests.items()}


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
    read_schema: pa.Schema
    """The columns the job reads, with their types unified over the input files."""
    model_info: dict[str, Any]
    """Names describing the checkpoint (path, architecture, per-file hashes): shown when a resume is refused."""
    model_max_len: int
    """The model's own limit on prompt + generation (before ``engine.max_model_len``)."""


# ------------------------------------------------------------------------------------------- columns
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


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view"


def _check_prompt_type(d: DataOptions, schema: pa.Schema) -> None:
    """ConfigError when the prompt (or messages) column's type can never hold a valid prompt: every row
    would be an error row."""
    if d.messages_column:
        t = schema.field(d.messages_column).type
        if not (_is_text(t) or pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_null(t)):
            raise ConfigError(
                f"data.messages_column: column {d.messages_column!r} has type {t}; expected a list of "
                "{role, content} structs or a JSON string, so every row would fail"
            )
        what, t, key = d.messages_column, t, "data.messages_column"
    else:
        t = schema.field(d.prompt_column).type
        if not (_is_text(t) or pa.types.is_null(t)):
            raise ConfigError(
                f"data.prompt_column: column {d.prompt_column!r} has type {t}, not string, so every row "
                "would fail; choose a string column (or data.messages_column for chat messages)"
            )
        what, key = d.prompt_column, "data.prompt_column"
    if pa.types.is_null(t):
        raise ConfigError(
            f"{key}: column {what!r} holds only nulls in every input file, so every row would fail"
        )


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
    if d.lora_column:
        _require_column(inp, d.lora_column, "data.lora_column")
    if d.image_column:
        _require_column(inp, d.image_column, "data.image_column")
    sampling_col = _sampling_column(d, inp)
    columns = [source] + ([d.id_column] if d.id_column else []) + list(d.keep_columns)
    columns += [sampling_col] if sampling_col else []
    columns += [d.continuation_column] if d.continuation_column else []
    columns += [d.lora_column] if d.lora_column else []
    columns += [d.image_column] if d.image_column else []
    return list(dict.fromkeys(columns)), sampling_col


# --------------------------------------------------------------------------------------------- model
def _model_path(cfg: JobConfig) -> str:
    """The checkpoint directory: model.path, or the embedded tiny model shipped in the package."""
    if not cfg.model.path:
        from batchgen.models.tiny import tiny_default_checkpoint

        return tiny_default_checkpoint()
    path = os.path.expanduser(cfg.model.path)
    if cfg.model.gguf_file or path.lower().endswith(".gguf"):  # one GGUF file: model, config and tokenizer
        path = os.path.join(path, cfg.model.gguf_file) if cfg.model.gguf_file else path
        if not os.path.isfile(path):
            raise ConfigError(f"model.path: GGUF file {path!r} does not exist")
        return path
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model.path: {cfg.model.path!r} is not a Hugging Face checkpoint directory (no config.json)"
        )
    return path


def _model_config(cfg: JobConfig, path: str) -> Any:
    """The checkpoint's facts on the road ``model.implementation`` takes (config files only: no weights are
    read); an unsupported or malformed one is a ConfigError here, before anything loads."""
    from batchgen.models.checkpoint_facts import checkpoint_facts

    try:
        return checkpoint_facts(path, cfg.model.implementation)
    except (ValueError, KeyError, TypeError, OSError) as e:
        where = cfg.model.path or "the embedded tiny model"
        raise ConfigError(f"model.path: cannot use {where!r}: {e}") from e


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_kv_memory(cfg: JobConfig, model_cfg: Any) -> None:
    """A CPU KV cache pool larger than the machine's memory can never be allocated: refuse it now (from
    ``engine.kv_cache_memory``, or ``engine.num_blocks`` times the block size of this model)."""
    e = cfg.engine
    if e.device.startswith("cuda"):
        return
    if e.device == "auto":
        try:
            import torch

            if torch.cuda.is_available():
                return
        except ImportError:  # pragma: no cover - torch is a dependency
            return
    have = _physical_memory()
    if have is None:
        return
    if e.num_blocks is None:
        want = parse_bytes(e.kv_cache_memory)
        if want > have:
            raise ConfigError(
                f"engine.kv_cache_memory={e.kv_cache_memory} ({want / 2**30:.1f} GiB) is more than this machine's "
                f"memory ({have / 2**30:.1f} GiB); lower engine.kv_cache_memory (or set engine.num_blocks)"
            )
        return
    import torch

    from batchgen.models.config import parse_dtype

    dtype = model_cfg.dtype if cfg.model.dtype == "auto" else parse_dtype(cfg.model.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    per_block = 2 * model_cfg.num_layers * e.block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elem
    want = e.num_blocks * per_block
    if want > have:
        raise ConfigError(
            f"engine.num_blocks={e.num_blocks} is a KV cache of {want / 2**30:.1f} GiB for this model, more than "
            f"this machine's memory ({have / 2**30:.1f} GiB); lower engine.num_blocks"
        )


# -------------------------------------------------------------------------------- what the output records
def _fingerprint_config(
    cfg: JobConfig,
    model_fp: str,
    sampling_col: str | None,
    template_fp: str | None = None,
) -> dict[str, Any]:
    """The settings that change the output (see the module docstring), as recorded in the manifest."""
    d = cfg.data
    model: dict[str, Any] = {"fingerprint": model_fp, "dtype": cfg.model.dtype}
    if d.messages_column:
        model["chat_template"] = template_fp
    score: dict[str, Any] = {}
    if cfg.task == "score":
        score = {"task": "score", "continuation_column": d.continuation_column}
    elif cfg.task in POOLING_TASKS:
        score = {"task": cfg.task, "pooling": dataclasses.asdict(cfg.pooling)}
    lora = {}
    if cfg.model.lora_modules:  # the adapters change the output: a rerun with others does not resume
        lora = {
            "lora": {
                "modules": {n: r.lora_path for n, r in lora_requests(cfg).items()},
                "column": d.lora_column,
            }
        }
    return {
        **score,
        **lora,
        "model": model,
        "data": {
            "prompt_column": None if d.messages_column else d.prompt_column,
            "messages_column": d.messages_column,
            "id_column": d.id_column,
            "keep_columns": list(d.keep_columns),
            "sampling_column": sampling_col,
            "window_rows": d.window_rows,
        },
        # pooling reads no sampling settings: changing them does not change the output
        "sampling": None if cfg.task in POOLING_TASKS else cfg.sampling.to_dict(),
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


def _part_layout(cfg: JobConfig, schema: pa.Schema, metadata: dict[str, Any]) -> PartLayout:
    d = cfg.data
    id_type = schema.field(d.id_column).type if d.id_column else pa.int64()
    kept = [
        pa.field(c, schema.field(c).type) for c in d.keep_columns if not (c == "id" and d.id_column == "id")
    ]
    json_type = None
    if d.parse_json:
        if cfg.sampling.json_schema is None:
            raise ConfigError(
                "data.parse_json=true needs sampling.json_schema (the schema of the parsed column)"
            )
        json_type = arrow_type(cfg.sampling.json_schema)
    return PartLayout(
        id_type=id_type,
        kept=kept,
        n=cfg.sampling.n,
        logprobs=cfg.sampling.logprobs is not None,
        metadata=metadata,
        id_source=d.id_column,
        structured=cfg.sampling.constrained or metadata.get("sampling_column") is not None,
        json_type=json_type,
    )


def _hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def lora_requests(cfg: JobConfig) -> dict[str, LoRARequest]:
    """``model.lora_modules`` as the engine's requests: ids 1..N in name order, absolute paths."""
    return {
        name: LoRARequest(name, i + 1, os.path.abspath(os.path.expanduser(path)))
        for i, (name, path) in enumerate(sorted((cfg.model.lora_modules or {}).items()))
    }


def plan_job(cfg: JobConfig) -> JobPlan:
    """Resolve input, columns, shard, windows, model and fingerprints; raises ConfigError on any problem."""
    d = cfg.data
    inp = open_input(
        d.input if d.input else sample_input_path(), output=d.output, storage_options=dict(d.storage_options)
    )
    columns, sampling_col = _check_columns(d, inp)
    schema = inp.read_schema(columns)
    _check_prompt_type(d, schema)
    row_start, row_end = shard_range(inp.num_rows, d.shard.index, d.shard.count)
    model_path = _model_path(cfg)
    if cfg.task in POOLING_TASKS:
        from batchgen.job.pool import pooling_model_facts

        model_cfg = pooling_model_facts(cfg, model_path)
    else:
        model_cfg = _model_config(cfg, model_path)
        _check_kv_memory(cfg, model_cfg)
    model_fp, template_fp, files = model_identity(model_path)
    fp_config = _fingerprint_config(cfg, model_fp, sampling_col, template_fp)
    spec = PromptSpec(
        prompt_column=d.prompt_column,
        messages_column=d.messages_column,
        id_column=d.id_column,
        sampling_column=sampling_col,
        base_sampling=cfg.sampling,
        lora_column=d.lora_column,
        lora_requests=lora_requests(cfg),
        **image_options(cfg, model_path),
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
        fingerprint=_hash(fp_config),
        fingerprint_config=fp_config,
        part_layout=_part_layout(cfg, schema, _part_metadata(cfg, inp, model_fp, sampling_col)),
        read_schema=schema,
        model_info={
            "path": os.path.abspath(model_path) if cfg.model.path else "tiny-default",
            "architecture": model_cfg.architecture,
            "files": files,
        },
        model_max_len=int(model_cfg.max_model_len),
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
        model=plan.model_info,
    )
