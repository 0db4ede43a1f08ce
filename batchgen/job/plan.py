"""Planning a job: everything decided before the model is loaded.

:func:`plan_job` resolves the input files and their row counts, checks the columns, computes this shard's row
range and windows, resolves the checkpoint and fingerprints the configuration. Any problem raises
:class:`~batchgen.errors.ConfigError` (exit status 2, before any work).

Invariants:
- The *fingerprint* hashes exactly the settings that change the output (model files, dtype, the columns
  used, sampling, window size, ``engine.max_model_len``, ``engine.kv_cache_dtype`` other than ``auto``,
  ``engine.limit_mm_per_prompt``, the image processor's options, the chat template of a chat job); a rerun into the
  same output must match it — except :data:`RETRY_KEYS`, which may change with ``data.retry_errors=true``.
  Performance settings (engine memory and batch sizes, device, ``data.group_by_prefix``) and the model's
  path (only its files count) are left out, so they may change between runs.
- Windows depend only on the input, the shard and ``data.window_rows``: a rerun sees the same windows.
- Every file of the input holds the columns the job reads, with types that unify, and the prompt column can
  hold a prompt (a string, or for chat a list or a JSON string): a job in which no row could ever succeed is
  refused here, before the model loads (:func:`batchgen.data.columns.select_columns`).
- The job config is read once, into :class:`PlanSettings`; every step of the plan takes plain values from it
  (no step below :func:`plan_job` sees the config).
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
from batchgen.data.columns import ColumnSpec, select_columns
from batchgen.data.manifest import Manifest
from batchgen.data.parts import PartLayout
from batchgen.data.prompts import PromptSpec
from batchgen.data.reader import InputSet, WindowSpec, open_input, plan_windows, shard_range
from batchgen.data.structured import arrow_type
from batchgen.engine.config import parse_bytes
from batchgen.errors import ConfigError
from batchgen.job.config import POOLING_TASKS, JobConfig
from batchgen.lora_request import LoRARequest
from batchgen.multimodal.rows import image_options
from batchgen.sampling_params import SamplingParams

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


# ------------------------------------------------------------------------------------- the settings
@dataclass(frozen=True)
class KVRequest:
    """What the KV memory check reads: the engine's pool options (``engine.kv_cache_dtype`` included) and the
    weights' dtype option."""

    device: str
    kv_cache_memory: str
    num_blocks: int | None
    block_size: int
    dtype: str
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class PlanSettings:
    """What planning reads of the job config, as plain values, built once (:meth:`of`): every step of the plan
    takes the values it needs from here, none of them the config."""

    task: str
    input: str
    output: str
    storage_options: dict[str, Any]
    columns: ColumnSpec
    shard_index: int
    shard_count: int
    window_rows: int
    json_schema: Any
    """The schema of the parsed ``generated_json`` column (``sampling.json_schema`` with
    ``data.parse_json=true``; None: no such column)."""
    model_given: str | None
    """``model.path`` as given (None: the embedded tiny model)."""
    gguf_file: str | None
    implementation: str
    dtype: str
    lora_modules: dict[str, str]
    sampling: SamplingParams
    max_model_len: int | None
    pooling: dict[str, Any]
    kv: KVRequest
    limit_mm_per_prompt: dict[str, int]
    mm_processor_kwargs: dict[str, Any]
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, cfg: JobConfig) -> PlanSettings:
        """The values of ``cfg`` planning reads (``data.input`` null: the shipped sample)."""
        d, e = cfg.data, cfg.engine
        return cls(
            task=cfg.task,
            input=d.input if d.input else sample_input_path(),
            output=d.output,
            storage_options=dict(d.storage_options),
            columns=ColumnSpec(
                prompt_column=d.prompt_column,
                messages_column=d.messages_column,
                id_column=d.id_column,
                keep_columns=tuple(d.keep_columns),
                sampling_column=d.sampling_column,
                continuation_column=d.continuation_column,
                lora_column=d.lora_column,
                image_column=d.image_column,
            ),
            shard_index=d.shard.index,
            shard_count=d.shard.count,
            window_rows=d.window_rows,
            json_schema=_parsed_json_schema(d.parse_json, cfg.sampling.json_schema),
            model_given=cfg.model.path or None,
            gguf_file=cfg.model.gguf_file,
            implementation=cfg.model.implementation,
            dtype=cfg.model.dtype,
            lora_modules=dict(cfg.model.lora_modules or {}),
            sampling=cfg.sampling,
            max_model_len=e.max_model_len,
            pooling=dataclasses.asdict(cfg.pooling),
            kv=KVRequest(
                e.device,
                e.kv_cache_memory,
                e.num_blocks,
                e.block_size,
                cfg.model.dtype,
                str(e.kv_cache_dtype),
            ),
            limit_mm_per_prompt=dict(e.limit_mm_per_prompt or {}),
            mm_processor_kwargs=dict(e.mm_processor_kwargs or {}),
            kv_cache_dtype=str(e.kv_cache_dtype),
        )


# --------------------------------------------------------------------------------------------- model
def _model_path(given: str | None, gguf_file: str | None) -> str:
    """The checkpoint directory: ``model.path`` (``given``; with ``model.gguf_file``, that file in it), or the
    embedded tiny model shipped in the package."""
    if not given:
        from batchgen.models.tiny import tiny_default_checkpoint

        return tiny_default_checkpoint()
    path = os.path.expanduser(given)
    if gguf_file or path.lower().endswith(".gguf"):  # one GGUF file: model, config and tokenizer
        path = os.path.join(path, gguf_file) if gguf_file else path
        if not os.path.isfile(path):
            raise ConfigError(f"model.path: GGUF file {path!r} does not exist")
        return path
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model.path: {given!r} is not a Hugging Face checkpoint directory (no config.json)"
        )
    return path


def lora_requests(lora_modules: dict[str, str]) -> dict[str, LoRARequest]:
    """``model.lora_modules`` as the engine's requests: ids 1..N in name order, absolute paths."""
    return {
        name: LoRARequest(name, i + 1, os.path.abspath(os.path.expanduser(path)))
        for i, (name, path) in enumerate(sorted(lora_modules.items()))
    }


def _model_facts(s: PlanSettings, path: str) -> Any:
    """The checkpoint's facts (architecture, max length) for the task, from its config files only (no weights
    are read); an unsupported or malformed one is a ConfigError here, before anything loads. A generation
    checkpoint's CPU KV pool must fit the machine (:func:`_check_kv_memory`); a GGUF file takes no ``model.dtype``
    but float32, as its loader says."""
    from batchgen.models.quant.gguf_checkpoint import check_dtype, gguf_path

    if gguf_path(path) is not None:
        try:
            check_dtype(s.dtype)
        except ValueError as e:
            raise ConfigError(f"model.path: cannot use {s.model_given!r}: {e}") from e
    if s.task in POOLING_TASKS:
        from batchgen.job.pool import pooling_model_facts

        return pooling_model_facts(s.task, path)
    from batchgen.models.checkpoint_facts import checkpoint_facts

    try:
        facts = checkpoint_facts(path, s.implementation)
    except (ValueError, KeyError, TypeError, OSError) as e:
        where = s.model_given or "the embedded tiny model"
        raise ConfigError(f"model.path: cannot use {where!r}: {e}") from e
    _check_kv_memory(s.kv, facts)
    return facts


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_kv_memory(kv: KVRequest, model_cfg: Any) -> None:
    """A CPU KV cache pool larger than the machine's memory can never be allocated: refuse it now (from
    ``engine.kv_cache_memory``, or ``engine.num_blocks`` times the block size of this model)."""
    if kv.device.startswith("cuda"):
        return
    if kv.device == "auto":
        try:
            import torch

            if torch.cuda.is_available():
                return
        except ImportError:  # pragma: no cover - torch is a dependency
            return
    have = _physical_memory()
    if have is None:
        return
    if kv.num_blocks is None:
        want = parse_bytes(kv.kv_cache_memory)
        if want > have:
            raise ConfigError(
                f"engine.kv_cache_memory={kv.kv_cache_memory} ({want / 2**30:.1f} GiB) is more than this machine's "
                f"memory ({have / 2**30:.1f} GiB); lower engine.kv_cache_memory (or set engine.num_blocks)"
            )
        return
    import torch

    from batchgen.kernels.kv_cache_dtype import cache_dtype
    from batchgen.models.config import parse_dtype
    from batchgen.models.quant.weight_dtype import compute_dtype

    weights = model_cfg.dtype if kv.dtype == "auto" else parse_dtype(kv.dtype)
    dtype = cache_dtype(kv.kv_cache_dtype, compute_dtype(weights, "cpu"))  # as the engine sizes its pool
    elem = torch.tensor([], dtype=dtype).element_size()
    per_block = 2 * model_cfg.num_layers * kv.block_size * model_cfg.num_kv_heads * model_cfg.head_dim * elem
    want = kv.num_blocks * per_block
    if want > have:
        raise ConfigError(
            f"engine.num_blocks={kv.num_blocks} is a KV cache of {want / 2**30:.1f} GiB for this model, more than "
            f"this machine's memory ({have / 2**30:.1f} GiB); lower engine.num_blocks"
        )


# -------------------------------------------------------------------------------- what the output records
def _fingerprint_config(
    s: PlanSettings,
    model_fp: str,
    sampling_col: str | None,
    template_fp: str | None,
    loras: dict[str, LoRARequest],
) -> dict[str, Any]:
    """The settings that change the output (see the module docstring), as recorded in the manifest."""
    c = s.columns
    model: dict[str, Any] = {"fingerprint": model_fp, "dtype": s.dtype}
    if c.messages_column:
        model["chat_template"] = template_fp
    score: dict[str, Any] = {}
    if s.task == "score":
        score = {"task": "score", "continuation_column": c.continuation_column}
    elif s.task in POOLING_TASKS:
        score = {"task": s.task, "pooling": s.pooling}
    lora = {}
    if loras:  # the adapters change the output: a rerun with others does not resume
        lora = {"lora": {"modules": {n: r.lora_path for n, r in loras.items()}, "column": c.lora_column}}
    return {
        **score,
        **lora,
        "model": model,
        "data": {
            "prompt_column": None if c.messages_column else c.prompt_column,
            "messages_column": c.messages_column,
            "id_column": c.id_column,
            "keep_columns": list(c.keep_columns),
            "sampling_column": sampling_col,
            "window_rows": s.window_rows,
        },
        # pooling reads no sampling settings: changing them does not change the output
        "sampling": None if s.task in POOLING_TASKS else s.sampling.to_dict(),
        "engine": _engine_facts(s),
    }


def _engine_facts(s: PlanSettings) -> dict[str, Any]:
    """The engine settings that change the output: the length bound, a KV cache narrower than the model's
    (rounded keys and values), the images a prompt may hold (more is an error row), and the image processor's
    options."""
    facts: dict[str, Any] = {"max_model_len": s.max_model_len}
    if s.kv_cache_dtype != "auto":
        facts["kv_cache_dtype"] = s.kv_cache_dtype
    if s.limit_mm_per_prompt:
        facts["limit_mm_per_prompt"] = s.limit_mm_per_prompt
    if s.mm_processor_kwargs:
        facts["mm_processor_kwargs"] = s.mm_processor_kwargs
    return facts


def _part_metadata(s: PlanSettings, inp: InputSet, model_fp: str, sampling_col: str | None) -> dict[str, Any]:
    """The schema metadata of every part (the window's range is added per part)."""
    c = s.columns
    return {
        "batchgen_version": batchgen.__version__,
        "model": {"path": s.model_given or "tiny-default", "fingerprint": model_fp, "dtype": s.dtype},
        "sampling": s.sampling.to_dict(),
        "prompt": {"messages_column": c.messages_column}
        if c.messages_column
        else {"prompt_column": c.prompt_column},
        "sampling_column": sampling_col,
        "id_column": c.id_column,
        "input": {"fingerprint": inp.fingerprint, "num_files": len(inp.files), "num_rows": inp.num_rows},
        "shard": {"index": s.shard_index, "count": s.shard_count},
        "engine": _engine_facts(s),
    }


def _parsed_json_schema(parse_json: bool, json_schema: Any) -> Any:
    """The schema ``data.parse_json`` parses outputs with (None: off); ConfigError when it has none."""
    if not parse_json:
        return None
    if json_schema is None:
        raise ConfigError("data.parse_json=true needs sampling.json_schema (the schema of the parsed column)")
    return json_schema


def _part_layout(
    s: PlanSettings, schema: pa.Schema, metadata: dict[str, Any], json_type: pa.DataType | None
) -> PartLayout:
    """How every output part is laid out: id and kept columns' types, samples, logprobs, the parsed JSON column."""
    c = s.columns
    id_type = schema.field(c.id_column).type if c.id_column else pa.int64()
    kept = [
        pa.field(k, schema.field(k).type) for k in c.keep_columns if not (k == "id" and c.id_column == "id")
    ]
    return PartLayout(
        id_type=id_type,
        kept=kept,
        n=s.sampling.n,
        logprobs=s.sampling.logprobs is not None,
        metadata=metadata,
        id_source=c.id_column,
        structured=s.sampling.constrained or metadata.get("sampling_column") is not None,
        json_type=json_type,
    )


def _hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def plan_job(cfg: JobConfig) -> JobPlan:
    """Resolve input, columns, shard, windows, model and fingerprints; raises ConfigError on any problem.

    The config is read once, into :class:`PlanSettings`; each step below takes the plain values it needs."""
    s = PlanSettings.of(cfg)
    inp = open_input(s.input, output=s.output, storage_options=s.storage_options)
    row_start, row_end = shard_range(inp.num_rows, s.shard_index, s.shard_count)
    windows = plan_windows(row_start, row_end, s.window_rows)
    cols = select_columns(inp, s.columns)
    json_type = arrow_type(s.json_schema) if s.json_schema is not None else None
    model_path = _model_path(s.model_given, s.gguf_file)
    c = s.columns  # an image job on a model whose images cannot run: that reason first
    images = image_options(
        c.image_column, model_path, s.limit_mm_per_prompt, s.storage_options, s.mm_processor_kwargs, inp.root
    )
    model_cfg = _model_facts(s, model_path)
    model_fp, template_fp, files = model_identity(model_path)
    loras = lora_requests(s.lora_modules)
    fp_config = _fingerprint_config(s, model_fp, cols.sampling_column, template_fp, loras)
    layout = _part_layout(s, cols.schema, _part_metadata(s, inp, model_fp, cols.sampling_column), json_type)
    spec = PromptSpec(
        prompt_column=c.prompt_column,
        messages_column=c.messages_column,
        id_column=c.id_column,
        sampling_column=cols.sampling_column,
        base_sampling=s.sampling,
        lora_column=c.lora_column,
        lora_requests=loras,
        **images,
    )
    return JobPlan(
        cfg=cfg,
        input=inp,
        model_path=model_path,
        columns=cols.names,
        prompt_spec=spec,
        row_start=row_start,
        row_end=row_end,
        windows=windows,
        fingerprint=_hash(fp_config),
        fingerprint_config=fp_config,
        part_layout=layout,
        read_schema=cols.schema,
        model_info={
            "path": os.path.abspath(model_path) if s.model_given else "tiny-default",
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
