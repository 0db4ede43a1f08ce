"""What a checkpoint directory says about pooling: its task, the sentence-transformers pipeline (modules.json,
``1_Pooling/config.json``, ``2_Normalize``), the classification head's labels, encoder or decoder.

Task detection (:func:`detect_task`), from the checkpoint alone:
- an architecture ending in ``ForSequenceClassification`` (or ``ForRewardModel``) -> ``classify``;
- a sentence-transformers layout (``modules.json``) -> ``embed``;
- a bare backbone (``BertModel``, ``Qwen3Model``, ``MistralModel``...) or an encoder model type -> ``embed``;
- anything else (``*ForCausalLM``) -> ``generate``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("batchgen")

PACKED_ENCODER_MODEL_TYPES = (
    "bert",
    "roberta",
    "xlm-roberta",
    "camembert",
    "distilbert",
    "electra",
    "modernbert",
)
"""Encoder families whose batches run as one packed row of tokens (their attention goes through transformers'
attention interface, which batchgen's varlen attention replaces)."""

ENCODER_MODEL_TYPES = (*PACKED_ENCODER_MODEL_TYPES, "mpnet", "deberta", "deberta-v2", "albert")
"""Encoder families run through transformers' modeling code (:mod:`batchgen.pooling.encoder`); those not packed
run in length-sorted batches padded to their longest row (relative-position attention: MPNet, DeBERTa)."""

UNSUPPORTED_ENCODER_MODEL_TYPES = ("nomic_bert", "xlnet", "t5")
"""Bidirectional models batchgen does not pool (a hub checkpoint's config differs from transformers' own class, or
the model is not an encoder of the families above): refused by name before anything loads."""

_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last", "last": "last", "mean_tokens": "mean"}
_ST_MODE_KEYS = {  # sentence-transformers < 5 spelled the mode as booleans
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


class PoolingCheckpointError(ValueError):
    """The checkpoint's pooling configuration cannot be honoured (the message says what and where)."""


@dataclass(frozen=True)
class CheckpointPooling:
    """Pooling facts of one checkpoint. ``pooling`` / ``normalize``: the sentence-transformers choice (None when
    the checkpoint has no such config); ``labels``: ``id2label`` in label order (classifiers)."""

    path: Path
    architecture: str
    model_type: str
    task: str
    is_encoder: bool
    pooling: str | None = None
    normalize: bool | None = None
    max_seq_length: int | None = None
    num_labels: int = 0
    labels: list[str] = field(default_factory=list)
    problem_type: str | None = None
    pad_token_id: int | None = None
    """A decoder classifier's head reads the last token that is not this one (transformers' rule)."""
    lowercase: bool = False
    """sentence-transformers' ``do_lower_case``: texts are lowercased before they are tokenised."""

    @property
    def default_pooling(self) -> str:
        """The pooling used when the caller names none: the checkpoint's, else CLS (encoders) or last."""
        if self.pooling is not None:
            return self.pooling
        return "cls" if self.is_encoder else "last"

    @property
    def default_normalize(self) -> bool:
        """Normalise when the checkpoint says so; with a sentence-transformers config that has no Normalize
        module, do not; with no such config at all, do (vLLM's default)."""
        return True if self.normalize is None else self.normalize


def read_checkpoint(path: str | Path) -> CheckpointPooling:
    """Parse ``config.json`` and the sentence-transformers files of a checkpoint directory; a GGUF file (a
    causal LM: ``task=embed`` pools its last hidden states) from its own metadata."""
    from batchgen.models.quant.gguf_checkpoint import gguf_path, read_config

    ckpt = Path(path)
    if gguf_path(ckpt) is not None:
        config = read_config(ckpt)
        return CheckpointPooling(
            ckpt, config.architecture, config.model_type, "generate", is_encoder=False,
            max_seq_length=config.max_position_embeddings,
        )  # fmt: skip
    cfg_file = ckpt / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{ckpt} has no config.json: pass a Hugging Face checkpoint directory")
    config = json.loads(cfg_file.read_text())
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    model_type = str(config.get("model_type", ""))
    pooling, normalize, max_len, lowercase = _sentence_transformers(ckpt)
    id2label = config.get("id2label") or {}
    # transformers' default is 2 labels: its configs leave num_labels and id2label out then
    num_labels = int(config.get("num_labels") or len(id2label) or 2)
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels)]
    return CheckpointPooling(
        path=ckpt,
        architecture=arch,
        model_type=model_type,
        task=detect_task(arch, model_type, (ckpt / "modules.json").is_file()),
        is_encoder=model_type in ENCODER_MODEL_TYPES,
        pooling=pooling,
        normalize=normalize,
        max_seq_length=max_len,
        num_labels=num_labels if _is_classifier(arch) else 0,
        labels=labels if _is_classifier(arch) else [],
        problem_type=config.get("problem_type"),
        pad_token_id=_pad_token_id(config),
        lowercase=lowercase,
    )


def _pad_token_id(config: dict[str, Any]) -> int | None:
    pad = config.get("pad_token_id", (config.get("text_config") or {}).get("pad_token_id"))
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def _is_classifier(arch: str) -> bool:
    return arch.endswith(("ForSequenceClassification", "ForRewardModel"))


def detect_task(arch: str, model_type: str, has_modules_json: bool) -> str:
    """``classify``, ``embed`` or ``generate`` (module docstring)."""
    if _is_classifier(arch):
        return "classify"
    if has_modules_json or model_type in ENCODER_MODEL_TYPES or _is_bare_backbone(arch):
        return "embed"
    return "generate"


def _is_bare_backbone(arch: str) -> bool:
    """A base model with no head (``Qwen3Model``, ``BertModel``), not a language model whose class name also
    ends in ``Model`` (``GPT2LMHeadModel``, ``...ForCausalLM``)."""
    return arch.endswith("Model") and not arch.endswith(
        ("LMHeadModel", "ForCausalLM", "ForConditionalGeneration")
    )


def _sentence_transformers(ckpt: Path) -> tuple[str | None, bool | None, int | None, bool]:
    """(pooling, normalize, max_seq_length, do_lower_case) from a sentence-transformers layout (None, None,
    None, False without one)."""
    modules_file = ckpt / "modules.json"
    if not modules_file.is_file():
        return None, None, None, False
    try:
        modules = json.loads(modules_file.read_text())
    except ValueError as e:
        raise PoolingCheckpointError(f"{modules_file} is not valid JSON: {e}") from e
    pooling: str | None = None
    normalize = False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        where = ckpt / str(m.get("path", ""))
        if kind == "Pooling":
            pooling = _st_pooling_mode(where / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer",):
            raise PoolingCheckpointError(
                f"{modules_file}: module {m.get('path')!r} of type {m.get('type')!r} is not supported "
                "(batchgen runs Transformer, Pooling and Normalize modules)"
            )
    st: dict[str, Any] = {}
    st_cfg = ckpt / "sentence_bert_config.json"
    if st_cfg.is_file():
        st = json.loads(st_cfg.read_text())
    max_len = st.get("max_seq_length")
    return pooling, normalize, int(max_len) if max_len else None, bool(st.get("do_lower_case", False))


def _st_pooling_mode(cfg_file: Path) -> str:
    if not cfg_file.is_file():
        raise PoolingCheckpointError(f"sentence-transformers pooling config {cfg_file} is missing")
    cfg: dict[str, Any] = json.loads(cfg_file.read_text())
    mode = cfg.get("pooling_mode")
    if mode is None:
        on = [name for key, name in _ST_MODE_KEYS.items() if cfg.get(key)]
        if len(on) != 1:
            raise PoolingCheckpointError(
                f"{cfg_file}: expected exactly one pooling mode, found {on or 'none'}"
            )
        mode = on[0]
    if isinstance(mode, list) or str(mode) not in _ST_MODES:
        raise PoolingCheckpointError(
            f"{cfg_file}: pooling mode {mode!r} is not supported (batchgen pools with cls, mean or lasttoken)"
        )
    if cfg.get("include_prompt") is False:
        raise PoolingCheckpointError(
            f"{cfg_file}: include_prompt=false (prompt-excluded pooling) is not supported"
        )
    return _ST_MODES[str(mode)]


TASKS = ("auto", "generate", "embed", "classify")


def resolve_task(model: str | Path, task: str = "auto") -> str:
    """The task to load ``model`` for: ``task`` itself, or with ``auto`` the checkpoint's (logged, with why)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    if not (Path(model) / "config.json").is_file():
        return "generate"  # the loader names what is wrong with the path
    info = read_checkpoint(model)
    if info.task != "generate":
        why = (
            "sentence-transformers modules.json"
            if (info.path / "modules.json").is_file()
            else info.architecture
        )
        logger.info("%s: task=%s (from %s)", model, info.task, why or info.model_type)
    return info.task
