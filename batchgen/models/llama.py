"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in plain torch over the paged KV cache.

Batches are packed: `forward(input_ids[T], positions[T], ctx)` with no padding; attention goes through
`ctx.attn.forward(...)`, which stores the new K/V in their slots and attends through the block tables.

Numerics follow transformers op for op (RMSNorm in float32 then cast back before the weight, RoPE
inverse frequencies and cos/sin computed in float32 from the positions, residual adds in the model
dtype), so float32 outputs match `transformers` to rounding. Q/K/V and gate/up projections are fused
into one matmul each (`qkv_proj`, `gate_up_proj`); the loader fuses the checkpoint's separate tensors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.models.config import ModelConfig

if TYPE_CHECKING:
    from batchgen.engine.attention import ForwardContext


class RMSNorm(nn.Module):
    """`weight * (x / sqrt(mean(x^2) + eps))`, normalised in float32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [head_dim/2] in float32, computed exactly like transformers' RoPE init functions."""
    dim = config.head_dim
    base = config.rope_theta
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float)
    inv_freq = 1.0 / (base ** (steps / dim))
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_scaling["factor"]
    elif config.rope_type == "llama3":
        s = config.rope_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin [T, head_dim] for the given positions (halves duplicated, as transformers lays them out).

    `inv_freq` is a plain float32 attribute, not a buffer: `model.to(dtype)` / meta-device construction
    must never round or drop it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(config)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (_rotate_half(x) * sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: ForwardContext) -> Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv = ctx.kv_cache[self.layer_idx]
        out = ctx.attn.forward(q, k, v.contiguous(), kv[0], kv[1], ctx.meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: ForwardContext) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Decoder-only LM. Parameter names mirror Hugging Face's (`model.layers.N...`, `lm_head`) except the
    fused `qkv_proj` / `gate_up_proj`. With tied embeddings `lm_head.weight` *is* `model.embed_tokens.weight`.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions [T] int64 (packed batch) -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        return self.lm_head(hidden).float()


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)
