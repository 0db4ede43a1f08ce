"""`ModelConfig`: the architecture facts our native decoders need, parsed from a Hugging Face checkpoint.

`config.json` is read through transformers' own configuration class for its `model_type` (never remote code),
so every legacy spelling the class accepts (`rope_scaling`/`rope_theta` vs `rope_parameters`, `torch_dtype` vs
`dtype`, Gemma 3's `rope_local_base_freq`, derived `layer_types`...) is normalised exactly as transformers
normalises it; then the facts are copied into a frozen dataclass. `generation_config.json` adds eos ids.

Architectures with a native implementation are listed in `NATIVE_ARCHITECTURES`. A checkpoint our native code
cannot run exactly (another architecture, an activation, a data-dependent RoPE...) raises
`NativeUnsupportedError` (a `ValueError`) saying why; `load_model(..., implementation="auto")` then uses the
transformers backend instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Image-text architectures whose vision side runs on transformers' own modeling code before a native language
# model (batchgen.models.vision_transformers): architecture -> the model_type of its `text_config`.
TRANSFORMERS_VISION: dict[str, str] = {
    "VipLlavaForConditionalGeneration": "llama",
    "Idefics2ForConditionalGeneration": "mistral",
    "LightOnOcrForConditionalGeneration": "qwen3",
    "DeepseekVLForConditionalGeneration": "llama",
    "DeepseekVLHybridForConditionalGeneration": "llama",
    "JanusForConditionalGeneration": "llama",
    "GotOcr2ForConditionalGeneration": "qwen2",
}
# Image-text architectures whose language model has no native implementation: the whole model runs on
# transformers' modeling code, the language model over batchgen's paged attention
# (batchgen.models.vision_transformers_lm) -> the model_type of its `text_config`.
TRANSFORMERS_LM_VISION: dict[str, str] = {
    "AyaVisionForConditionalGeneration": "cohere2",
    "AriaForConditionalGeneration": "aria_text",
    "Blip2ForConditionalGeneration": "opt",
    "QianfanOCRForConditionalGeneration": "qwen3",
}
# Image-text architectures with a native language model that also run whole on transformers' modeling code
# (batchgen.models.vision_transformers_lm) when model.implementation=transformers: plain causal attention and
# 1-D positions (not Gemma 3's bidirectional image attention, not Qwen2-VL's M-RoPE).
TRANSFORMERS_IMAGE_TEXT_OPTIONAL = frozenset(
    {"LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration", "Idefics3ForConditionalGeneration"}
    | set(TRANSFORMERS_VISION)
)


def runs_whole_on_transformers(
    architectures: list[str], implementation: str, config: dict[str, Any] | None = None
) -> bool:
    """Whether a checkpoint of ``architectures`` (``config``: its config.json) loads as an image-text model on
    transformers' modeling code (batchgen.models.vision_transformers_lm) for ``implementation``: always with
    ``transformers``; with ``auto`` when its language model has no native implementation (an architecture
    that never has one, or one whose ``text_config`` names a family batchgen does not run)."""
    archs = set(architectures)
    optional = bool(archs & TRANSFORMERS_IMAGE_TEXT_OPTIONAL)
    if implementation != "native" and (
        archs & set(TRANSFORMERS_LM_VISION) or (optional and foreign_text_model(config) is not None)
    ):
        return True
    return implementation == "transformers" and optional


def foreign_text_model(config: dict[str, Any] | None) -> str | None:
    """The ``model_type`` its ``text_config`` names when batchgen has no native implementation of that family
    (LLaVA over Phi); None when it runs the family natively or the config names none."""
    declared = ((config or {}).get("text_config") or {}).get("model_type")
    return declared if declared and declared not in CAUSAL_ARCHITECTURE_OF_TYPE else None


# Hugging Face architecture name -> model_type, for every architecture with a native implementation.
NATIVE_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GraniteForCausalLM": "granite",
    "Gemma3ForConditionalGeneration": "gemma3_text",  # with its vision encoder (batchgen.models.vision_gemma3)
    "LlavaForConditionalGeneration": "llama",  # with its vision encoder (batchgen.models.vision_llava)
    "LlavaNextForConditionalGeneration": "llama",
    "Qwen2VLForConditionalGeneration": "qwen2",  # with its vision encoder (batchgen.models.vision_qwen2)
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Idefics3ForConditionalGeneration": "llama",  # with its vision encoder (batchgen.models.vision_idefics3)
    **TRANSFORMERS_VISION,
}
# Vision-language checkpoints whose language model we run natively (text only): architecture -> model_type of
# the `text_config`. Their vision tower and projector weights are skipped.
NATIVE_TEXT_OF_MULTIMODAL: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "LlavaForConditionalGeneration": "llama",
    "LlavaNextForConditionalGeneration": "llama",
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Idefics3ForConditionalGeneration": "llama",
    **TRANSFORMERS_VISION,
}
# Vision-language architectures whose images batchgen runs (batchgen.models.vision): architecture -> loader
# module (its ``load(ckpt, config, dtype, device)``).
IMAGE_TEXT_ARCHITECTURES: dict[str, str] = {
    "LlavaForConditionalGeneration": "batchgen.models.vision_llava",
    "LlavaNextForConditionalGeneration": "batchgen.models.vision_llava",
    "Qwen2VLForConditionalGeneration": "batchgen.models.vision_qwen2",
    "Qwen2_5_VLForConditionalGeneration": "batchgen.models.vision_qwen2",
    "Idefics3ForConditionalGeneration": "batchgen.models.vision_idefics3",
    "Gemma3ForConditionalGeneration": "batchgen.models.vision_gemma3",
    **{a: "batchgen.models.vision_transformers" for a in TRANSFORMERS_VISION},
    **{a: "batchgen.models.vision_transformers_lm" for a in TRANSFORMERS_LM_VISION},
}
IMAGE_FAMILIES = (
    "LLaVA 1.5, LLaVA-NeXT, VipLLaVA, Qwen2-VL, Qwen2.5-VL, Idefics2, Idefics3/SmolVLM, Gemma 3, DeepSeek-VL "
    "(and its hybrid), Janus, GOT-OCR2, LightOnOCR, Aya Vision, BLIP-2, Aria, "
    "Qianfan-OCR"
)


def is_image_text_name(architecture: str) -> bool:
    """Whether ``architecture`` is named as transformers names image-text (or other conditional) models, or is
    an image-text model refused by name (:data:`batchgen.models.image_refusals.REFUSED`)."""
    from batchgen.models.image_refusals import REFUSED

    suffixes = ("ForConditionalGeneration", "ForImageTextToText", "VLForCausalLM", "Text2Text")
    return architecture.endswith(suffixes) or architecture in REFUSED


def no_images_reason(architecture: str, config: dict[str, Any] | None = None) -> str:
    """Why a model of ``architecture`` takes no images here (one line, naming what does); ``config``: its
    ``config.json`` when known (it may name the reason)."""
    if architecture in IMAGE_TEXT_ARCHITECTURES:  # loaded without its vision side
        return (
            f"{architecture}: its images run on batchgen's native implementation on one device; this engine "
            "runs its language model only (tensor parallelism or the transformers backend): set "
            "engine.tensor_parallel_size=1 and model.implementation auto or native, or send text only"
        )
    if is_image_text_name(architecture):
        from batchgen.models.image_refusals import refusal_reason

        return (
            f"{architecture}: batchgen does not run this architecture's images "
            f"({refusal_reason(architecture, config)}); it runs those of {IMAGE_FAMILIES}: use such a "
            "checkpoint, or send text only"
        )
    return f"this model ({architecture}) takes no images; use an image-text checkpoint ({IMAGE_FAMILIES})"


def unrunnable_image_text(
    architectures: list[str], source: str, config: dict[str, Any] | None = None
) -> str | None:
    """The one-line refusal of loading an image-text checkpoint that batchgen runs neither with its images nor
    as a text model (Mllama, PaliGemma...: transformers has no causal LM of the checkpoint's architecture):
    the architecture, why its images do not run and what does; None when no architecture is image-text."""
    arch = next(
        (a for a in architectures if is_image_text_name(a) and a not in IMAGE_TEXT_ARCHITECTURES), None
    )
    if arch is None:
        return None
    from batchgen.models.image_refusals import refusal_reason

    return (
        f"{arch} ({source}): batchgen runs neither this architecture's images ({refusal_reason(arch, config)}) "
        f"nor its language model alone; it runs the images of {IMAGE_FAMILIES}: use such a checkpoint"
    )


# model_type -> the causal-LM architecture that runs it (a checkpoint naming no native architecture: a bare
# backbone, a classifier, or none at all); never a vision-language one.
CAUSAL_ARCHITECTURE_OF_TYPE: dict[str, str] = {
    t: a for a, t in NATIVE_ARCHITECTURES.items() if a not in NATIVE_TEXT_OF_MULTIMODAL
}
# RoPE types whose frequencies do not depend on the batch (dynamic NTK rescales with the longest sequence).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


class NativeUnsupportedError(ValueError):
    """The checkpoint has no exact native implementation here (the transformers backend may still run it)."""

    def for_native_only(self) -> NativeUnsupportedError:
        """The error for a caller who asked for ``implementation=native``: says how to run it anyway."""
        return NativeUnsupportedError(
            f"{self}. Use model.implementation=transformers (or auto) to run it with transformers' "
            "modeling code over batchgen's engine"
        )


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """'float32' / 'bfloat16' / 'float16' (also 'torch.float16', 'bf16', ...) or a torch.dtype."""
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {value}: use float32, bfloat16 or float16")
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
    return _DTYPES[key]


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(config: dict[str, Any] | Any, generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    """generation_config's eos ids first, then config's (a dict or a transformers config), deduplicated."""
    eos = _eos_list((generation_config or {}).get("eos_token_id"))
    cfg_eos = (
        config.get("eos_token_id") if isinstance(config, dict) else getattr(config, "eos_token_id", None)
    )
    eos += [e for e in _eos_list(cfg_eos) if e not in eos]
    return tuple(eos)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type, with its inverse frequencies precomputed by transformers' own
    RoPE functions (float32 values, exactly representable as Python floats).

    `rotary_dim` (even, <= head_dim) leading channels of each head rotate (partial rotary when smaller).
    `long_inv_freq` (longrope only): used instead for a sequence longer than `original_max_position_embeddings`
    (transformers picks by the forward's longest sequence; we pick per sequence, the same for one sequence).
    """

    rope_type: str
    theta: float
    rotary_dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)
    long_inv_freq: tuple[float, ...] | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class MoESpec:
    """Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), top-k routing as transformers does it:
    softmax over all experts in float32, top-k, renormalised when `renormalize` (Mixtral always, Qwen when
    `norm_topk_prob`), weights cast back to the model dtype unless `fp32_weights` (Mixtral keeps float32).
    `sparse_layers[i]` says whether layer i is sparse (others use a dense MLP of `intermediate_size`).
    Qwen2-MoE adds a shared expert of `shared_expert_intermediate_size` gated by sigmoid(shared_expert_gate(x)).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    fp32_weights: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0


class ContextFacts:
    """The context limits the engine reads, derived from the fields ``max_position_embeddings`` and
    ``layer_windows`` (one window or None per layer) of the config class using it."""

    @property
    def max_model_len(self) -> int:
        """The model's full context (sliding windows are attended for real, so they do not cap it)."""
        return self.max_position_embeddings  # type: ignore[attr-defined]

    @property
    def sliding_window(self) -> int | None:
        """The largest per-layer window, None when some layer (or every layer) attends to everything."""
        windows = self.layer_windows or (None,)  # type: ignore[attr-defined]
        return None if any(w is None for w in windows) else max(windows)  # type: ignore[type-var]


@dataclass(frozen=True)
class ModelConfig(ContextFacts):
    """Architecture of one checkpoint, as our native decoder (`batchgen.models.llama.CausalLM`) runs it.

    Invariants: `num_heads % num_kv_heads == 0`; `len(layer_windows) == num_layers`; a layer's window `w`
    means a query at position p sees keys at positions > p - w (transformers' convention), None is full
    attention. Windows never cap `max_model_len`: the attention kernels honour them.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    local_rope: RopeSpec | None = None  # sliding-window layers' RoPE when it differs (Gemma 3)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    layer_windows: tuple[int | None, ...] = ()
    sliding_layers: tuple[bool, ...] = ()  # layers of type "sliding_attention" (they use `local_rope`)
    hidden_act: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    gemma_norm: bool = False  # RMSNorm scales by (1 + weight), in float32, then casts (Gemma)
    sandwich_norm: bool = False  # post-attention and pre/post-feedforward norms (Gemma 2/3)
    embed_scale: float | None = None  # embeddings multiplied by this, rounded to the dtype (Gemma)
    embedding_multiplier: float = 1.0  # Granite's multipliers
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    fused_checkpoint: bool = False  # checkpoint already stores qkv_proj / gate_up_proj (Phi-3)
    multimodal: bool = False  # a vision-language checkpoint: its language model's weights, vision skipped
    moe: MoESpec | None = None
    dtype: torch.dtype = torch.float32  # the activations' (batchgen.models.quant.weight_dtype)
    weight_dtype: torch.dtype | None = None  # the projections' and embedding's in memory (None: `dtype`)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    tp_rank: int = 0  # tensor parallelism: this rank's shard (`batchgen.models.parallel.shard_config`)
    tp_size: int = 1  # 1: the whole model; N: head/intermediate/vocab sizes above are one rank's share

    implementation = "native"

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rope_type(self) -> str:
        return self.rope.rope_type

    @property
    def rope_scaling(self) -> dict[str, Any]:
        return self.rope.params

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (+ `path/generation_config.json` when present); a successful parse is
        cached on disk (`batchgen.models.config_cache`), so later runs need not import transformers."""
        from batchgen.models.config_cache import cached_parse

        config, generation = read_config_files(path)
        source = str(Path(path) / "config.json")
        if cls is not ModelConfig:
            return cls.from_dict(config, generation, source=source)
        return cached_parse(config, generation, lambda: cls.from_dict(config, generation, source=source))

    @classmethod
    def from_dict(
        cls,
        config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        *,
        source: str = "config.json",
    ) -> ModelConfig:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in NATIVE_ARCHITECTURES), None)
        if arch is None:
            if not archs and config.get("model_type") in CAUSAL_ARCHITECTURE_OF_TYPE:
                arch = CAUSAL_ARCHITECTURE_OF_TYPE[config["model_type"]]
            else:
                found = ", ".join(archs) or f"model_type={config.get('model_type')!r}"
                raise NativeUnsupportedError(
                    f"unsupported architecture {found} in {source} for the native implementation; native: "
                    + ", ".join(NATIVE_ARCHITECTURES)
                )
        model_type = NATIVE_ARCHITECTURES[arch]
        if arch in NATIVE_TEXT_OF_MULTIMODAL:  # the language model of a vision-language checkpoint
            foreign = foreign_text_model(config) if arch in TRANSFORMERS_IMAGE_TEXT_OPTIONAL else None
            if foreign is not None:
                raise NativeUnsupportedError(
                    f"{source}: the language model of {arch} is {foreign!r}, which has no native "
                    "implementation; model.implementation=auto or transformers runs it on transformers' "
                    "modeling code"
                )
            text = _text_config(config)
            model_type = text_model_type(text, model_type)
            if "tie_word_embeddings" in config:
                text["tie_word_embeddings"] = config["tie_word_embeddings"]
            for key in ("dtype", "torch_dtype", "eos_token_id", "bos_token_id", "pad_token_id"):
                if key not in text and config.get(key) is not None:
                    text[key] = config[key]
            hf = hf_config_from_dict({**text, "model_type": model_type}, source)
            return dataclasses.replace(
                cls.from_hf(hf, arch, generation_config, source=source, model_type=model_type),
                multimodal=True,
            )
        hf = hf_config_from_dict({**config, "model_type": model_type}, source)
        return cls.from_hf(hf, arch, generation_config, source=source)

    @classmethod
    def from_hf(
        cls,
        hf: Any,
        arch: str,
        generation_config: dict[str, Any] | None = None,
        *,
        source: str = "config.json",
        model_type: str | None = None,
    ) -> ModelConfig:
        """Facts from a transformers config object of a native architecture (``model_type``: the family of
        an image-text checkpoint's language model, when it is not the architecture's usual one)."""
        model_type = model_type or NATIVE_ARCHITECTURES[arch]
        act = _activation(hf, model_type, source)
        if getattr(hf, "use_bidirectional_attention", None):
            raise NativeUnsupportedError(f"{source}: bidirectional attention is not a causal LM")
        hidden, num_heads, num_kv_heads, head_dim = _attention_shape(hf)
        num_layers = int(hf.num_hidden_layers)
        max_pos = int(getattr(hf, "max_position_embeddings", None) or 2048)
        layer_types = _layer_types(hf, source)
        rope, local_rope = _rope_specs(hf, head_dim, source)
        windows = _layer_windows(hf, model_type, num_layers, layer_types, max_pos)
        qkv_bias, o_bias, mlp_bias = _biases(hf, model_type)
        gemma = model_type in _GEMMA
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(hf.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(hf.intermediate_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=rope,
            local_rope=local_rope,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            layer_windows=windows,
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types) or (False,) * num_layers,
            hidden_act=act,
            attn_scale=_attn_scale(hf, model_type),
            attn_softcap=_opt_float(getattr(hf, "attn_logit_softcapping", None)),
            final_softcap=_opt_float(getattr(hf, "final_logit_softcapping", None)),
            gemma_norm=gemma,
            sandwich_norm=model_type in ("gemma2", "gemma3_text"),
            embed_scale=hidden**0.5 if gemma else None,
            embedding_multiplier=float(getattr(hf, "embedding_multiplier", 1.0) or 1.0),
            residual_multiplier=float(getattr(hf, "residual_multiplier", 1.0) or 1.0),
            logits_scaling=float(getattr(hf, "logits_scaling", 1.0) or 1.0),
            fused_checkpoint=model_type == "phi3",
            moe=_moe_spec(hf, model_type, num_layers) if model_type in _MOE else None,
            dtype=parse_dtype(dtype),
            eos_token_ids=eos_token_ids(hf, generation_config),
            bos_token_id=getattr(hf, "bos_token_id", None),
            pad_token_id=getattr(hf, "pad_token_id", None),
        )


def text_model_type(text: dict[str, Any], default: str) -> str:
    """The native family of an image-text checkpoint's language model: its ``text_config``'s ``model_type``
    when batchgen runs that family natively (LLaVA over Qwen2, LLaVA-NeXT over Mistral), else ``default``, the
    architecture's usual one (a text config naming no type, or a family-specific one such as
    ``qwen2_vl_text``)."""
    declared = text.get("model_type")
    return declared if declared in CAUSAL_ARCHITECTURE_OF_TYPE else default


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's language model part: its ``text_config``, or the top level of a flat
    layout (Qwen2-VL's first releases). Multimodal RoPE (``mrope``, ``mrope_section``) has the default RoPE's
    frequencies; the sections are read by its image-text model (:mod:`batchgen.models.vision_qwen2`)."""
    text = dict(config.get("text_config") or {k: v for k, v in config.items() if k != "vision_config"})
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and (
            "mrope" in (rope.get("rope_type"), rope.get("type")) or "mrope_section" in rope
        ):
            text[key] = {k: v for k, v in rope.items() if k not in ("type", "mrope_section")}
            text[key]["rope_type"] = "default"
    return text


def _activation(hf: Any, model_type: str, source: str) -> str:
    """The MLP activation name (Gemma 2/3 read ``hidden_activation``, other families ``hidden_act``)."""
    act_key = "hidden_activation" if model_type in ("gemma2", "gemma3_text") else "hidden_act"
    act = getattr(hf, act_key, None) or "silu"
    from transformers.activations import ACT2FN

    if act not in ACT2FN:
        raise NativeUnsupportedError(f"unknown hidden_act {act!r} in {source}")
    return act


def _attention_shape(hf: Any) -> tuple[int, int, int, int]:
    """``(hidden, num_heads, num_kv_heads, head_dim)``; the KV heads must divide the query heads."""
    hidden = int(hf.hidden_size)
    num_heads = int(hf.num_attention_heads)
    num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf, "head_dim", None) or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads {num_heads} not a multiple of num_key_value_heads {num_kv_heads}"
        )
    return hidden, num_heads, num_kv_heads, head_dim


def _layer_types(hf: Any, source: str) -> list[str]:
    """``layer_types`` (empty when the config has none); each one full or sliding attention."""
    layer_types = list(getattr(hf, "layer_types", None) or [])
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise NativeUnsupportedError(f"layer types {unknown} in {source} are not supported natively")
    return layer_types


def _rope_specs(hf: Any, head_dim: int, source: str) -> tuple[Any, Any]:
    """``(rope, local_rope)``: ``local_rope`` is the sliding layers' rope where it differs from the others'."""
    rope_params = hf.rope_parameters or {}
    per_type = bool(rope_params) and all(isinstance(v, dict) for v in rope_params.values())
    if per_type:
        rope = _rope_spec(hf, head_dim, "full_attention", source)
        local_rope = (
            _rope_spec(hf, head_dim, "sliding_attention", source)
            if "sliding_attention" in rope_params
            else None
        )
    else:
        rope, local_rope = _rope_spec(hf, head_dim, None, source), None
    return rope, (None if local_rope == rope else local_rope)


def _biases(hf: Any, model_type: str) -> tuple[bool, bool, bool]:
    """``(qkv_bias, o_bias, mlp_bias)`` as each family reads them."""
    attention_bias = bool(getattr(hf, "attention_bias", False))
    if model_type in ("qwen2", "qwen2_moe"):
        qkv_bias, o_bias = bool(getattr(hf, "qkv_bias", True)), False  # q/k/v bias, never o_proj
    elif model_type in ("mistral", "mixtral", "phi3"):
        qkv_bias = o_bias = False
    else:  # llama, qwen3(-moe), gemma*, granite: attention_bias covers q, k, v and o
        qkv_bias = o_bias = attention_bias
    mlp_bias = bool(getattr(hf, "mlp_bias", False)) if model_type in ("llama", "granite") else False
    return qkv_bias, o_bias, mlp_bias


def _attn_scale(hf: Any, model_type: str) -> float | None:
    """The attention logit scale where a family sets its own (None: the default)."""
    if model_type in ("gemma2", "gemma3_text"):
        return float(hf.query_pre_attn_scalar) ** -0.5
    if model_type == "granite":
        return float(hf.attention_multiplier)
    return None


def read_config_files(path: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`config.json` and (when present) `generation_config.json` of a checkpoint directory, as dicts."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
    config = json.loads(config_file.read_text())
    gen_file = path / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return config, generation


def hf_config_from_dict(config: dict[str, Any], source: str = "config.json") -> Any:
    """transformers' configuration object for `config['model_type']` (built-in classes only, no remote code)."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        hint = (
            " (it names remote code in auto_map, which batchgen never runs)" if config.get("auto_map") else ""
        )
        raise ValueError(f"model_type {model_type!r} in {source} is unknown to transformers{hint}")
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    return CONFIG_MAPPING[model_type].from_dict(kwargs)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _layer_windows(
    hf: Any, model_type: str, num_layers: int, layer_types: list[str], max_pos: int
) -> tuple[int | None, ...]:
    """Per-layer sliding windows exactly where transformers' attention uses one."""
    window = getattr(hf, "sliding_window", None)
    if model_type in ("llama", "granite", "gemma") or window is None:
        return (None,) * num_layers
    window = int(window)
    if window <= 0 or math.isinf(window) or window >= max_pos:
        return (None,) * num_layers
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        return (None,) * num_layers  # no layer_types: only with use_sliding_window, handled by the class
    return (window,) * num_layers  # mistral, mixtral, phi3: every layer


def _rope_spec(hf: Any, head_dim: int, layer_type: str | None, source: str) -> RopeSpec:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(hf.rope_parameters[layer_type] if layer_type else hf.rope_parameters)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NativeUnsupportedError(
            f"RoPE type {rope_type!r} in {source} is not supported natively "
            f"(native: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    theta = float(params["rope_theta"])
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise NativeUnsupportedError(f"rotary dimension {rotary_dim} must be even and positive ({source})")
    long_inv_freq = original_max = None
    if rope_type == "default":
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float)
        inv_freq, attention_scaling = 1.0 / (theta ** (steps / rotary_dim)), 1.0
    else:
        fn = ROPE_INIT_FUNCTIONS[rope_type]
        kwargs = {"layer_type": layer_type} if layer_type else {}
        inv_freq, attention_scaling = fn(hf, None, **kwargs)
        if rope_type == "longrope":
            original_max = int(params["original_max_position_embeddings"])
            long, _ = fn(hf, None, seq_len=original_max + 1, **kwargs)
            long_inv_freq = tuple(float(x) for x in long.float())
    if inv_freq.numel() * 2 != rotary_dim:
        raise NativeUnsupportedError(f"RoPE {rope_type!r} of {source}: unexpected frequency count")
    shown = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    return RopeSpec(
        rope_type=rope_type,
        theta=theta,
        rotary_dim=rotary_dim,
        inv_freq=tuple(float(x) for x in inv_freq.float()),
        attention_scaling=float(attention_scaling),
        params=shown,
        long_inv_freq=long_inv_freq,
        original_max_position_embeddings=original_max,
    )


def _moe_spec(hf: Any, model_type: str, num_layers: int) -> MoESpec:
    num_experts = int(getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", 0))
    if model_type == "mixtral":
        return MoESpec(
            num_experts=num_experts,
            top_k=int(hf.num_experts_per_tok),
            intermediate_size=int(hf.intermediate_size),
            renormalize=True,
            fp32_weights=True,
            sparse_layers=(True,) * num_layers,
        )
    mlp_only = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    sparse = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoESpec(
        num_experts=num_experts,
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        renormalize=bool(getattr(hf, "norm_topk_prob", False)),
        fp32_weights=False,
        sparse_layers=sparse,
        shared_expert_intermediate_size=(
            int(hf.shared_expert_intermediate_size) if model_type == "qwen2_moe" else 0
        ),
    )
