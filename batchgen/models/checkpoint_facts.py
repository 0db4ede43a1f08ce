"""What planning needs to know about a checkpoint, read from its config files alone (no weights).

:func:`checkpoint_facts` takes the same road as :func:`batchgen.models.loader.load_model` for the same
``implementation``: the native parse for ``native`` (and for ``auto`` when batchgen has the architecture),
transformers' configuration for ``transformers`` (and for ``auto`` otherwise). So a checkpoint the loader can
run is never refused by planning, and one it cannot run is refused with the loader's own message.

Invariant: ``max_model_len`` equals the ``max_model_len`` of the loaded model's config on the same road.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.models.config import ModelConfig, NativeUnsupportedError, parse_dtype
from batchgen.models.quant.compressed_tensors import quantization_scheme
from batchgen.models.quant.gguf_checkpoint import gguf_path
from batchgen.models.quant.gguf_checkpoint import read_config as read_gguf_config


@dataclass(frozen=True)
class CheckpointFacts:
    """Architecture, context length and KV-cache shape of a checkpoint on the road that will run it."""

    architecture: str
    implementation: str  # "native" or "transformers"
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def checkpoint_facts(path: str | Path, implementation: str = "auto") -> CheckpointFacts:
    """The facts of `path` for `implementation` (auto, native, transformers); ValueError (or
    NativeUnsupportedError / UnsupportedModelError, both ValueErrors) for a checkpoint that road cannot run."""
    gguf_file = gguf_path(path)
    if gguf_file is not None:  # the loader's GGUF road: native code only
        if implementation == "transformers":
            raise ValueError(
                "a GGUF checkpoint runs on batchgen's native code: use model.implementation auto or native"
            )
        return _native_facts(read_gguf_config(gguf_file))
    if quantization_scheme(path) is not None and implementation == "transformers":  # refuses others by name
        raise ValueError(
            "a quantized checkpoint runs on batchgen's native code: use model.implementation auto"
        )
    if implementation == "transformers":
        return _transformers_facts(Path(path))
    try:
        return _native_facts(ModelConfig.from_pretrained(path))
    except NativeUnsupportedError as e:
        if implementation == "native":
            raise e.for_native_only() from e
        native = e
    from batchgen.models.transformers_backend import WrongTaskError

    try:
        return _transformers_facts(Path(path))
    except WrongTaskError:  # not a language model at all: which task it is for, not every architecture
        raise
    except ValueError as e:  # neither road: say why for both
        raise ValueError(f"{native}; nor can transformers' modeling code run it: {e}") from e


def _native_facts(c: ModelConfig) -> CheckpointFacts:
    return CheckpointFacts(
        architecture=c.architecture,
        implementation="native",
        max_model_len=int(c.max_model_len),
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=c.dtype,
    )


def _transformers_facts(path: Path) -> CheckpointFacts:
    """From transformers' configuration object (the checks of `inspect_checkpoint`, no weights); the KV shape
    is the configuration's (the loaded model probes the real one, which the sizes here only estimate)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from batchgen.models.config import hf_config_from_dict, read_config_files, runs_whole_on_transformers
    from batchgen.models.transformers_backend import inspect_checkpoint, max_context_len

    raw, _ = read_config_files(path)
    if runs_whole_on_transformers(list(raw.get("architectures") or []), "transformers"):  # image-text
        hf = hf_config_from_dict(raw, str(path / "config.json"))
    else:
        hf = inspect_checkpoint(path)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    archs = getattr(hf, "architectures", None) or []
    arch = archs[0] if archs else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf.model_type, hf.model_type)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    head_dim = getattr(text, "head_dim", None) or max(hidden // heads, 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    dtype = getattr(text, "dtype", None) or getattr(hf, "dtype", None) or "float32"
    return CheckpointFacts(
        architecture=str(arch),
        implementation="transformers",
        max_model_len=max_context_len(text, str(path / "config.json")),
        num_layers=int(getattr(text, "num_hidden_layers", 1) or 1),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        dtype=parse_dtype(dtype),
    )
