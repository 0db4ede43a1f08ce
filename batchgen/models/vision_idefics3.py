"""Idefics3 (and SmolVLM, which uses its architecture): image splitting and a pixel-shuffle connector in front
of a native Llama-family decoder.

The processor splits a large image into a grid of tiles of the encoder's size plus a downscaled global view;
each tile's patches go through the SigLIP-style vision transformer (transformers' ``Idefics3VisionTransformer``)
and the connector shuffles every ``scale_factor x scale_factor`` patches into one token and projects it
(``Idefics3Connector``): ``image_seq_len`` tokens per tile. In the prompt each tile's tokens sit between text
tokens (``<fake_token_around_image>``, ``<row_i_col_j>``, ``<global-img>``) that the processor writes, so an
image's feature tokens are not contiguous (:class:`~batchgen.multimodal.inputs.ImageItem` ``offsets``). The
tower and connector are transformers' own classes loaded from ``model.vision_model.*`` / ``model.connector.*``,
and :meth:`Idefics3Encoder.encode` is ``Idefics3Model.get_image_features`` itself, so features are equal op
for op; the language model is batchgen's native decoder on the paged KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchgen.models.config import ModelConfig
from batchgen.models.vision import ImageTextModel, load_vision_weights

_PREFIXES = (("model.vision_model.", "vision_model."), ("model.connector.", "connector."))


class Idefics3Encoder(nn.Module):
    """Tiles of several images -> one ``[tiles * image_seq_len, hidden]`` feature tensor per image."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        from transformers.models.idefics3.modeling_idefics3 import (
            Idefics3Connector,
            Idefics3VisionTransformer,
        )

        self.config = hf_config  # read by get_image_features
        self.vision_model = Idefics3VisionTransformer._from_config(hf_config.vision_config)
        self.connector = Idefics3Connector(hf_config)

    @property
    def dtype(self) -> torch.dtype:  # read by get_image_features
        return next(self.parameters()).dtype

    @torch.inference_mode()
    def encode(self, pixels: list[dict[str, Tensor]]) -> list[Tensor]:
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Model

        device = next(self.parameters()).device
        tiles = [p["pixel_values"].shape[0] for p in pixels]
        values = torch.cat([p["pixel_values"] for p in pixels]).to(device)[None]
        mask = torch.cat([p["pixel_attention_mask"] for p in pixels]).to(device)[None]
        per_tile = Idefics3Model.get_image_features(self, values, mask).pooler_output[0]
        per_tile = per_tile.view(sum(tiles), -1, per_tile.shape[-1])
        return [t.reshape(-1, t.shape[-1]) for t in torch.split(per_tile, tiles)]


def load(ckpt: Path, config: ModelConfig, dtype, device) -> nn.Module:
    """The Idefics3 checkpoint in ``ckpt``: native language model (``config``: its text config) and the
    vision encoder from transformers' classes, in the language model's dtype on ``device``."""
    from transformers import AutoConfig

    from batchgen.models.loader import load_native_model

    language_model = load_native_model(ckpt, config, dtype=dtype, device=device)
    hf = AutoConfig.from_pretrained(str(ckpt))
    encoder = Idefics3Encoder(hf)
    load_vision_weights(encoder, ckpt, _PREFIXES)
    lm_dtype = next(language_model.parameters()).dtype
    encoder = encoder.to(device=device, dtype=lm_dtype).eval().requires_grad_(False)
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    return ImageTextModel(language_model, encoder, int(raw["image_token_id"]), cache_bytes=1 << 30)
