"""Decoder checkpoints for pooling on batchgen's native code: embedders (``Qwen3Model``, ``MistralModel``, a
``*ForCausalLM`` asked to embed, sentence-transformers layouts over them) and sequence classifiers / reward
models (``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``...).

The backbone is our native ``CausalLM`` (so it runs on the paged engine, prefill only, with the prefix cache);
the language-model head is never loaded (bare ``*Model`` checkpoints store the backbone without the
``model.`` prefix; a causal LM's ``lm_head`` is skipped) and the engine's sampler gets a zero logit column
(its token is discarded). A classifier's ``score`` linear layer is read here and applied
to the last token's hidden state, as transformers' ``*ForSequenceClassification`` does (last non-padding token).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from batchgen.models.config import NATIVE_ARCHITECTURES, NativeUnsupportedError, read_config_files
from batchgen.pooling.checkpoint import CheckpointPooling

_HEAD_NAMES = ("score.weight", "score.bias")


class PoolingDecoder(nn.Module):
    """A native backbone whose ``forward`` returns hidden states and whose ``compute_logits`` returns one zero
    column per row (pooling requests discard their sampled token). ``score``: the classification head."""

    def __init__(self, lm: nn.Module, score: nn.Linear | None) -> None:
        super().__init__()
        self.lm = lm
        self.config = lm.config
        self.score = score

    def forward(self, input_ids: Tensor, positions: Tensor, ctx) -> Tensor:
        return self.lm(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return torch.zeros(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)


def native_config(info: CheckpointPooling):
    """Our ``ModelConfig`` for a decoder pooling checkpoint (its causal-LM architecture of the same
    ``model_type``; the head tied so no ``lm_head`` is needed)."""
    from batchgen.models.config import ModelConfig

    config, generation = read_config_files(info.path)
    by_type = {v: k for k, v in NATIVE_ARCHITECTURES.items()}
    causal = by_type.get(config.get("model_type"))
    if causal is None:
        raise NativeUnsupportedError(
            f"{info.path}: model_type {config.get('model_type')!r} ({info.architecture}) has no native decoder; "
            f"pooling runs on the native families: {', '.join(sorted(by_type))}"
        )
    config = {**config, "architectures": [causal], "tie_word_embeddings": True}
    return ModelConfig.from_dict(config, generation, source=str(Path(info.path) / "config.json"))


def load_pooling_decoder(
    info: CheckpointPooling, dtype: str | torch.dtype, device: torch.device
) -> PoolingDecoder:
    """Load the backbone (and the ``score`` head of a classifier) of a decoder checkpoint."""
    from batchgen.models.loader import load_native_model

    config = native_config(info)
    bare = not any(_stored_names(info.path, lambda n: n.startswith("model.")))

    def rename(name: str) -> str | None:
        if name in _HEAD_NAMES or name.startswith("lm_head."):
            return None
        return f"model.{name}" if bare else name

    lm = load_native_model(Path(info.path), config, dtype=dtype, device=device, rename=rename)
    score = _load_score(info, lm.config.dtype, device) if info.task == "classify" else None
    return PoolingDecoder(lm, score).eval()


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
