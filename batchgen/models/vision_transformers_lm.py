"""Image-text checkpoints whose language model has no native implementation: the whole model runs on
transformers' own modeling code, its language model over batchgen's paged attention (the image-text
counterpart of ``model.implementation=transformers``, :mod:`batchgen.models.transformers_backend`).

The checkpoint loads as transformers' image-text model (``AutoModelForImageTextToText``; remote code never
runs). Its vision side (``get_image_features``: tower, resampler or Q-Former, projector) runs outside the KV
cache in batches of images (:class:`TransformersImageEncoder`); its text model (the module the image-text
model calls with ``inputs_embeds``) runs each packed step with attention dispatched to the paged cache, the
image features in place of the embeddings of the image's placeholder tokens, exactly as the image-text
model's forward places them. Logits come from the image-text model's own forward with the text model replaced
by a stub that returns the step's hidden states, so every head-side option (Aya Vision's ``logit_scale``)
applies as transformers applies it. Prefix caching, the encoder cache and image keys are
:class:`~batchgen.models.vision.ImageTextModel`'s.

Checks before the engine runs: the load-time probe of the transformers backend over the text model (every
attention call causal, with the options the kernels apply; one KV shape), and the backbone/head split
reproducing the image-text model's own text-only logits. Used for
:data:`batchgen.models.config.TRANSFORMERS_LM_VISION`, each tested for greedy equality with transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchgen.models.config import eos_token_ids, parse_dtype, read_config_files
from batchgen.models.transformers_backend import (
    ATTENTION_STATE,
    ATTN_IMPLEMENTATION,
    PROBE_IMPLEMENTATION,
    PROBE_MASKS,
    HiddenStates,
    LayerAttention,
    PagedState,
    ProbeState,
    TransformersModelConfig,
    UnsupportedModelError,
    no_cache_kwargs,
    probe_attention,
    register_attention,
)
from batchgen.models.vision import ImageTextModel
from batchgen.models.vision_transformers import TransformersImageEncoder, feature_rows


class PerImageEncoder(TransformersImageEncoder):
    """:class:`TransformersImageEncoder` whose calls take each image's features from the model's own split when
    ``get_image_features`` returns one tensor per image (LLaVA-NeXT's: the token count of an image depends on
    its aspect ratio, not only on its tensors' shapes), else an even split of the call's rows."""

    def _split(self, feats: Any, n: int) -> list[Tensor]:
        if isinstance(feats, (list, tuple)) and len(feats) == n:
            return [f.reshape(-1, f.shape[-1]) for f in feats]
        return super()._split(feats, n)


FLAT_TILES = frozenset({"AyaVisionForConditionalGeneration", "QianfanOCRForConditionalGeneration"})
"""Architectures whose processor flattens every image's tiles into the batch axis (:class:`FlatPatchEncoder`):
Aya Vision's, Qianfan-OCR's (the ``GotOcr2ImageProcessor``'s crops to patches)."""


class FlatPatchEncoder(PerImageEncoder):
    """The image encoder for processors that flatten every image's tiles into one batch axis
    (``pixel_values [tiles, C, H, W]`` per image, Aya Vision's): a call takes the tiles of several images
    concatenated, and each image's features are its tiles' rows, in order."""

    @torch.inference_mode()
    def encode(self, pixels: list[dict[str, Tensor]]) -> list[Tensor]:
        # an image of one tile comes without the tile axis (the processor's batch row)
        values = [
            p["pixel_values"] if p["pixel_values"].dim() == 4 else p["pixel_values"][None] for p in pixels
        ]
        groups: dict[tuple, list[int]] = {}
        for i, v in enumerate(values):
            groups.setdefault(tuple(v.shape[1:]), []).append(i)
        out: list[Tensor] = [None] * len(pixels)  # type: ignore[list-item]
        for members in groups.values():
            tiles = [values[i].shape[0] for i in members]
            flat = feature_rows(self._raw({"pixel_values": torch.cat([values[i] for i in members])}))
            per_tile = flat.shape[0] // sum(tiles)
            for i, f in zip(members, flat.split([n * per_tile for n in tiles])):
                out[i] = f
        return out


@dataclasses.dataclass
class _Split:
    """Where the text model sits in the image-text model: ``owner``'s forward (taking ``inputs_embeds``) runs
    ``parent.<attr>`` (the text model) and then the head."""

    owner: nn.Module
    parent: nn.Module
    attr: str

    @property
    def text_model(self) -> nn.Module:
        return getattr(self.parent, self.attr)


def _split(hf: nn.Module, source: str) -> _Split:
    """The text model and the head's owner of ``hf``: a base model's ``language_model`` under the image-text
    model's head (LLaVA-style), or a whole causal LM as ``language_model`` (BLIP-2's), its base model inside."""
    lm = getattr(hf, "language_model", None)
    if isinstance(lm, nn.Module) and getattr(lm, "base_model_prefix", "") and hasattr(lm, "lm_head"):
        return _Split(lm, lm, lm.base_model_prefix)
    base = getattr(hf, hf.base_model_prefix, None)
    for attr in ("language_model", "text_model"):  # Idefics2/3 name it text_model
        if isinstance(getattr(base, attr, None), nn.Module):
            return _Split(hf, base, attr)
    raise UnsupportedModelError(f"{type(hf).__name__} ({source}): no language_model module found")


class TransformersTextModel(nn.Module):
    """The image-text model's text model behind the native decoder's calling convention (``embed(ids)``;
    ``forward(input_ids, positions, ctx, inputs_embeds=None) -> hidden [T, H]``), attention on the paged
    cache."""

    def __init__(self, text_model: nn.Module, layers: dict[int, LayerAttention]) -> None:
        super().__init__()
        self.text_model = text_model
        self._layers = layers
        self._kwargs = no_cache_kwargs(text_model)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.text_model.get_input_embeddings()(input_ids)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: Any, inputs_embeds: Tensor | None = None):
        token = ATTENTION_STATE.set(PagedState(ctx, self._layers))
        try:
            inputs = (
                {"input_ids": input_ids[None]}
                if inputs_embeds is None
                else {"inputs_embeds": inputs_embeds[None]}
            )
            out = self.text_model(position_ids=positions[None], **inputs, **self._kwargs)
        finally:
            ATTENTION_STATE.reset(token)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden[0]


class TransformersImageTextLM(nn.Module):
    """The language side for :class:`~batchgen.models.vision.ImageTextModel`: ``model`` (the text model on
    the paged cache), ``compute_logits`` (the image-text model's own head), ``config``."""

    def __init__(self, split: _Split, text: TransformersTextModel, config: TransformersModelConfig) -> None:
        super().__init__()
        self.model = text
        self.config = config
        self._owner = split.owner
        self._stub = HiddenStates()
        setattr(split.parent, split.attr, self._stub)
        self._head_kwargs = no_cache_kwargs(split.owner)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size], through the model's own head."""
        self._stub.hidden = hidden[None]
        try:
            out = self._owner(inputs_embeds=hidden[None], **self._head_kwargs)
        finally:
            self._stub.hidden = None
        return out.logits[0].float()


@torch.inference_mode()
def load(ckpt: Path, config: Any = None, dtype: torch.dtype | str = "auto", device: Any = "cpu") -> nn.Module:
    """The image-text checkpoint in ``ckpt`` on transformers' modeling code, its text model over the paged
    cache (``config``: unused, the checkpoint is read through transformers' own config class)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from batchgen.models.loader import safetensors_files

    ckpt = Path(ckpt)
    source = str(ckpt / "config.json")
    safetensors_files(ckpt)  # refuses pickle-only checkpoints with the usual message
    hf_config = AutoConfig.from_pretrained(str(ckpt), local_files_only=True, trust_remote_code=False)
    text_cfg = hf_config.get_text_config()
    if isinstance(dtype, str) and dtype.lower() == "auto":
        dtype = parse_dtype(
            getattr(text_cfg, "dtype", None) or getattr(hf_config, "dtype", None) or "float32"
        )
    else:
        dtype = parse_dtype(dtype)
    register_attention()
    hf = AutoModelForImageTextToText.from_pretrained(
        str(ckpt), dtype=dtype, local_files_only=True, trust_remote_code=False, use_safetensors=True
    )
    hf = hf.to(torch.device(device)).eval().requires_grad_(False)
    split = _split(hf, source)
    text_model = split.text_model
    text_cfg = text_model.config
    text_cfg.use_cache = False  # KV lives in batchgen's paged cache
    probe_config, layers = probe_attention(
        text_model, text_cfg, source, dtype
    )  # leaves the text model on paged attention
    _, generation = read_config_files(ckpt)
    probe_config = dataclasses.replace(
        probe_config,
        architecture=type(hf).__name__,
        eos_token_ids=eos_token_ids(text_cfg, generation),
    )
    text = TransformersTextModel(text_model, layers)
    reference = _text_logits(split, text_model, text_cfg.vocab_size, source)
    language_model = TransformersImageTextLM(split, text, probe_config)
    _check_head_split(language_model, reference, source)
    raw: dict[str, Any] = json.loads((ckpt / "config.json").read_text())
    token = raw.get("image_token_index", raw.get("image_token_id"))
    if token is None:
        raise UnsupportedModelError(f"{type(hf).__name__} ({source}) names no image token id")
    vision = hf if hasattr(hf, "get_image_features") else getattr(hf, hf.base_model_prefix)  # DeepSeek-VL's
    encoder = FlatPatchEncoder(vision) if type(hf).__name__ in FLAT_TILES else PerImageEncoder(vision)
    return ImageTextModel(language_model, encoder, int(token), cache_bytes=1 << 30)


_PROBE_IDS = 6


def _probe_ids(vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
    ids = (torch.arange(_PROBE_IDS, device=device) * 7 + 3) % max(vocab, 1)
    return ids, torch.arange(_PROBE_IDS, device=device)


def _text_logits(split: _Split, text_model: nn.Module, vocab: int, source: str) -> Tensor:
    """The image-text model's own logits for a few text tokens (plain reference attention)."""
    ids, pos = _probe_ids(vocab, next(text_model.parameters()).device)
    token = ATTENTION_STATE.set(ProbeState())
    text_model.config._attn_implementation = PROBE_IMPLEMENTATION
    try:
        embeds = text_model.get_input_embeddings()(ids)[None]
        return split.owner(inputs_embeds=embeds, position_ids=pos[None], use_cache=False).logits[0].float()
    except Exception as e:
        raise UnsupportedModelError(
            f"{type(split.owner).__name__} ({source}) cannot run its text forward: {type(e).__name__}: {e}"
        ) from e
    finally:
        ATTENTION_STATE.reset(token)
        text_model.config._attn_implementation = ATTN_IMPLEMENTATION
        PROBE_MASKS.clear()


def _check_head_split(model: TransformersImageTextLM, reference: Tensor, source: str) -> None:
    """Text model then head (the stub) must give the image-text model's own logits."""
    text_model = model.model.text_model
    ids, pos = _probe_ids(model.config.vocab_size, reference.device)
    token = ATTENTION_STATE.set(ProbeState())
    text_model.config._attn_implementation = PROBE_IMPLEMENTATION
    try:
        out = text_model(input_ids=ids[None], position_ids=pos[None], **model.model._kwargs)
        hidden = (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])[0]
        logits = model.compute_logits(hidden)
    finally:
        ATTENTION_STATE.reset(token)
        text_model.config._attn_implementation = ATTN_IMPLEMENTATION
        PROBE_MASKS.clear()
    if logits.shape != reference.shape or not torch.allclose(logits, reference, atol=1e-3, rtol=1e-3):
        raise UnsupportedModelError(
            f"{model.config.architecture} ({source}): its head does more than map the text model's hidden "
            "states to logits, so batchgen cannot split it"
        )
