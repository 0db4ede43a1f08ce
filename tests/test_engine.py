"""The engine against transformers: greedy equality per architecture, batching, preemption, prefix caching,
chunked prefill, seeded sampling, forks, stop conditions and per-request errors (CPU, float32)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, SamplingParams

BS = 16
LENGTHS = [1, BS - 1, BS, BS + 1, 3 * BS + 5]
NEW = 32


def make_prompts(lengths: list[int], seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


_hf_cache: dict[tuple, list[int]] = {}


def hf_greedy(path: str, prompt: list[int], max_new: int = NEW) -> list[int]:
    key = (path, tuple(prompt), max_new)
    if key not in _hf_cache:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
        _hf_cache[key] = out[0, len(prompt) :].tolist()
    return _hf_cache[key]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers_per_architecture(arch: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{arch}_ckpt")
    prompts = make_prompts(LENGTHS, seed=1)
    llm = LLM(path, num_blocks=256, block_size=BS)
    for prompt in prompts:  # unbatched, like the reference
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(path, prompt), f"{arch}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize(
    "variant",
    [
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"head_dim": 32, "tie_word_embeddings": True},
        {"num_kv_heads": 1},
    ],
    ids=["llama3-rope", "linear-rope", "head_dim-tied", "mqa"],
)
def test_greedy_matches_transformers_variants(ckpt_factory, variant: dict) -> None:
    path = ckpt_factory("llama", **variant)
    llm = LLM(path, num_blocks=256, block_size=BS)
    prompts = make_prompts([BS + 1, 2 * BS + 3], seed=2)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt)


def test_batched_shuffled_with_preemption_matches_unbatched(llama_ckpt: str) -> None:
    prompts = make_prompts(LENGTHS * 4, seed=3)
    ref = LLM(llama_ckpt, num_blocks=512).generate(prompts, GREEDY, use_tqdm=False)
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    # 20 blocks of 16 tokens cannot hold 16 sequences of up to ~85 tokens: forces preemption.
    llm = LLM(llm_path := llama_ckpt, num_blocks=20, block_size=BS, max_num_seqs=16)
    assert llm_path
    shuffled = [prompts[i] for i in order]
    outs = []
    for start in range(0, len(shuffled), 16):
        outs += llm.generate(shuffled[start : start + 16], GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for i, out in zip(order, outs):
        assert out.outputs[0].token_ids == ref[i].outputs[0].token_ids
    for prompt, out in zip(prompts[: len(LENGTHS)], ref):
        assert out.outputs[0].token_ids == hf_greedy(llama_ckpt, prompt)
    assert llm.engine.scheduler.kv.stats().blocks_used == 0


def test_prefix_cache_hits_and_same_tokens(llama_ckpt: str) -> None:
    shared = make_prompts([3 * BS + 7], seed=4)[0]
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(4)]
    on = LLM(llama_ckpt, num_blocks=256)
    first = on.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = on.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 3 * BS for o in rest)
    # and the prefix's last 7 tokens are copied from the first prompt's fourth block (full: it generated)
    assert on.engine.stats.prompt_tokens_copied == 3 * 7
    off = LLM(llama_ckpt, num_blocks=256, enable_prefix_caching=False)
    ref = off.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in ref)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in ref]
    # Identical prompts in one batch share blocks computed in the same step.
    same = on.generate([shared] * 3, GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in same}) == 1
    assert on.engine.stats.prompt_tokens_cached >= 3 * 3 * BS


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_ending_inside_a_block_is_copied_and_gives_the_same_tokens(
    llama_ckpt: str, async_scheduling: bool
) -> None:
    shared = make_prompts([3 * BS + 7], seed=11)[0]
    tails = make_prompts([20, 20, 20, 20], seed=12)
    prompts = [shared + t for t in tails]
    llm = LLM(llama_ckpt, num_blocks=256, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # the first computes everything; the others share 3 blocks, copy 7 tokens of its 4th, compute the rest
    assert [o.num_cached_tokens for o in outs] == [0] + [3 * BS] * 3
    st = llm.engine.stats
    assert st.prompt_tokens_copied == 3 * 7 and llm.engine.scheduler.kv.stats().num_prefix_copies == 3
    assert st.prompt_tokens_computed == sum(map(len, prompts)) - 3 * (3 * BS + 7)
    ref = LLM(llama_ckpt, num_blocks=256, enable_prefix_caching=False).generate(
        prompts, GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert outs[2].outputs[0].token_ids == hf_greedy(llama_ckpt, prompts[2])


def test_chunked_prefill_gives_identical_output(llama_ckpt: str) -> None:
    prompts = make_prompts([5 * BS + 3, 2 * BS, 7], seed=5)
    ref = LLM(llama_ckpt, num_blocks=256).generate(prompts, GREEDY, use_tqdm=False)
    chunked = LLM(llama_ckpt, num_blocks=256, max_num_batched_tokens=24)
    outs = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert chunked.engine.stats.num_steps > len(ref[0].outputs[0].token_ids)


def test_seeded_sampling_is_independent_of_batch(llama_ckpt: str) -> None:
    prompts = make_prompts([9, 20, 33, 4], seed=6)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234)
    llm = LLM(llm_path := llama_ckpt, num_blocks=256)
    assert llm_path
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    noise = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate(prompts[::-1] + prompts[:2], [sp] * 4 + [noise] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]][::-1] == alone
    # A different seed gives a different sample somewhere.
    other = llm.generate(prompts, SamplingParams(temperature=0.9, max_tokens=16, seed=99), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in other] != alone


def test_n_forks_share_prompt_blocks_and_free_everything(llama_ckpt: str) -> None:
    prompt = make_prompts([2 * BS + 5], seed=7)[0]
    llm = LLM(llama_ckpt, num_blocks=64)
    engine = llm.engine
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    engine.add_request("r", prompt, sp)
    shared_seen = False
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        s = engine.scheduler.kv.stats()
        if s.num_seqs == 4:
            # 3 prompt blocks shared by 4 sequences: far fewer physical blocks than 4 separate copies.
            assert s.blocks_used < 4 * 3
            shared_seen = True
    assert shared_seen
    (out,) = outputs
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert engine.stats.num_cow_copies >= 3  # the shared partial prompt block is copied on divergence
    # the samples' generators (plain seeds in the step input, one generator each in the sampler) are
    # released with the next step
    assert len(engine.runner.sampler._row_generators) == 4 and len(engine.builder.released) == 4
    engine.add_request("next", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert not engine.runner.sampler._row_generators and not engine.builder.released
    s = engine.scheduler.kv.stats()
    assert s.blocks_used == 0 and s.num_seqs == 0
    # Deterministic: the same request again gives the same 4 samples.
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_stop_conditions(llama_ckpt: str) -> None:
    llm = LLM(llama_ckpt, num_blocks=128)
    prompt = make_prompts([12], seed=8)[0]
    free_run = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    toks = free_run[0].outputs[0].token_ids
    assert len(toks) == 20 and free_run[0].outputs[0].finish_reason == "length"
    # stop_token_ids: stops at the first occurrence of the 5th token, which is included in token_ids.
    stop_tok = toks[4]
    first = toks.index(stop_tok)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok and out.token_ids == toks[: first + 1]
    # min_tokens bans the stop token until reached.
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[toks[0]], min_tokens=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 3 and toks[0] not in out.token_ids[:3]
    # stop strings: text truncated before the stop string unless asked to include it.
    full_text = free_run[0].outputs[0].text
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    if stop.strip():
        out = llm.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full_text[: full_text.index(stop)]
        out = llm.generate(
            [prompt],
            SamplingParams(
                temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
            ),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.text == full_text[: full_text.index(stop) + len(stop)]
    # logprobs: top-k per generated token, the greedy token has the highest.
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok] == max(lp.values()) and len(lp) == 3


def test_requests_that_cannot_run_fail_alone(llama_ckpt: str) -> None:
    llm = LLM(llama_ckpt, num_blocks=8, block_size=BS, max_model_len=100)
    ok_prompt = make_prompts([10], seed=9)[0]
    outs = llm.generate(
        [ok_prompt, [], make_prompts([150], seed=10)[0], make_prompts([90], seed=11)[0], ok_prompt],
        [GREEDY, GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=9), GREEDY],
        use_tqdm=False,
    )
    assert outs[0].error is None and outs[4].error is None
    assert outs[0].outputs[0].token_ids == outs[4].outputs[0].token_ids
    assert "empty prompt" in outs[1].error
    assert "max_model_len" in outs[2].error and outs[2].outputs[0].finish_reason == "error"
    # 90 prompt tokens + 9 new need 7 blocks: fits the pool of 8.
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) <= 9
    small = LLM(llama_ckpt, num_blocks=2, block_size=BS)
    (big,) = small.generate([make_prompts([40], seed=12)[0]], GREEDY, use_tqdm=False)
    assert big.error is not None and "KV blocks" in big.error


def test_max_model_len_finishes_with_length(llama_ckpt: str) -> None:
    llm = LLM(llama_ckpt, num_blocks=64, max_model_len=24)
    out = llm.generate(
        [make_prompts([20], seed=13)[0]],
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_string_prompts_and_unknown_option(llama_ckpt: str) -> None:
    llm = LLM(llama_ckpt, num_blocks=64)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(llama_ckpt, not_an_option=1)
