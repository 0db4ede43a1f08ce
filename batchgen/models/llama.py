"""Native decoders in plain torch over the paged KV cache: one configurable `CausalLM` for the Llama family
(Llama, Mistral, Qwen2, Qwen3, Granite), Phi-3, the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) and
Gemma 1/2/3 — everything a `ModelConfig` describes.

Batches are packed: `forward(input_ids[T], positions[T], ctx)` with no padding; attention goes through
`ctx.attn.forward(...)`, which stores the new K/V in their slots and attends through the block tables. Each
layer passes its own `AttentionOptions` to the kernels: its scale, `sliding_window` (its window, when it has
one) and `softcap` (attention-logit soft-capping, Gemma 2).

Numerics follow transformers op for op (RMSNorm in float32 then cast back before the weight — or, for Gemma,
scaled by `1 + weight` in float32 then cast; RoPE inverse frequencies from transformers' own RoPE functions and
cos/sin computed in float32 from the positions; residual adds in the model dtype), so float32 outputs match
`transformers` to rounding. Q/K/V and gate/up projections are fused into one matmul each (`qkv_proj`,
`gate_up_proj`); the loader fuses the checkpoint's separate tensors, then packs float32 CPU projections for oneDNN
(`batchgen.models.packed_linear`). Per forward, RoPE's cos/sin are computed once for all layers, Q and
K are normed and rotated as one tensor, and temporaries are updated in place (same ops, same rounding).

Tensor parallelism (`config.tp_size > 1`, see `batchgen.models.parallel`): the config carries one rank's head
and intermediate sizes, so the modules here are that rank's shard; `DecoderLayer` all-reduces the attention and
MLP outputs, and the embedding / LM head are vocabulary-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from batchgen.attention import AttentionOptions, KVScales
from batchgen.kernels import cpu_ops
from batchgen.models import parallel
from batchgen.models.config import ModelConfig, RopeSpec
from batchgen.models.moe import SparseMoE, activation

if TYPE_CHECKING:
    from batchgen.attention import ForwardContext


class RMSNorm(nn.Module):
    """`weight * (x / sqrt(mean(x^2) + eps))`, normalised in float32 and cast back before the weight; with
    `gemma=True` it is `(x / sqrt(...)) * (1 + weight)` in float32, then cast (transformers' Gemma norms)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.gemma)


def rms_norm(x: Tensor, weight: Tensor, eps: float, gemma: bool) -> Tensor:
    """RMSNorm of `x` over its last dim with `weight` (broadcast against `x`: [D], or [H, D] for per-head
    weights); transformers' ops in transformers' order, with the temporaries updated in place (float32 on the
    CPU: one C pass, `kernels/cpu_ops.py`)."""
    out = cpu_ops.rms_norm(x, weight, eps, gemma)
    if out is not None:
        return out
    dtype = x.dtype
    h = x.float()
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if gemma:
        return h.mul_(1.0 + weight.float()).to(dtype)
    return weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [rotary_dim/2] (float32) of the model's (global) RoPE."""
    return torch.tensor(config.rope.inv_freq, dtype=torch.float32, device="cpu")


class RotaryEmbedding(nn.Module):
    """cos/sin [T, rotary_dim] for the given positions (halves duplicated, as transformers lays them out),
    multiplied by the RoPE's attention scaling (YaRN, LongRoPE).

    `inv_freq` is a plain float32 attribute, not a buffer: `model.to(dtype)` / meta-device construction
    must never round or drop it.
    """

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        # explicit CPU device: the model may be built under a meta-device context
        self.inv_freq = torch.tensor(spec.inv_freq, dtype=torch.float32, device="cpu")
        self.long_inv_freq = (
            torch.tensor(spec.long_inv_freq, dtype=torch.float32, device="cpu")
            if spec.long_inv_freq is not None
            else None
        )
        self.section_of: Tensor | None = None
        """Multimodal RoPE: each frequency's row of ``[S, T]`` positions (:meth:`set_sections`)."""

    def set_sections(self, sections: list[int]) -> None:
        """Multimodal RoPE: the first ``sections[0]`` frequencies follow position row 0, the next
        ``sections[1]`` row 1, ... (transformers' ``mrope_section``)."""
        if sum(sections) != self.inv_freq.numel():
            raise ValueError(f"mrope_section {sections} must add up to {self.inv_freq.numel()} frequencies")
        self.section_of = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))

    def forward(
        self, positions: Tensor, dtype: torch.dtype, long: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """`positions` [T], or [S, T] for multimodal RoPE (`set_sections`). `long` [T] bool (LongRoPE only):
        tokens of sequences longer than the original context."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            if self.long_inv_freq is not None:
                self.long_inv_freq = self.long_inv_freq.to(positions.device)
        inv_freq = self.inv_freq
        if long is not None and self.long_inv_freq is not None and bool(long.any()):
            inv_freq = torch.where(long[:, None], self.long_inv_freq, self.inv_freq)
        if positions.dim() == 2:  # multimodal RoPE: [S, T], frequency i rotated by positions[section_of[i]]
            freqs = positions.float()[self.section_of.to(positions.device)].T * inv_freq
        else:
            freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.spec.attention_scaling != 1.0:
            cos, sin = cos * self.spec.attention_scaling, sin * self.spec.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin [T, R] -> (cos [T, 1, R], sin [T, 1, R] with its first half negated), computed once per forward
    and shared by every layer: with the sign folded into `sin`, `apply_rope` needs no negation."""
    half = sin.shape[-1] // 2
    return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D]; cos/sin [T, 1, R] from `rope_tables`, R <= D: the first R channels rotate, the rest pass
    through. Bit for bit transformers' `x * cos + rotate_half(x) * sin` (negating a factor is exact)."""
    out = cpu_ops.rope(x, cos, sin)
    if out is not None:
        return out
    rot = cos.shape[-1]
    half = rot // 2
    if rot == x.shape[-1]:
        out = x * cos
        return out.add_(torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin))
    x_rot = x[..., :rot]
    out = x_rot * cos
    out.add_(torch.cat((x_rot[..., half:], x_rot[..., :half]), dim=-1).mul_(sin))
    return torch.cat((out, x[..., rot:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.scale
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, config.gemma_norm)
            self.k_norm: RMSNorm | None = RMSNorm(config.head_dim, config.rms_norm_eps, config.gemma_norm)
        else:
            self.q_norm = self.k_norm = None
        self.kv_scales: KVScales | None = None  # a checkpoint's fp8 KV-cache scales (set by the loader)
        # How this layer attends; a layer without a window or soft-capping calls the plain kernel.
        window = config.layer_windows[layer_idx] if config.layer_windows else None
        softcap = config.attn_softcap
        self.attn_options = AttentionOptions(
            config.scale,
            sliding_window=None if window is None else int(window),
            softcap=None if softcap is None else float(softcap),
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: ForwardContext) -> Tensor:
        """x [T, hidden]; cos/sin from `rope_tables`. Q and K are normed and rotated together, as one
        [T, Hq + Hkv, D] tensor (they are adjacent in `qkv_proj`'s output); V stays a view of that output."""
        t, nq, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, nq + nkv, d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, nkv, d)
        if self.q_norm is not None:  # one norm over all heads, each with its own (q or k) weight
            weight = torch.cat((self.q_norm.weight.expand(nq, d), self.k_norm.weight.expand(nkv, d)))
            qk = rms_norm(qk, weight, self.q_norm.eps, self.q_norm.gemma)
        qk = apply_rope(qk, cos, sin)
        kv = ctx.kv_cache[self.layer_idx]
        out = ctx.attn.forward(
            qk[:, :nq], qk[:, nq:], v, kv[0], kv[1], ctx.meta, self.attn_options, self.kv_scales
        )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up fused (SwiGLU, GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        h = cpu_ops.silu_mul(gate_up) if type(self.act) is nn.SiLU else None
        if h is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            h = self.act(gate).mul_(up)
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps, gemma = config.rms_norm_eps, config.gemma_norm
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        self.sandwich = config.sandwich_norm
        if self.sandwich:  # Gemma 2/3: norms after attention and around the MLP
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, gemma)
        moe = config.moe
        if moe is not None and moe.sparse_layers[layer_idx]:
            self.mlp: nn.Module = SparseMoE(config, moe)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.residual_multiplier = config.residual_multiplier
        self.config = config  # tensor parallelism: o_proj / down_proj outputs are partial sums
        self.local = bool(config.sliding_layers[layer_idx]) if config.sliding_layers else False

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: ForwardContext) -> Tensor:
        """x [T, hidden] (updated in place: the residual stream is this forward's own tensor)."""
        h = parallel.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, ctx), self.config)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
        if self.residual_multiplier != 1.0:
            h.mul_(self.residual_multiplier)
        if self.sandwich:
            x.add_(h)
            h = parallel.all_reduce(self.mlp(self.pre_feedforward_layernorm(x)), self.config)
            h = self.post_feedforward_layernorm(h)
        else:
            h = parallel.all_reduce(self.mlp(add_rms_norm(x, h, self.post_attention_layernorm)), self.config)
        return x.add_(h.mul_(self.residual_multiplier) if self.residual_multiplier != 1.0 else h)


def add_rms_norm(x: Tensor, h: Tensor, norm: RMSNorm) -> Tensor:
    """`x += h` in place, then `norm(x)` (float32 on the CPU: one C pass for both)."""
    out = cpu_ops.rms_norm(x, norm.weight, norm.eps, norm.gemma, add=h)
    if out is not None:
        return out
    x.add_(h)
    return norm(x)


class CausalLM(nn.Module):
    """Decoder-only LM. Parameter names mirror Hugging Face's (`model.layers.N...`, `lm_head`) except the
    fused `qkv_proj` / `gate_up_proj` and the stacked experts (`mlp.experts.gate_up_proj [E, 2I, H]`,
    `mlp.experts.down_proj [E, H, I]`). With tied embeddings `lm_head.weight` *is* `model.embed_tokens.weight`.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = parallel.lm_head(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions [T] int64 (packed batch) -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (scaled / soft-capped as the model says,
        in the model dtype, like transformers)."""
        logits = self.lm_head(hidden)
        c = self.config
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return parallel.gather_logits(logits, c).float()


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = parallel.embedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma_norm)
        self.rotary_emb = RotaryEmbedding(config.rope)
        self.local_rotary_emb = RotaryEmbedding(config.local_rope) if config.local_rope is not None else None

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings [T, hidden], scaled as the model says (what image features are placed among)."""
        c = self.config
        x = self.embed_tokens(input_ids).to(c.dtype)  # a narrow table widens its rows (quant.weight_dtype)
        if (
            c.embed_scale is not None
        ):  # float32, then the dtype, as transformers rounds it (sqrt(3072) -> 55.5)
            x = x * torch.tensor(c.embed_scale, dtype=torch.float32, device=x.device).to(x.dtype)
        if c.embedding_multiplier != 1.0:
            x = x * c.embedding_multiplier
        return x

    def forward(
        self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext, inputs_embeds: Tensor | None = None
    ) -> Tensor:
        """``inputs_embeds`` [T, hidden]: the input vectors themselves (``input_ids`` unused), e.g. token
        embeddings with image features placed at the image's positions."""
        c = self.config
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        long = _long_rope_tokens(c, ctx) if c.rope.long_inv_freq is not None else None
        cos, sin = rope_tables(*self.rotary_emb(positions, x.dtype, long))
        local = (
            rope_tables(*self.local_rotary_emb(positions, x.dtype))
            if self.local_rotary_emb is not None
            else None
        )
        for layer in self.layers:
            if layer.local and local is not None:
                x = layer(x, local[0], local[1], ctx)
            else:
                x = layer(x, cos, sin, ctx)
        return self.norm(x)


def _long_rope_tokens(config: ModelConfig, ctx: ForwardContext) -> Tensor:
    """[T] bool: tokens whose sequence is longer than LongRoPE's original context after this forward."""
    meta = ctx.meta
    q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()
    long_seq = meta.seq_lens.long() > int(config.rope.original_max_position_embeddings or 0)
    return torch.repeat_interleave(long_seq, q_lens)
