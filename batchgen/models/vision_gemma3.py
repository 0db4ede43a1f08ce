"""Gemma 3 image-text checkpoints (``Gemma3ForConditionalGeneration``): a SigLIP vision tower and the
``Gemma3MultiModalProjector`` (patch features average-pooled to ``mm_tokens_per_image``, the soft-embedding
RMSNorm, one linear map) in front of the native Gemma 3 decoder (local/global layers, QK-norm, scaled
embeddings: :mod:`batchgen.models.llama`).

The processor writes each image as ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` ``<image_soft_token>``
+ ``<end_of_image>\\n\\n`` in place of the prompt's ``<start_of_image>``; the soft tokens take the features.
During prefill an image's soft tokens attend to each other both ways (transformers' ``token_type_ids``
mask, in sliding-window layers too, within the window): the model marks the spans
(``ImageTextModel(bidirectional_images=True)``) and the engine keeps each span in one prefill chunk.

The tower and projector are transformers' own classes loaded from ``model.vision_tower.*`` /
``model.multi_modal_projector.*`` (transformers 4.x: without ``model.``), so the features equal
``Gemma3Model.get_image_features`` op for op.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchgen.models.config import ModelConfig
from batchgen.models.vision import ImageTextModel, load_vision_weights

_OURS = ("vision_tower.", "multi_modal_projector.")
_PREFIXES = tuple(("model." + p, p) for p in _OURS) + tuple((p, p) for p in _OURS)


class Gemma3Encoder(nn.Module):
    """Pixels (``pixel_values [3, H, W]`` per image, the processor's fixed size, or ``[1 + crops, 3, H, W]``
    with pan and scan: the whole image, then its crops) -> ``[views * mm_tokens_per_image, hidden]`` features
    per image, its views in order, all views of the call in one batch."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)

    @torch.inference_mode()
    def encode(self, pixels: list[dict[str, Tensor]]) -> list[Tensor]:
        param = next(self.parameters())
        views = [p["pixel_values"].reshape(-1, *p["pixel_values"].shape[-3:]) for p in pixels]
        batch = torch.cat(views).to(device=param.device, dtype=param.dtype)
        hidden = self.vision_tower(pixel_values=batch, return_dict=True).last_hidden_state
        features = self.multi_modal_projector(hidden)
        return [f.flatten(0, 1) for f in features.split([len(v) for v in views])]


def load(ckpt: Path, config: ModelConfig, dtype, device) -> nn.Module:
    """The Gemma 3 checkpoint in ``ckpt``: native language model (``config``: its text config) and the
    vision encoder from transformers' classes, in the language model's dtype on ``device``."""
    from transformers import AutoConfig

    from batchgen.models.loader import load_native_model

    language_model = load_native_model(ckpt, config, dtype=dtype, device=device)
    hf = AutoConfig.from_pretrained(str(ckpt))
    encoder = Gemma3Encoder(hf)
    load_vision_weights(encoder, ckpt, _PREFIXES, ignore_missing=("position_ids",))
    lm_dtype = next(language_model.parameters()).dtype
    encoder = encoder.to(device=device, dtype=lm_dtype).eval().requires_grad_(False)
    return ImageTextModel(
        language_model, encoder, int(hf.image_token_id), cache_bytes=1 << 30, bidirectional_images=True
    )
