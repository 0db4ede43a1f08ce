"""LLaVA (1.5) and LLaVA-NeXT: a CLIP vision tower and a two-layer projector in front of a native Llama-family
decoder; NeXT tiles each image at any resolution (a base view plus a grid of crops), unpads the grid's features
to the image's aspect ratio and ends each row with the learnt ``image_newline`` (transformers'
``pack_image_features``), so its token count depends on the image size.

The vision tower and projector are transformers' own module classes built from the checkpoint's config and
loaded from its ``vision_tower.*`` / ``multi_modal_projector.*`` tensors (transformers 4.x and 5.x layouts), so
the image features equal ``LlavaModel.get_image_features`` op for op; the language model is batchgen's native
decoder on the paged KV cache (:class:`~batchgen.models.vision.ImageTextModel`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from batchgen.models.config import ModelConfig

_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.image_newline", "image_newline"),
)
_OURS = ("vision_tower.", "multi_modal_projector.", "image_newline")


class LlavaEncoder(nn.Module):
    """Pixels -> projected image features, exactly as ``LlavaModel.get_image_features`` (one feature layer or
    several concatenated; ``default`` drops the CLS position, ``full`` keeps it)."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        self.feature_layer = hf_config.vision_feature_layer
        self.select_strategy = hf_config.vision_feature_select_strategy
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        total = hf_config.vision_config.num_hidden_layers
        self.feature_index = [i if i >= 0 else total + 1 + i for i in layers]
        """The selected layers as indices of the tower's hidden states (0: the embeddings, k: after layer k)."""

    def drop_unused_layers(self) -> None:
        """Remove the tower's layers after the last selected one (LLaVA reads the second-to-last layer by
        default): their outputs are never read, so the features are unchanged and the encoder runs fewer
        layers (vLLM builds its towers the same way)."""
        tower = getattr(self.vision_tower, "vision_model", self.vision_tower)
        encoder = getattr(tower, "encoder", None)
        layers = getattr(encoder, "layers", None)
        if isinstance(layers, nn.ModuleList) and max(self.feature_index) < len(layers):
            encoder.layers = layers[: max(self.feature_index)]

    @torch.inference_mode()
    def encode(self, pixels: list[dict[str, Tensor]]) -> list[Tensor]:
        """One ``[tokens, hidden]`` feature tensor per image (``pixel_values`` [3, H, W] each), in one batch."""
        dtype = next(self.parameters()).dtype
        device = next(self.parameters()).device
        batch = torch.stack([p["pixel_values"] for p in pixels]).to(device=device, dtype=dtype)
        return list(self.project(batch))

    def project(self, batch: Tensor) -> Tensor:
        """[N, 3, H, W] pixels -> [N, tokens, hidden] projected features of the selected layer(s)."""
        out = self.vision_tower(batch, output_hidden_states=True, return_dict=True)
        hs = [out.hidden_states[i] for i in self.feature_index]
        if self.select_strategy == "default":
            hs = [h[:, 1:] for h in hs]
        return self.multi_modal_projector(hs[0] if len(hs) == 1 else torch.cat(hs, dim=-1))


class LlavaNextEncoder(LlavaEncoder):
    """LLaVA-NeXT: every crop of every image through the tower in one batch, then transformers'
    ``LlavaNextModel.pack_image_features`` per image (exactly ``LlavaNextModel.get_image_features``)."""

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        self.config = hf_config  # read by pack_image_features
        self.image_newline = nn.Parameter(torch.zeros(hf_config.text_config.hidden_size))

    @torch.inference_mode()
    def encode(self, pixels: list[dict[str, Tensor]]) -> list[Tensor]:
        from transformers.models.llava_next.modeling_llava_next import (
            LlavaNextModel,
            image_size_to_num_patches,
        )

        cfg = self.config
        dtype = next(self.parameters()).dtype
        device = next(self.parameters()).device
        sizes = [p["image_sizes"] for p in pixels]
        counts = [
            image_size_to_num_patches(
                image_size=s, grid_pinpoints=cfg.image_grid_pinpoints, patch_size=cfg.vision_config.image_size
            )
            for s in sizes
        ]
        batch = torch.cat([p["pixel_values"][:n] for p, n in zip(pixels, counts)]).to(
            device=device, dtype=dtype
        )
        feats = torch.split(self.project(batch), counts, dim=0)
        packed, _ = LlavaNextModel.pack_image_features(
            self, feats, torch.stack(sizes), self.select_strategy, image_newline=self.image_newline
        )
        return list(packed)


def load(ckpt: Path, config: ModelConfig, dtype, device) -> nn.Module:
    """The LLaVA checkpoint in ``ckpt``: native language model (``config``: its text config), vision encoder
    from transformers' classes, both in the language model's dtype on ``device``."""
    from transformers import AutoConfig

    from batchgen.models.loader import load_native_model
    from batchgen.models.vision import ImageTextModel, load_vision_weights

    language_model = load_native_model(ckpt, config, dtype=dtype, device=device)
    hf = AutoConfig.from_pretrained(str(ckpt))
    encoder = (
        LlavaNextEncoder(hf)
        if config.architecture == "LlavaNextForConditionalGeneration"
        else LlavaEncoder(hf)
    )
    # transformers 4.x names (under model.) and 5.x names (ours already)
    prefixes = _PREFIXES + tuple((ours, ours) for ours in _OURS)
    load_vision_weights(encoder, ckpt, prefixes, ignore_missing=("position_ids",))
    encoder.drop_unused_layers()
    lm_dtype = next(language_model.parameters()).dtype
    encoder = encoder.to(device=device, dtype=lm_dtype).eval().requires_grad_(False)
    image_token_id = int(
        json.loads((ckpt / "config.json").read_text()).get("image_token_index", hf.image_token_id)
    )
    return ImageTextModel(language_model, encoder, image_token_id, cache_bytes=1 << 30)
