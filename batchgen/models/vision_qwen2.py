"""Qwen2-VL and Qwen2.5-VL: dynamic resolution, a ViT over merged patches, and multimodal RoPE.

- **Dynamic resolution.** The image processor resizes each image to multiples of ``patch_size * merge_size``
  within its pixel bounds and cuts it into ``grid_t x grid_h x grid_w`` patches; the vision tower (Qwen2-VL's
  ViT with 2-D RoPE; Qwen2.5-VL's with window attention, RMSNorm and SwiGLU) runs all patches of a batch of
  images at once (attention stays within each image, or window), and the patch merger turns every
  ``merge_size x merge_size`` patches into one token: ``grid_t * grid_h * grid_w / merge_size**2`` tokens.
  The tower and merger are transformers' own module classes built from the checkpoint's ``vision_config``
  and loaded from its ``visual.*`` tensors, so features equal ``get_image_features`` op for op.
- **M-RoPE.** The language model (a native Qwen2 decoder on the paged KV cache) rotates three frequency
  sections (``mrope_section``) by three position rows: text tokens have the same position in all three;
  an image's tokens have (start, start + row, start + column) for its merged grid; the text after an image
  continues at ``start + max(grid_h, grid_w) / merge_size``, not at ``start + tokens``. Decoding goes on from
  the prompt's largest position: a generated token's position is its cache position plus the row's ``delta``
  (``max position + 1 - prompt length``). :meth:`QwenVLModel.rope_positions` is that function of a row; the
  engine's image feature tables it per request and hands each step's ``[3, T]`` positions to the forward
  (``ForwardContext.rope_positions``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from batchgen.models.config import ModelConfig
from batchgen.models.vision import ImageTextModel, load_vision_weights

_VISUAL_PREFIXES = ("model.visual.", "visual.")


class QwenVisionEncoder(nn.Module):
    """Pixels of several images -> one ``[tokens, hidden]`` feature tensor each (``get_image_features``)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        if hf_config.model_type == "qwen2_5_vl":
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as Tower,
            )
        else:
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VisionTransformerPretrainedModel as Tower,
            )
        self.visual = Tower._from_config(hf_config.vision_config)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    @torch.inference_mode()
    def encode(self, pixels: list[dict[str, Tensor]]) -> list[Tensor]:
        dtype = next(self.parameters()).dtype
        device = next(self.parameters()).device
        batch = torch.cat([p["pixel_values"] for p in pixels]).to(device=device, dtype=dtype)
        grid = torch.stack([p["image_grid_thw"] for p in pixels]).to(device)
        merged = self.visual(batch, grid_thw=grid).pooler_output
        return list(torch.split(merged, (grid.prod(-1) // self.merge**2).tolist()))


class QwenVLModel(ImageTextModel):
    """The native Qwen2 decoder with the vision encoder and M-RoPE positions (see the module docstring)."""

    def __init__(self, language_model, encoder, image_token_id, cache_bytes, sections: list[int]) -> None:
        super().__init__(language_model, encoder, image_token_id, cache_bytes)
        self.language_model.model.rotary_emb.set_sections(sections)
        self.merge = encoder.merge

    def rope_positions(self, num_tokens: int, images: Sequence[Any]) -> tuple[np.ndarray, int]:
        """A prompt's ``[3, num_tokens]`` position ids and its decode ``delta`` (a generated token at cache
        position ``p`` has position ``p + delta`` in every row). ``images``: each image's first placeholder
        position ``start``, ``num_tokens`` and its processor tensors (``image_grid_thw``)."""
        pos = np.empty((3, num_tokens), dtype=np.int64)
        cur = prev = 0
        for im in sorted(images, key=lambda im: im.start):
            pos[:, prev : im.start] = cur + np.arange(im.start - prev)
            cur += im.start - prev
            t, h, w = (int(x) for x in im.pixels["image_grid_thw"])
            h, w = h // self.merge, w // self.merge
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            end = im.start + im.num_tokens
            pos[:, im.start : end] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
            cur += max(h, w)
            prev = end
        pos[:, prev:] = cur + np.arange(num_tokens - prev)
        return pos, int(pos.max()) + 1 - num_tokens if num_tokens else 0

    def forward(self, input_ids: Tensor, positions: Tensor, ctx) -> Tensor:
        if ctx.rope_positions is not None:
            positions = ctx.rope_positions
        return super().forward(input_ids, positions, ctx)


def _mrope_section(raw: dict[str, Any]) -> list[int]:
    text = raw.get("text_config") or raw
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key) or raw.get(key)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return [int(x) for x in rope["mrope_section"]]
    raise ValueError("the checkpoint's config names no mrope_section (rope_parameters / rope_scaling)")


def load(ckpt: Path, config: ModelConfig, dtype, device) -> nn.Module:
    """The Qwen2-VL / Qwen2.5-VL checkpoint in ``ckpt``: native language model (``config``: its text
    config) and the vision encoder from transformers' classes, in the language model's dtype on ``device``."""
    from transformers import AutoConfig

    from batchgen.models.loader import load_native_model

    language_model = load_native_model(ckpt, config, dtype=dtype, device=device)
    hf = AutoConfig.from_pretrained(str(ckpt))
    encoder = QwenVisionEncoder(hf)
    load_vision_weights(encoder, ckpt, tuple((prefix, "visual.") for prefix in _VISUAL_PREFIXES))
    lm_dtype = next(language_model.parameters()).dtype
    rotary = encoder.visual.rotary_pos_emb
    inv_freq = rotary.inv_freq.clone()  # float32 in transformers whatever the weights' dtype
    encoder = encoder.to(device=device, dtype=lm_dtype).eval().requires_grad_(False)
    rotary.inv_freq = inv_freq.to(device)
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    return QwenVLModel(
        language_model, encoder, int(raw["image_token_id"]), cache_bytes=1 << 30, sections=_mrope_section(raw)
    )
