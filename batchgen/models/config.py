"""`ModelConfig`: the architecture facts our decoder needs, parsed from a Hugging Face checkpoint.

Reads `config.json` (transformers 4.x keys `rope_theta`/`rope_scaling`/`torch_dtype` and 5.x keys
`rope_parameters`/`dtype` alike) and `generation_config.json` (eos ids). Only the Llama family is
supported; anything else fails here with a `ValueError` that lists what is supported.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Hugging Face architecture name -> model_type.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

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


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one checkpoint.

    Invariants: `num_heads % num_kv_heads == 0`; `head_dim` is even (RoPE rotates halves);
    `rope_type` is one of `SUPPORTED_ROPE_TYPES` and `rope_scaling` holds its parameters
    (`factor`, and for llama3 `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).

    `sliding_window` is set only when the checkpoint really uses windowed attention (Mistral with a
    window, Qwen2/3 with `use_sliding_window`). Our attention is always full attention, which is exact
    for sequences of at most `sliding_window` tokens (a query sees the last `sliding_window` keys,
    itself included): the engine must cap its max_model_len at `max_model_len`.
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
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def max_model_len(self) -> int:
        """Longest sequence this implementation computes exactly (see `sliding_window`)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (+ `path/generation_config.json` when present)."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
        config = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(config, generation, source=str(config_file))

    @classmethod
    def from_dict(
        cls,
        config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        *,
        source: str = "config.json",
    ) -> ModelConfig:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            if not archs and config.get("model_type") in by_type:
                arch = by_type[config["model_type"]]
            else:
                found = ", ".join(archs) or f"model_type={config.get('model_type')!r}"
                raise ValueError(
                    f"unsupported architecture {found} in {source}; supported: "
                    + ", ".join(SUPPORTED_ARCHITECTURES)
                )
        model_type = SUPPORTED_ARCHITECTURES[arch]

        act = config.get("hidden_act", config.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} in {source}: only 'silu' (SwiGLU) is supported")
        hidden = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} not a multiple of num_key_value_heads {num_kv_heads}"
            )
        if head_dim % 2:
            raise ValueError(f"head_dim {head_dim} must be even for RoPE")
        max_pos = int(config.get("max_position_embeddings", 2048))
        rope_theta, rope_type, rope_scaling = _parse_rope(config, max_pos, source)

        attention_bias = bool(config.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v bias, never o_proj bias
        elif model_type == "mistral":
            qkv_bias = o_bias = False
        else:  # llama, qwen3: attention_bias covers q, k, v and o
            qkv_bias = o_bias = attention_bias
        mlp_bias = bool(config.get("mlp_bias", False)) if model_type == "llama" else False

        dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
        dtype = parse_dtype(dtype_name)

        eos = _eos_list((generation_config or {}).get("eos_token_id"))
        eos += [e for e in _eos_list(config.get("eos_token_id")) if e not in eos]

        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=_effective_sliding_window(config, model_type),
            dtype=dtype,
            eos_token_ids=tuple(eos),
            bos_token_id=config.get("bos_token_id"),
            pad_token_id=config.get("pad_token_id"),
        )


def _parse_rope(config: dict[str, Any], max_pos: int, source: str) -> tuple[float, str, dict[str, Any]]:
    """(rope_theta, rope_type, scaling params) from 5.x `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"cannot parse RoPE parameters {params!r} in {source}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported ({source})")
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported ({source})")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE type {rope_type!r} in {source}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), rope_type, {}
    if "factor" not in params:
        raise ValueError(f"RoPE type {rope_type!r} needs a 'factor' ({source})")
    scaling: dict[str, Any] = {"factor": float(params["factor"])}
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"RoPE type 'llama3' needs {key!r} ({source})")
            scaling[key] = float(params[key])
        orig = config.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings"
        )
        scaling["original_max_position_embeddings"] = int(orig or max_pos)
    return float(theta), rope_type, scaling


def _effective_sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    window = config.get("sliding_window")
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return None
        layer_types = config.get("layer_types")
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        if layer_types is None and int(config.get("max_window_layers", 0)) >= int(
            config["num_hidden_layers"]
        ):
            return None
    elif model_type == "llama":
        return None  # Llama has no sliding window
    window = int(window)
    return window if window > 0 and not math.isinf(window) else None
