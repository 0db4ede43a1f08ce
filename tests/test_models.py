"""Our decoder vs transformers (float32, CPU): prefill and paged decode logits, greedy argmax, RoPE, config."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.engine.attention import AttentionMetadata, ForwardContext, PagedAttention
from batchgen.models import ModelConfig, load_model
from batchgen.models.config import SUPPORTED_ARCHITECTURES

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
    slots, seq_lens, cu = [], [], [0]
    max_blocks = max(len(t) for t, _, _ in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, (table, start, n) in enumerate(seqs):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]
        seq_lens.append(start + n)
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_seqs=num_decode_seqs,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        block_tables=tables,
        max_seq_len=max(seq_lens),
        max_query_len=max(n for _, _, n in seqs),
    )


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
def test_bfloat16_close_to_transformers(models, ckpt_factory):
    path = ckpt_factory("qwen2", seed=2)
    ours = load_model(path, dtype="bfloat16")
    assert ours.config.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16).eval()
    prompt = torch.randint(
        0, ours.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)
    )
    meta = make_meta([(shuffled_table(1), 0, PROMPT_LEN)], 0)
    ctx = ForwardContext(PagedAttention("torch"), meta, new_kv_cache(ours))
    logits = ours.compute_logits(ours(prompt, torch.arange(PROMPT_LEN), ctx))
    ref = hf(prompt[None]).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=0.1, rtol=0.05)


@torch.inference_mode()
def test_mistral_sliding_window_exact_up_to_max_model_len(ckpt_factory):
    """Full attention equals Mistral's windowed attention for sequences of at most `sliding_window` tokens."""
    path = ckpt_factory("mistral", sliding_window=16, seed=13)
    ours = load_model(path)
    assert ours.config.sliding_window == 16 and ours.config.max_model_len == 16
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    prompt = torch.randint(0, ours.config.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    meta = make_meta([(shuffled_table(2), 0, 16)], 0)
    ctx = ForwardContext(PagedAttention("torch"), meta, new_kv_cache(ours))
    logits = ours.compute_logits(ours(prompt, torch.arange(16), ctx))
    torch.testing.assert_close(logits, hf_step(hf, prompt)[0], atol=ATOL, rtol=0)
    # beyond the window transformers really slides (hence the max_model_len cap)
    longer = torch.cat([prompt, prompt[:4]])
    meta = make_meta([(shuffled_table(2), 0, 20)], 0)
    ctx = ForwardContext(PagedAttention("torch"), meta, new_kv_cache(ours))
    logits = ours.compute_logits(ours(longer, torch.arange(20), ctx))
    ref = hf_step(hf, longer)[0]
    torch.testing.assert_close(logits[:16], ref[:16], atol=ATOL, rtol=0)
    assert (logits[16:] - ref[16:]).abs().max() > 1e-3


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
    assert ModelConfig.from_dict(mistral).max_model_len == 1024
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).max_model_len == 4096
    qwen2 = _hf4_llama(architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=False)
    assert ModelConfig.from_dict(qwen2).sliding_window is None
    on = {**qwen2, "use_sliding_window": True, "max_window_layers": 0}
    assert ModelConfig.from_dict(on).sliding_window == 1024


def test_config_rejects_unsupported():
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel") as e:
        ModelConfig.from_dict(_hf4_llama(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'.*default, linear, llama3"):
        ModelConfig.from_dict(_hf4_llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict(_hf4_llama(hidden_act="gelu"))
