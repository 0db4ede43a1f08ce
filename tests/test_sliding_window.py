"""Sliding-window attention for real: windows no longer cap max_model_len, and sequences longer than the window
generate exactly what transformers generates (prefill chunks, decode past the window, prefix-cache hits,
preemption), natively and through the transformers backend.

Out-of-window blocks are kept (not freed early): correct for prefix caching by construction, since a block's
K/V depend only on its tokens and positions, whatever window later layers read them through.
"""

from __future__ import annotations

import model_zoo
import pytest
import torch
from engine_helpers import hf_greedy, hf_model, make_llm

from batchgen import SamplingParams
from batchgen.models import ModelConfig


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, model_zoo.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_issue_example_window_24_prompt_41(impl):
    """A Mistral checkpoint with a 24-token window takes a 41-token prompt (it was refused: max_model_len 24)."""
    path = model_zoo.checkpoint("mistral", sliding_window=24, seed=5)
    prompts = [_tokens(41, 1), _tokens(30, 2), _tokens(25, 3)]
    ref = hf_greedy(path, prompts, 20)
    llm = make_llm(path, impl, num_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.max_model_len == 256  # max_position_embeddings, not the window
    assert llm.engine.model.config.layer_windows == (24, 24)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_the_window_matters():
    """Without its window the same checkpoint continues the 41-token prompt differently (so the tests above
    really check windowed attention)."""
    path = model_zoo.checkpoint("mistral", sliding_window=24, seed=5)
    windowed = hf_greedy(path, [_tokens(41, 1)], 20)
    model = hf_model(path)
    model.config.sliding_window = None
    try:
        full = model.generate(torch.tensor([_tokens(41, 1)]), max_new_tokens=20, do_sample=False)[0, 41:]
    finally:
        model.config.sliding_window = 24
    assert full.tolist()[: len(windowed[0])] != windowed[0]


@pytest.mark.parametrize(("arch", "impl"), [("gemma3_text", "native"), ("starcoder2", "transformers")])
def test_decode_far_past_the_window_with_prefix_hits(arch, impl):
    """Short prompts decoding 40 tokens (five 8-token windows), then prompts extending a finished one: their
    cached prefix (longer than the window) is reused and the continuation still matches transformers."""
    path = model_zoo.checkpoint(arch, seed=11)
    first = [_tokens(6, 4), _tokens(9, 5)]
    ref_first = hf_greedy(path, first, 40)
    llm = make_llm(path, impl, num_blocks=64)
    outs = llm.generate(first, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref_first
    # second wave: prompt = a finished sequence's prompt + its output + new tokens (a 46-token shared prefix)
    second = [first[0] + ref_first[0] + _tokens(5, 6), first[0] + ref_first[0] + _tokens(3, 7)]
    before = llm.engine.stats.prompt_tokens_cached
    outs = llm.generate(second, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats.prompt_tokens_cached - before >= 2 * 40  # the shared blocks were hits
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, second, 12)


def test_window_does_not_cap_max_model_len():
    base = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
    }
    c = ModelConfig.from_dict(base)
    assert c.max_model_len == 32768 and c.layer_windows == (4096,) * 3 and c.sliding_window == 4096
    # a window at least the context is no window at all
    assert ModelConfig.from_dict({**base, "sliding_window": 32768}).layer_windows == (None,) * 3
    gemma2 = {**base, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16}
    g = ModelConfig.from_dict(gemma2)  # hub Gemma 2 configs have no layer_types: local layers alternate
    assert g.layer_windows == (4096, None, 4096) and g.sliding_window is None and g.max_model_len == 32768
