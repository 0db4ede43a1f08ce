"""Every claimed architecture, native and through the transformers backend, against transformers (float32, CPU).

Checkpoints are tiny random-weight models built from transformers' own config classes (`model_zoo`): windows
(8 or 12 tokens) shorter than the prompts (up to 40 tokens), Gemma 2 soft-capping small enough to matter,
Granite multipliers, partial rotary (Phi-3, GPT-NeoX), learned positions (GPT-2), MoE routing.

- greedy outputs token-identical to transformers `generate`, with requests submitted shuffled, batched, under
  preemption (a KV pool too small for the batch), chunked prefill (a 24-token budget) and prefix caching
  (prompts sharing a 17-token prefix);
- the attention options each layer passes to the kernels (window, soft-cap, scale);
- logits and sampler logprobs equal to transformers' for the same steps.
"""

from __future__ import annotations

import random

import model_zoo
import pytest
import torch
from engine_helpers import hf_greedy, hf_model, make_llm
from paged_reference import ReferencePagedAttention

from batchgen import SamplingParams
from batchgen.attention import AttentionMetadata, ForwardContext, PagedAttention
from batchgen.models import NATIVE_ARCHITECTURES, load_model

NATIVE = set(NATIVE_ARCHITECTURES.values()) | {"gemma3"}  # zoo keys with a native implementation
ARCHS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "granite",
    "olmo2",
    "gpt_neox",
    "starcoder2",
    "gpt2",
    "gpt_oss",
]
NEW_TOKENS = 12
# One architecture per feature runs by default; the rest are marked slow (still run in CI).
FAST = {"mistral", "gemma2", "qwen3_moe", "gpt2", "gpt_oss"}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(5, model_zoo.VOCAB, (17,), generator=g).tolist()
    out = []
    for i, n in enumerate([23, 40, 12, 31, 19, 36, 27, 15]):
        tail = torch.randint(5, model_zoo.VOCAB, (n,), generator=g).tolist()
        out.append((shared + tail)[:n] if i % 2 else tail)  # half share a 17-token prefix (two full blocks)
    return out


PROMPTS = _prompts()


def _implementations(arch: str) -> list[str]:
    return ["native", "transformers"] if arch in NATIVE else ["auto"]


@pytest.mark.parametrize("arch", [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def test_greedy_identical_to_transformers_generate(arch):
    path = model_zoo.checkpoint(arch)
    ref = hf_greedy(path, PROMPTS, NEW_TOKENS)
    order = list(range(len(PROMPTS)))
    random.Random(arch).shuffle(order)
    for impl in _implementations(arch):
        # 12 blocks of 8 tokens for 4 concurrent sequences of 24 to 52 tokens: preemption is certain
        llm = make_llm(path, impl, num_blocks=12)
        assert llm.engine.model.config.implementation == ("native" if impl == "native" else "transformers")
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([PROMPTS[i] for i in order], params, use_tqdm=False)
        got = {i: o.outputs[0].token_ids for i, o in zip(order, outs)}
        for i in range(len(PROMPTS)):
            assert got[i] == ref[i], f"{arch} ({impl}) prompt {i}: {got[i]} != transformers {ref[i]}"
        stats = llm.engine.stats
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"
        assert stats.prompt_tokens_cached > 0, "prompts sharing a prefix were meant to hit the prefix cache"


# ------------------------------------------------------------------------------------ attention options
EXPECTED_OPTIONS = {  # per layer: (sliding_window, softcap)
    "mistral": [(8, None), (8, None)],
    "qwen2": [(None, None), (8, None)],  # max_window_layers=1: only layer 1 slides
    "phi3": [(12, None), (12, None)],
    "gemma2": [(8, 2.0), (None, 2.0)],
    "gemma3_text": [(8, None), (None, None)],
    "starcoder2": [(8, None), (8, None)],
    "llama": [(None, None), (None, None)],
    "gpt_oss": [(8, None), (None, None)],
}


def _meta(seqs: list[tuple[list[int], int, int]], num_decode_seqs: int, block_size: int) -> AttentionMetadata:
    return AttentionMetadata.for_sequences(seqs, num_decode_seqs, block_size)


@pytest.mark.parametrize("arch", list(EXPECTED_OPTIONS))
@torch.inference_mode()
def test_layer_attention_options_reach_the_kernels(arch):
    path = model_zoo.checkpoint(arch)
    for impl in ["native", "transformers"] if arch in NATIVE else ["transformers"]:
        model = load_model(path, implementation=impl)
        c = model.config
        attn = ReferencePagedAttention()
        kv = torch.zeros(c.num_layers, 2, 8, 8, c.num_kv_heads, c.head_dim)
        model(torch.arange(5), torch.arange(5), ForwardContext(attn, _meta([([3, 1], 0, 5)], 0, 8), kv))
        got = [(call["sliding_window"], call["softcap"]) for call in attn.calls]
        assert got == EXPECTED_OPTIONS[arch], (impl, got)
        assert tuple(w for w, _ in got) == c.layer_windows
        if arch == "gpt_oss":  # attention sinks: each layer's own `sinks` parameter, one logit per head
            sinks = [layer.self_attn.sinks for layer in model.backbone.layers]
            assert all(call["sinks"] is s for call, s in zip(attn.calls, sinks))
        else:
            assert all(call["sinks"] is None for call in attn.calls)
    # the scale too: Gemma 2's query_pre_attn_scalar (24), Granite's attention_multiplier (0.15)
    for arch_, scale in [("gemma2", 24**-0.5), ("granite", 0.15)]:
        for impl in ["native", "transformers"]:
            model = load_model(model_zoo.checkpoint(arch_), implementation=impl)
            attn = ReferencePagedAttention()
            c = model.config
            kv = torch.zeros(c.num_layers, 2, 8, 8, c.num_kv_heads, c.head_dim)
            model(torch.arange(3), torch.arange(3), ForwardContext(attn, _meta([([2], 0, 3)], 0, 8), kv))
            assert all(abs(call["scale"] - scale) < 1e-12 for call in attn.calls), (arch_, impl)


# ------------------------------------------------------------------------------------------ logits level
@pytest.mark.parametrize("arch", ["gemma2", "phi3", "qwen2_moe", "granite", "gpt2"])
@torch.inference_mode()
def test_logits_chunked_prefill_and_decode_match_transformers(arch):
    """Prefill in two chunks then decode, packed with a second sequence, against transformers' full forward."""
    path = model_zoo.checkpoint(arch)
    hf = hf_model(path)
    g = torch.Generator().manual_seed(3)
    a = torch.randint(5, model_zoo.VOCAB, (26,), generator=g)
    b = torch.randint(5, model_zoo.VOCAB, (11,), generator=g)
    ref_a, ref_b = hf(a[None]).logits[0].float(), hf(b[None]).logits[0].float()
    impls = ["native", "transformers"] if arch in NATIVE else ["transformers"]
    for impl in impls:
        model = load_model(path, implementation=impl)
        c = model.config
        attn = PagedAttention("torch")
        kv = torch.zeros(c.num_layers, 2, 16, 4, c.num_kv_heads, c.head_dim)
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(1)).tolist()
        ta, tb = perm[:7], perm[7:10]
        # step 1: a's first 15 tokens, b's 11 (b done); step 2: b decodes? no: a's remaining 10 as a chunk
        meta = _meta([(ta, 0, 15), (tb, 0, 11)], 0, 4)
        ids, pos = torch.cat([a[:15], b]), torch.cat([torch.arange(15), torch.arange(11)])
        l1 = model.compute_logits(model(ids, pos, ForwardContext(attn, meta, kv)))
        meta = _meta([(ta, 15, 11)], 0, 4)
        l2 = model.compute_logits(model(a[15:], torch.arange(15, 26), ForwardContext(attn, meta, kv)))
        torch.testing.assert_close(torch.cat([l1[:15], l2]), ref_a, atol=1e-4, rtol=0)
        torch.testing.assert_close(l1[15:], ref_b, atol=1e-4, rtol=0)
        # decode one token of each, packed (decodes first)
        nxt_a, nxt_b = int(ref_a[-1].argmax()), int(ref_b[-1].argmax())
        meta = _meta([(ta, 26, 1), (tb, 11, 1)], 2, 4)
        l3 = model.compute_logits(
            model(torch.tensor([nxt_a, nxt_b]), torch.tensor([26, 11]), ForwardContext(attn, meta, kv))
        )
        full_a = hf(torch.cat([a, torch.tensor([nxt_a])])[None]).logits[0, -1].float()
        full_b = hf(torch.cat([b, torch.tensor([nxt_b])])[None]).logits[0, -1].float()
        torch.testing.assert_close(l3, torch.stack([full_a, full_b]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "granite"])
@torch.inference_mode()
def test_sampler_logprobs_equal_transformers(arch):
    """Soft-capping (Gemma 2) and logits scaling (Granite) flow into the sampler's logprobs."""
    path = model_zoo.checkpoint(arch)
    hf = hf_model(path)
    prompt = PROMPTS[1]
    for impl in ["native", "transformers"]:
        llm = make_llm(path, impl)
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3), use_tqdm=False
        )[0].outputs[0]
        seq = prompt + out.token_ids
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + step]
            assert token == int(row.argmax())
            top = torch.topk(row, 3)
            assert set(lp) >= set(top.indices.tolist())
            for t, v in lp.items():
                assert abs(v - float(row[t])) < 1e-4, (impl, step, t, v, float(row[t]))


@pytest.mark.parametrize(("arch", "impl"), [("gemma2", "native"), ("gpt_oss", "transformers")])
@torch.inference_mode()
def test_models_on_the_triton_kernels_in_the_interpreter(arch, impl):
    """Windows, soft-capping (Gemma 2) and sinks (gpt-oss) through the Triton prefill and decode kernels (run by
    Triton's interpreter on CPU tensors): logits match transformers past the window."""
    pytest.importorskip("triton")
    path = model_zoo.checkpoint(arch)
    hf = hf_model(path)
    model = load_model(path, implementation=impl)
    c = model.config
    attn = PagedAttention("triton")
    kv = torch.zeros(c.num_layers, 2, 8, 4, c.num_kv_heads, c.head_dim)
    table = [5, 2, 7, 0, 3, 6]
    seq = torch.randint(5, model_zoo.VOCAB, (19,), generator=torch.Generator().manual_seed(9))
    ref = hf(seq[None]).logits[0].float()
    meta = _meta([(table, 0, 17)], 0, 4)
    prefill = model.compute_logits(model(seq[:17], torch.arange(17), ForwardContext(attn, meta, kv)))
    torch.testing.assert_close(prefill, ref[:17], atol=2e-4, rtol=0)
    for pos in (17, 18):  # decode past the 8-token window
        meta = _meta([(table, pos, 1)], 1, 4)
        out = model.compute_logits(
            model(seq[pos : pos + 1], torch.tensor([pos]), ForwardContext(attn, meta, kv))
        )
        torch.testing.assert_close(out[0], ref[pos], atol=2e-4, rtol=0)
