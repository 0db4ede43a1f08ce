"""Native decoders vs transformers (float32, CPU): prefill and paged decode logits, greedy argmax, RoPE (incl.
YaRN, LongRoPE), sliding windows beyond the window, config parsing of every native family."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.attention import AttentionMetadata, ForwardContext, PagedAttention
from batchgen.models import NATIVE_ARCHITECTURES, ModelConfig, NativeUnsupportedError, load_model
from batchgen.models.llama import rope_inv_freq

BLOCK_SIZE = 4
NUM_BLOCKS = 24
PROMPT_LEN = 13  # not a multiple of BLOCK_SIZE: the last prompt block is partial
DECODE_STEPS = 8
ATOL = 1e-4  # observed max |diff| ~1e-6 for logits of magnitude ~3

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so all three frequency bands occur at head_dim 16-32
}
LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0}

VARIANTS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"seed": 1}),
    "qwen2": ("qwen2", {"seed": 2}),
    "qwen3": ("qwen3", {"seed": 3}),
    "llama-llama3rope-tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True, "seed": 4}),
    "llama-linearrope-headdim32": ("llama", {"rope_scaling": LINEAR_ROPE, "head_dim": 32, "seed": 5}),
    "llama-bias-theta": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "rope_theta": 500000.0, "seed": 6},
    ),
    "mistral-mqa": ("mistral", {"num_kv_heads": 1, "seed": 7}),
    "qwen2-tied-headdim32": ("qwen2", {"tie_word_embeddings": True, "head_dim": 32, "seed": 8}),
    "qwen3-bias-linearrope-mqa": (
        "qwen3",
        {"attention_bias": True, "rope_scaling": LINEAR_ROPE, "num_kv_heads": 1, "seed": 9},
    ),
}


def hf_step(hf, ids: torch.Tensor, cache=None) -> tuple[torch.Tensor, object]:
    """One transformers forward with its KV cache -> (float32 logits [T, V], cache).

    transformers 5.x renamed `past_key_values` to `cache` (argument and output); support both.
    """
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    kwargs = {key: cache} if cache is not None else {}
    out = hf(ids[None], use_cache=True, **kwargs)
    return out.logits[0].float(), getattr(out, key)


def make_meta(seqs: list[tuple[list[int], int, int]], num_decode_seqs: int) -> AttentionMetadata:
    """seqs: (block_table, num_cached_tokens, num_new_tokens) per sequence, decodes first."""
    return AttentionMetadata.for_sequences(seqs, num_decode_seqs, BLOCK_SIZE)


def new_kv_cache(model) -> torch.Tensor:
    c = model.config
    return torch.zeros(c.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype=c.dtype)


def shuffled_table(seed: int, n: int = NUM_BLOCKS) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


@pytest.fixture(scope="module")
def models(ckpt_factory):
    """variant name -> (our model, transformers model), both float32, built lazily."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            arch, kwargs = VARIANTS[name]
            path = ckpt_factory(arch, **kwargs)
            hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
            cache[name] = (load_model(path), hf.eval())
        return cache[name]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.inference_mode()
def test_logits_match_transformers_prefill_and_decode(models, variant):
    ours, hf = models(variant)
    cfg = ours.config
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    attn, kv, table = PagedAttention("torch"), new_kv_cache(ours), shuffled_table(0)

    ref, cache = hf_step(hf, prompt)
    meta = make_meta([(table, 0, PROMPT_LEN)], num_decode_seqs=0)
    logits = ours.compute_logits(ours(prompt, torch.arange(PROMPT_LEN), ForwardContext(attn, meta, kv)))
    assert logits.dtype == torch.float32 and logits.shape == (PROMPT_LEN, cfg.vocab_size)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))

    token = int(ref[-1].argmax())
    for step in range(DECODE_STEPS):
        pos = PROMPT_LEN + step
        ref, cache = hf_step(hf, torch.tensor([token]), cache)
        ref = ref[-1]
        meta = make_meta([(table, pos, 1)], num_decode_seqs=1)
        hidden = ours(torch.tensor([token]), torch.tensor([pos]), ForwardContext(attn, meta, kv))
        logits = ours.compute_logits(hidden)[0]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=f"decode step {step}")
        assert int(logits.argmax()) == int(ref.argmax())
        token = int(ref.argmax())


@torch.inference_mode()
def test_packed_mixed_batch_matches_single_sequence(models):
    """Decode + chunked-prefill sequences packed in one forward give the same logits as alone."""
    ours, _ = models("qwen3")
    attn = PagedAttention("torch")
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, ours.config.vocab_size, (9,), generator=gen)
    b = torch.randint(0, ours.config.vocab_size, (11,), generator=gen)

    def alone(tokens):
        kv = new_kv_cache(ours)
        meta = make_meta([(shuffled_table(5, 6), 0, len(tokens))], 0)
        return ours.compute_logits(ours(tokens, torch.arange(len(tokens)), ForwardContext(attn, meta, kv)))

    ref_a, ref_b = alone(a), alone(b)
    kv = new_kv_cache(ours)
    perm = shuffled_table(6)
    ta, tb = perm[:6], perm[6:12]
    # step 1: a prefills 8 tokens, b prefills its first chunk of 5
    meta = make_meta([(ta, 0, 8), (tb, 0, 5)], 0)
    ids, pos = torch.cat([a[:8], b[:5]]), torch.cat([torch.arange(8), torch.arange(5)])
    l1 = ours.compute_logits(ours(ids, pos, ForwardContext(attn, meta, kv)))
    # step 2: a decodes its 9th token (decodes first), b prefills its remaining 6 tokens
    meta = make_meta([(ta, 8, 1), (tb, 5, 6)], 1)
    ids, pos = torch.cat([a[8:], b[5:]]), torch.cat([torch.tensor([8]), torch.arange(5, 11)])
    l2 = ours.compute_logits(ours(ids, pos, ForwardContext(attn, meta, kv)))
    torch.testing.assert_close(torch.cat([l1[:8], l2[:1]]), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([l1[8:], l2[1:]]), ref_b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "llama-llama3rope-tied", "llama-linearrope-headdim32"])
def test_rope_inv_freq_identical_to_transformers(models, variant):
    ours, hf = models(variant)
    assert torch.equal(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq.float())
    if variant != "llama":  # the scaled variants really differ from plain RoPE
        plain, _ = models("llama")
        assert not torch.equal(ours.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)


@torch.inference_mode()
def test_bfloat16_weights_equal_transformers_widened(models, ckpt_factory):
    path = ckpt_factory("qwen2", seed=2)
    ours = load_model(path, dtype="bfloat16")  # bfloat16 weights, float32 arithmetic on the CPU
    assert (ours.config.weight_dtype, ours.config.dtype) == (torch.bfloat16, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16)
    hf = hf.float().eval()  # the same rounded weights, widened
    prompt = torch.randint(
        0, ours.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)
    )
    meta = make_meta([(shuffled_table(1), 0, PROMPT_LEN)], 0)
    ctx = ForwardContext(PagedAttention("torch"), meta, new_kv_cache(ours))
    logits = ours.compute_logits(ours(prompt, torch.arange(PROMPT_LEN), ctx))
    torch.testing.assert_close(logits, hf(prompt[None]).logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma2", "mixtral", "phi3"])
@torch.inference_mode()
def test_bfloat16_weights_equal_transformers_widened_new_families(arch):
    import model_zoo

    path = model_zoo.checkpoint(arch)
    ours = load_model(path, dtype="bfloat16")
    assert torch.bfloat16 in {p.dtype for p in ours.parameters()}
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16)
    hf = hf.float().eval()
    prompt = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    meta = make_meta([(shuffled_table(1), 0, PROMPT_LEN)], 0)
    ctx = ForwardContext(PagedAttention("torch"), meta, new_kv_cache(ours))
    logits = ours.compute_logits(ours(prompt, torch.arange(PROMPT_LEN), ctx))
    torch.testing.assert_close(logits, hf(prompt[None]).logits[0], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_mistral_sliding_window_attended_beyond_the_window(ckpt_factory):
    """The window is attended for real: 40 tokens through a 16-token window match transformers everywhere, and
    max_model_len is the model's context, not the window."""
    path = ckpt_factory("mistral", sliding_window=16, seed=13)
    ours = load_model(path)
    assert ours.config.layer_windows == (16, 16) and ours.config.max_model_len == 2048
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    prompt = torch.randint(0, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    meta = make_meta([(shuffled_table(2, 10), 0, 40)], 0)
    attn = PagedAttention("torch")
    ctx = ForwardContext(attn, meta, new_kv_cache(ours))
    logits = ours.compute_logits(ours(prompt, torch.arange(40), ctx))
    torch.testing.assert_close(logits, hf_step(hf, prompt)[0], atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------- config parsing
def _hf4_llama(**over):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
        "eos_token_id": 2,
        "hidden_act": "silu",
    }
    cfg.update(over)
    return cfg


def test_config_transformers4_keys():
    c = ModelConfig.from_dict(
        _hf4_llama(rope_scaling={"type": "linear", "factor": 4.0}), {"eos_token_id": [7, 2]}
    )
    assert (c.rope_theta, c.rope_type, c.rope_scaling) == (500000.0, "linear", {"factor": 4.0})
    assert c.dtype == torch.bfloat16
    assert c.eos_token_ids == (7, 2)
    assert (c.num_kv_heads, c.head_dim, c.q_size, c.kv_size) == (2, 16, 64, 32)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    c = ModelConfig.from_dict(_hf4_llama(rope_scaling=llama3, eos_token_id=[128001, 128009]))
    assert c.rope_type == "llama3" and c.rope_scaling["original_max_position_embeddings"] == 8192
    assert c.eos_token_ids == (128001, 128009)


def test_config_transformers5_keys_and_eos_union(qwen3_ckpt):
    c = ModelConfig.from_pretrained(qwen3_ckpt)
    raw = json.loads((Path(qwen3_ckpt) / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_theta" not in raw
    assert (c.architecture, c.model_type, c.qk_norm, c.qkv_bias) == ("Qwen3ForCausalLM", "qwen3", True, False)
    assert c.rope_theta == 10000.0 and c.rope_type == "default"
    assert c.eos_token_ids == (2, 4)  # generation_config [2, 4] then config's 2 (already present)
    assert c.dtype == torch.float32
    c = ModelConfig.from_dict(_hf4_llama(eos_token_id=5), {"eos_token_id": 9})
    assert c.eos_token_ids == (9, 5)


def test_config_biases_per_architecture():
    q2 = ModelConfig.from_dict(_hf4_llama(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert (q2.qkv_bias, q2.o_bias, q2.qk_norm) == (True, False, False)
    ll = ModelConfig.from_dict(_hf4_llama(attention_bias=True, mlp_bias=True))
    assert (ll.qkv_bias, ll.o_bias, ll.mlp_bias) == (True, True, True)
    q3 = ModelConfig.from_dict(_hf4_llama(architectures=["Qwen3ForCausalLM"], head_dim=128))
    assert (q3.qk_norm, q3.qkv_bias, q3.head_dim) == (True, False, 128)


def test_config_sliding_window():
    mistral = _hf4_llama(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=1024)
    c = ModelConfig.from_dict(mistral)
    assert c.max_model_len == 4096 and c.layer_windows == (1024, 1024)
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).layer_windows == (None, None)
    qwen2 = _hf4_llama(architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=False)
    assert ModelConfig.from_dict(qwen2).sliding_window is None
    on = {**qwen2, "use_sliding_window": True, "max_window_layers": 0}
    assert ModelConfig.from_dict(on).layer_windows == (1024, 1024)
    # Qwen2's max_window_layers: layers from that index on slide (as transformers' layer_types says)
    assert ModelConfig.from_dict({**on, "max_window_layers": 1}).layer_windows == (None, 1024)


def test_config_rejects_unsupported():
    with pytest.raises(NativeUnsupportedError, match="unsupported architecture GPT2LMHeadModel") as e:
        ModelConfig.from_dict(_hf4_llama(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    for arch in NATIVE_ARCHITECTURES:
        assert arch in str(e.value)
    with pytest.raises(NativeUnsupportedError, match="RoPE type 'dynamic' .* not supported natively"):
        ModelConfig.from_dict(_hf4_llama(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with pytest.raises(NativeUnsupportedError, match="hidden_act"):
        ModelConfig.from_dict(_hf4_llama(hidden_act="no_such_activation"))


def test_config_new_families():
    gemma3 = {  # a transformers 4.x Gemma 3 config.json: rope_local_base_freq, sliding_window_pattern
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 100,
        "query_pre_attn_scalar": 24,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    g = ModelConfig.from_dict(gemma3)
    assert g.layer_windows == (512,) * 5 + (None, 512) and g.sliding_layers == (True,) * 5 + (False, True)
    assert (g.rope.rope_type, g.rope.theta, g.rope.params["factor"]) == ("linear", 1e6, 8.0)
    assert (g.local_rope.rope_type, g.local_rope.theta) == ("default", 1e4)
    assert g.scale == 24**-0.5 and g.gemma_norm and g.sandwich_norm and g.qk_norm and g.embed_scale == 8.0
    phi = _hf4_llama(architectures=["Phi3ForCausalLM"], model_type="phi3", partial_rotary_factor=0.75)
    p = ModelConfig.from_dict(phi)
    assert p.rope.rotary_dim == 12 and p.fused_checkpoint and len(p.rope.inv_freq) == 6
    mixtral = _hf4_llama(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2)
    m = ModelConfig.from_dict(mixtral)
    assert (m.moe.num_experts, m.moe.top_k, m.moe.renormalize, m.moe.fp32_weights) == (8, 2, True, True)
    qmoe = _hf4_llama(
        architectures=["Qwen2MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    )
    q = ModelConfig.from_dict(qmoe)
    assert q.moe.sparse_layers == (False, True) and q.moe.shared_expert_intermediate_size == 48
    assert q.qkv_bias and not q.moe.renormalize
    granite = _hf4_llama(
        architectures=["GraniteForCausalLM"],
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
    )
    gr = ModelConfig.from_dict(granite)
    assert (gr.embedding_multiplier, gr.residual_multiplier, gr.scale, gr.logits_scaling) == (
        12.0,
        0.22,
        0.0078125,
        8.0,
    )


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}},
    ],
)
def test_rope_frequencies_from_transformers(rope):
    """inv_freq and the cos/sin scaling come from transformers' own RoPE functions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _hf4_llama(rope_scaling=rope, max_position_embeddings=256)
    ours = ModelConfig.from_dict(cfg)
    ref_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    inv, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](ref_cfg, None)
    assert torch.equal(rope_inv_freq(ours), inv.float()) and ours.rope.attention_scaling == scaling


@torch.inference_mode()
def test_phi3_longrope_switches_like_transformers():
    """LongRoPE: short factors while a sequence fits the original context, long ones beyond (per sequence)."""
    import model_zoo

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 4.0, 8.0, 16.0],
        "original_max_position_embeddings": 16,
    }
    path = model_zoo.checkpoint("phi3", rope_parameters=rope, sliding_window=None, seed=3)
    ours = load_model(path)
    assert ours.config.rope.long_inv_freq is not None
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    for n in (10, 24):
        ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n))
        meta = make_meta([(shuffled_table(n, 8), 0, n)], 0)
        logits = ours.compute_logits(
            ours(ids, torch.arange(n), ForwardContext(PagedAttention("torch"), meta, new_kv_cache(ours)))
        )
        torch.testing.assert_close(logits, hf(ids[None]).logits[0].float(), atol=ATOL, rtol=0)
