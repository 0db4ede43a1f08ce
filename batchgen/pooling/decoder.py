"""Decoder checkpoints for pooling: embedders (``Qwen3Model``, ``MistralModel``, ``GPTNeoXModel``, a
``*ForCausalLM`` asked to embed, sentence-transformers layouts over them) and sequence classifiers / reward
models (``LlamaForSequenceClassification``, ``GPTNeoXForSequenceClassification``...), on the paged engine
(prefill only, with the prefix cache).

The backbone is our native ``CausalLM`` for the native families (shardable with tensor parallelism), else
transformers' base model of the family over the paged attention (``model.implementation=transformers``, or
``auto`` for a family batchgen has no code for: :class:`~batchgen.models.transformers_backend.TransformersBackbone`).
The language-model head is never loaded (bare ``*Model`` checkpoints store the backbone without the ``model.``
prefix; a causal LM's ``lm_head`` is skipped): the engine computes no logits for pooling requests. A
classifier's ``score`` linear layer is read here (replicated on every tensor-parallel rank) and applied to the
last token's hidden state, as transformers' ``*ForSequenceClassification`` does (last non-padding token).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from batchgen.models.config import CAUSAL_ARCHITECTURE_OF_TYPE, NativeUnsupportedError, read_config_files
from batchgen.models.packed_linear import PackedLinear
from batchgen.pooling.checkpoint import CheckpointPooling

logger = logging.getLogger(__name__)

_HEAD_NAMES = ("score.weight", "score.bias")


class PoolingDecoder(nn.Module):
    """A backbone whose ``forward`` returns hidden states (after the final norm) and that has no language-model
    head: the engine never asks it for logits (pooling requests sample nothing). ``score``: the
    classification head."""

    has_lm_head = False

    def __init__(self, lm: nn.Module, score: nn.Linear | None) -> None:
        super().__init__()
        self.lm = lm
        self.config = lm.config
        self.score = score

    def forward(self, input_ids: Tensor, positions: Tensor, ctx) -> Tensor:
        return self.lm(input_ids, positions, ctx)


def native_config(info: CheckpointPooling):
    """Our ``ModelConfig`` for a decoder pooling checkpoint (its causal-LM architecture of the same
    ``model_type``; the head tied so no ``lm_head`` is needed)."""
    from batchgen.models.config import ModelConfig

    config, generation = read_config_files(info.path)
    causal = CAUSAL_ARCHITECTURE_OF_TYPE.get(config.get("model_type"))
    if causal is None:
        raise NativeUnsupportedError(
            f"{info.path}: model_type {config.get('model_type')!r} ({info.architecture}) has no native decoder "
            f"(native families: {', '.join(sorted(CAUSAL_ARCHITECTURE_OF_TYPE))}); model.implementation=auto or "
            "transformers pools it with transformers' modeling code"
        )
    config = {**config, "architectures": [causal], "tie_word_embeddings": True}
    return ModelConfig.from_dict(config, generation, source=str(Path(info.path) / "config.json"))


def load_pooling_decoder(
    info: CheckpointPooling,
    dtype: str | torch.dtype,
    implementation: str,
    device: torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> PoolingDecoder:
    """Load the backbone (and the ``score`` head of a classifier) of a decoder checkpoint: rank ``tp_rank``'s
    shard of the native backbone, or transformers' (``implementation``: auto, native or transformers; the
    transformers backbone runs on one device). A GGUF file loads as it does for generation (native, one
    device)."""
    from batchgen.models.quant.gguf_checkpoint import gguf_path, load_gguf_model

    if gguf_path(info.path) is not None:
        if tp_size > 1 or implementation == "transformers":
            raise ValueError(
                f"{info.path}: a GGUF file is pooled by batchgen's native code on one device; set "
                "model.implementation=auto and engine.tensor_parallel_size=1"
            )
        return PoolingDecoder(load_gguf_model(info.path, dtype, device), None).eval()
    config = None
    if implementation != "transformers":
        try:
            config = native_config(info)
        except NativeUnsupportedError as e:
            if implementation == "native" or tp_size > 1:
                raise
            logger.info("no native implementation (%s): pooling with transformers' modeling code", e)
    if config is None:
        if tp_size > 1:
            raise ValueError(
                f"engine.tensor_parallel_size={tp_size}: the transformers backend runs on one device; set "
                "engine.tensor_parallel_size=1"
            )
        return _load_transformers(info, dtype, device)
    return _load_native(info, config, dtype, device, tp_rank, tp_size)


def check_pooling_decoder(info: CheckpointPooling, implementation: str, tp_size: int) -> None:
    """Refuse, before any rank starts, what :func:`load_pooling_decoder` cannot shard over ``tp_size``
    ranks (a ValueError naming ``engine.tensor_parallel_size``)."""
    from batchgen.models.parallel import check_divisible

    if tp_size <= 1:
        return
    refused = (
        f"engine.tensor_parallel_size={tp_size} needs a natively implemented decoder family and "
        "model.implementation auto or native: the transformers backend runs on one device; set "
        "engine.tensor_parallel_size=1"
    )
    if implementation == "transformers":
        raise ValueError(refused)
    from batchgen.models.quant.gguf_checkpoint import gguf_path

    if gguf_path(info.path) is not None:
        raise ValueError(f"engine.tensor_parallel_size={tp_size}: a GGUF file runs on one device; set "
                         "engine.tensor_parallel_size=1")  # fmt: skip
    try:
        config = native_config(info)
    except NativeUnsupportedError as e:
        raise ValueError(f"{refused} ({e})") from e
    check_divisible(config, tp_size)


def _load_native(info, config, dtype, device, tp_rank: int, tp_size: int) -> PoolingDecoder:
    from batchgen.models.loader import load_native_model
    from batchgen.models.parallel import shard_config

    bare = not any(_stored_names(info.path, lambda n: n.startswith("model.")))

    def rename(name: str) -> str | None:
        if name in _HEAD_NAMES or name.startswith("lm_head."):
            return None
        return f"model.{name}" if bare else name

    if tp_size > 1:
        config = shard_config(config, tp_rank, tp_size)
    lm = load_native_model(Path(info.path), config, dtype=dtype, device=device, rename=rename)
    score = _load_score(info, lm.config.dtype, device) if info.task == "classify" else None
    return PoolingDecoder(lm, score).eval()


def _load_transformers(info: CheckpointPooling, dtype, device) -> PoolingDecoder:
    import transformers

    from batchgen.models.transformers_backend import UnsupportedModelError, load_transformers_backbone

    classify = info.task == "classify"
    auto = transformers.AutoModelForSequenceClassification if classify else transformers.AutoModel
    backbone, hf_model = load_transformers_backbone(info.path, auto, dtype=dtype, device=device)
    score = getattr(hf_model, "score", None) if classify else None
    if classify and not isinstance(score, (nn.Linear, PackedLinear)):
        raise UnsupportedModelError(
            f"{info.path}: {type(hf_model).__name__}'s classification head is not one `score` linear layer "
            "applied to the last token; batchgen cannot pool it"
        )
    return PoolingDecoder(backbone, score).eval()


def _stored_names(path: Path, keep) -> list[str]:
    from batchgen.models.loader import safetensors_files

    names = []
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names += [n for n in f.keys() if keep(n)]
    return names


def _load_score(info: CheckpointPooling, dtype: torch.dtype, device: torch.device) -> nn.Linear:
    from batchgen.models.loader import safetensors_files

    tensors: dict[str, Tensor] = {}
    for file in safetensors_files(Path(info.path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in _HEAD_NAMES:
                if name in f.keys():
                    tensors[name] = f.get_tensor(name)
    if "score.weight" not in tensors:
        raise ValueError(
            f"{info.path}: classifier checkpoint without a score.weight tensor ({info.architecture})"
        )
    w = tensors["score.weight"]
    head = nn.Linear(w.shape[1], w.shape[0], bias="score.bias" in tensors)
    with torch.no_grad():
        head.weight.copy_(w)
        if head.bias is not None:
            head.bias.copy_(tensors["score.bias"])
    return head.to(device=device, dtype=dtype).requires_grad_(False)
