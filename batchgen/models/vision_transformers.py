"""Image-text checkpoints whose vision side runs on transformers' own model code: the checkpoint's
``get_image_features`` (vision tower, resampler or connector and projector, as its class defines them) computes
the image features, batchgen's native decoder runs the language model on the paged KV cache.

Used for the architectures of :data:`batchgen.models.config.TRANSFORMERS_VISION` (each tested for greedy
equality with transformers: VipLLaVA, Idefics2, DeepSeek-VL and its hybrid, Janus, GOT-OCR2, LightOnOCR). What they share,
and what an architecture needs to be added: the processor writes each image's placeholder tokens into the prompt
(:class:`~batchgen.multimodal.inputs.ImagePrompts` reproduces them, seams included:
:mod:`batchgen.multimodal.joins`), the vision side's output rows replace those tokens' embeddings in order, and
the language model is a native architecture with plain causal attention and 1-D RoPE positions.
:mod:`batchgen.models.image_refusals` says why the other architectures' images do not run. Only the
transformers model's non-language tensors are loaded into it (:func:`load`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from batchgen.models.config import ModelConfig
from batchgen.models.vision import ImageTextModel

_LANGUAGE = ("language_model.", "model.language_model.", "lm_head.", "model.text_model.", "text_model.")


class TransformersImageEncoder(nn.Module):
    """Pixels of several images -> one ``[tokens, hidden]`` feature tensor each, through the transformers
    model's ``get_image_features`` with every tensor the processor made for the image that it takes
    (``pixel_values``, and ``pixel_attention_mask``, ``image_sizes``... where the family has them).

    Images whose tensors have the same shapes run in one call (one batch row each); the features of a call
    split evenly between its images, in order (each image's tokens are its rows of the output)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        params = inspect.signature(hf_model.get_image_features).parameters
        self._takes = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}

    @torch.inference_mode()
    def encode(self, pixels: list[dict[str, Tensor]]) -> list[Tensor]:
        out: list[Tensor] = [None] * len(pixels)  # type: ignore[list-item]
        for members, batch in self._calls(pixels):
            for i, f in zip(members, self._split(self._raw(batch), len(members))):
                out[i] = f
        return out

    def _calls(self, pixels: list[dict[str, Tensor]]) -> Iterator[tuple[list[int], dict[str, Tensor]]]:
        """The images whose tensors (those ``get_image_features`` takes) have the same shapes, stacked into
        one call each: ``(their indices, the call's tensors)``."""
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(pixels):
            shapes = tuple((k, tuple(v.shape)) for k, v in sorted(p.items()) if k in self._takes)
            groups.setdefault(shapes, []).append(i)
        for shapes, members in groups.items():
            yield members, {k: torch.stack([pixels[i][k] for i in members]) for k, _ in shapes}

    def _raw(self, batch: dict[str, Tensor]) -> Any:
        """``get_image_features`` of one call (floating tensors in the model's dtype): a tensor, or one per
        image."""
        param = next(self.hf.parameters())
        kwargs = {
            k: v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device)
            for k, v in batch.items()
        }
        feats = self.hf.get_image_features(**kwargs)
        return getattr(feats, "pooler_output", feats)  # an output object, a tensor or a list per image

    def _split(self, feats: Any, n: int) -> list[Tensor]:
        """The features of a call of ``n`` images, one ``[tokens, hidden]`` tensor each: its rows split
        evenly, in order."""
        flat = feature_rows(feats)
        return list(flat.view(n, -1, flat.shape[-1]))


def feature_rows(feats: Any) -> Tensor:
    """Features (a tensor or a list of them) as ``[rows, hidden]``, in order."""
    if isinstance(feats, (list, tuple)):
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    return feats.reshape(-1, feats.shape[-1])


def load(ckpt: Path, config: ModelConfig, dtype, device) -> nn.Module:
    """The checkpoint in ``ckpt``: native language model (``config``: its text config) and transformers'
    vision side (every tensor that is not the language model's), in the language model's dtype on ``device``.
    The transformers model is built with a language model of no layers and a one-token vocabulary (its
    vision side does not read it), so the language model's weights are held once, by the native decoder."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from batchgen.models.loader import load_native_model, safetensors_files

    hf_config = AutoConfig.from_pretrained(str(ckpt))
    text = hf_config.get_text_config()
    text.num_hidden_layers, text.vocab_size = 0, 1
    if hasattr(text, "layer_types"):
        text.layer_types = []
    hf = AutoModelForImageTextToText.from_config(hf_config).model  # the base model: no lm_head
    ours = {n for n in hf.state_dict() if not n.startswith(_LANGUAGE)}
    state: dict[str, Tensor] = {}
    stored: set[str] = set()  # the checkpoint's names of the vision side's tensors
    for file in safetensors_files(ckpt):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                for candidate in (name, name.removeprefix("model.")):
                    if candidate in ours:
                        state[candidate] = f.get_tensor(name)
                        stored.add(name)
                        break
    missing = sorted(ours - set(state))
    if missing:
        raise ValueError(f"{ckpt}: the vision side's tensors are missing from the checkpoint ({missing[:3]})")
    language_model = load_native_model(
        ckpt, config, dtype=dtype, device=device, rename=lambda n: None if n in stored else n
    )
    lm_dtype = next(language_model.parameters()).dtype
    hf.load_state_dict(state, strict=False)
    hf = hf.to(device=device, dtype=lm_dtype).eval().requires_grad_(False)
    raw: dict[str, Any] = json.loads((Path(ckpt) / "config.json").read_text())
    token = raw.get("image_token_index", raw.get("image_token_id"))
    return ImageTextModel(language_model, TransformersImageEncoder(hf), int(token), cache_bytes=1 << 30)
