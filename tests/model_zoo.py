"""Tiny random-weight checkpoints of many architectures, built offline from transformers' own config classes.

`checkpoint(arch, **overrides) -> str` builds (once per process, memoised by arguments) a directory with
config.json, generation_config.json, model.safetensors and a small byte-level BPE tokenizer (vocab 512),
in a temporary root removed at exit. `ARCHS` lists the architecture keys; `overrides` go to the config class
(e.g. `sliding_window=8`), plus `seed`. Sizes are tiny (hidden 64, 2 layers, 4 query / 2 KV heads, head 16)
and `initializer_range` 0.08 so greedy outputs do not collapse; norm weights and biases are perturbed so a
model that forgets one is noticed. `gemma_like(arch)` tells whether norms are `(1 + weight)`-style.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import transformers

from batchgen.models.tiny import build_random_checkpoint, special_token_kwargs

VOCAB = 512
INIT = 0.08
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=INIT,
    tie_word_embeddings=False,
)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# arch key -> (config class, causal-LM class, config kwargs on top of _COMMON; None removes a common key)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": _ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"rope_parameters": _ROPE, "sliding_window": 8}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"rope_parameters": _ROPE, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": _ROPE}),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "rope_parameters": {**_ROPE, "partial_rotary_factor": 0.5},
            "sliding_window": 12,
            "original_max_position_embeddings": 256,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"rope_parameters": _ROPE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "rope_parameters": _ROPE,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [1],
            "head_dim": None,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "rope_parameters": _ROPE,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
        },
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"rope_parameters": _ROPE}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "rope_parameters": _ROPE,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,  # small, so capping really changes scores and logits
            "final_logit_softcapping": 1.5,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 2.0,
        },
    ),
    "gemma3": (  # the vision-language checkpoint layout (Gemma 3 4B and up); text-only generation
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "rope_parameters": _ROPE,
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.6,
            "attention_multiplier": 0.15,
            "logits_scaling": 0.5,
        },
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"rope_parameters": _ROPE, "head_dim": None}),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {
            "rope_parameters": {**_ROPE, "partial_rotary_factor": 0.25},
            "num_key_value_heads": None,
            "head_dim": None,
            "use_parallel_residual": True,
            "hidden_act": "gelu",
        },
    ),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        {"rope_parameters": _ROPE, "sliding_window": 8, "head_dim": None, "use_bias": True},
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "rope_parameters": _ROPE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}
GEMMA_LIKE = ("gemma", "gemma2", "gemma3_text", "gemma3")

_lock = threading.Lock()
_built: dict[str, str] = {}
_root: Path | None = None


def _tmp_root() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="batchgen-zoo-"))
        atexit.register(shutil.rmtree, _root, True)
    return _root


def _config(arch: str, ids: dict[str, int], overrides: dict[str, Any]):
    cfg_name, _, extra = ARCHS[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("sliding_window",)}
    if arch == "gpt2":  # GPT-2 spells the sizes its own way
        kwargs = dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            initializer_range=INIT,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **overrides,
        )
    kwargs.update(special_token_kwargs(ids))
    if arch == "gemma3":  # sizes go to the text config; a minimal vision tower beside it
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        return transformers.Gemma3Config(
            text_config=kwargs,
            vision_config=dict(vision, image_size=28, patch_size=14),
            mm_tokens_per_image=4,
        )
    return getattr(transformers, cfg_name)(**kwargs)


def build(
    out_dir: str | Path, arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> str:
    """Build the checkpoint into `out_dir` (see the module doc) and return its path."""
    gemma = arch in GEMMA_LIKE

    def perturb(model: torch.nn.Module) -> None:  # biases and norm weights away from their 0 / 1 init
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if param.dim() == 1 and leaf == "bias":
                param.normal_(0.0, INIT)
            elif param.dim() == 1 and ("norm" in name or ".ln" in name or name.startswith("ln")):
                param.normal_(0.0 if gemma else 1.0, 0.1)

    return build_random_checkpoint(
        out_dir,
        lambda ids: _config(arch, ids, overrides),
        ARCHS[arch][1],
        vocab_size=VOCAB,
        seed=seed,
        dtype=dtype,
        init=perturb,
        do_sample=False,
    )


def checkpoint(arch: str, **kwargs) -> str:
    """Memoised `build` into a per-process temporary root (identical arguments -> the same directory)."""
    key = json.dumps({"arch": arch, **kwargs}, sort_keys=True, default=str)
    with _lock:
        if key not in _built:
            _built[key] = build(_tmp_root() / f"{arch}-{len(_built)}", arch, **kwargs)
        return _built[key]
