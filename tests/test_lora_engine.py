"""LoRA through the API: greedy tokens identical to PEFT for every row of batches that mix two adapters (different
ranks and target modules) with base-model rows, under chunked prefill, preemption (recompute and swap), adapter
slots loaded on demand, and beam search; the prefix cache keyed by adapter; a bad adapter failing its rows alone."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import NEW, PROMPTS, peft_greedy, two_adapters

from batchgen import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(llama_ckpt):
    a, b = two_adapters(llama_ckpt)
    return LoRARequest("a", 1, a), LoRARequest("b", 2, b)


def llm(path: str, **over) -> LLM:
    options = dict(block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2)
    options.update(over)
    return LLM(path, enable_lora=True, max_lora_rank=16, **options)


def expected(path: str, loras: list) -> list[list[int]]:
    return [peft_greedy(path, lr.lora_path if lr else None, p) for p, lr in zip(PROMPTS, loras)]


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(
            {"max_num_batched_tokens": 6, "num_blocks": 9, "max_num_seqs": 6}, id="chunked+preempted"
        ),
        pytest.param(
            {
                "max_num_batched_tokens": 6,
                "num_blocks": 9,
                "max_num_seqs": 6,
                "preemption_mode": "swap",
                "num_swap_blocks": 32,
            },
            id="chunked+swapped",
        ),
        pytest.param({"max_loras": 1}, id="one-slot-loads-on-demand"),
    ],
)
def test_mixed_batch_greedy_identical_to_peft(llama_ckpt, adapters, engine):
    a, b = adapters
    loras = [a, None, b, b, a, None]
    ref = expected(llama_ckpt, loras)
    assert ref[0] != peft_greedy(llama_ckpt, None, PROMPTS[0])  # the adapters change the output
    assert ref[2] != peft_greedy(llama_ckpt, None, PROMPTS[2])
    model = llm(llama_ckpt, **engine)
    outs = model.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == ref
    mgr = model.engine.lora
    if "num_blocks" in engine:
        assert model.engine.stats.num_preemptions > 0
    if engine.get("preemption_mode") == "swap":
        assert model.engine.stats.num_swapped_out_blocks > 0  # preempted rows kept their adapter while out
    if engine.get("max_loras") == 1:
        assert mgr.stats.loads >= 2 and mgr.stats.evictions >= 1
    assert not mgr.pins  # every request released its adapter


def test_prefix_cache_is_keyed_by_adapter(llama_ckpt, adapters):
    a, b = adapters
    model = llm(llama_ckpt)
    prompt = PROMPTS[2]
    first = model.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0]
    other = model.generate([prompt], GREEDY, use_tqdm=False, lora_request=b)[0]
    base = model.generate([prompt], GREEDY, use_tqdm=False)[0]
    same = model.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert same.num_cached_tokens == 8  # one full block, under the same adapter
    assert (
        same.outputs[0].token_ids
        == first.outputs[0].token_ids
        == peft_greedy(llama_ckpt, a.lora_path, prompt)
    )
    assert base.outputs[0].token_ids == peft_greedy(llama_ckpt, None, prompt)


def test_bad_adapter_fails_its_rows_alone(llama_ckpt, adapters, tmp_path):
    a, _ = adapters
    model = llm(llama_ckpt)
    missing = LoRARequest("missing", 9, str(tmp_path / "nowhere"))
    outs = model.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=[a, missing, None])
    assert (
        outs[1].error and "not a directory" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    )
    assert outs[0].error is None and outs[0].outputs[0].token_ids == peft_greedy(
        llama_ckpt, a.lora_path, PROMPTS[0]
    )
    assert outs[2].error is None
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(llama_ckpt, num_blocks=16).generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a)


def test_beam_search_with_adapter_matches_peft(llama_ckpt, adapters):
    from lora_helpers import _peft_model

    _, b = adapters
    prompt = PROMPTS[3]
    ref_model = _peft_model(llama_ckpt, b.lora_path)
    with torch.inference_mode():
        out = ref_model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False, num_beams=2,
            num_return_sequences=2, eos_token_id=[511], pad_token_id=0, early_stopping=False,
        )  # fmt: skip
    ref = [row[len(prompt) :].tolist() for row in out]
    sp = SamplingParams(beam_width=2, n=2, max_tokens=8, ignore_eos=True, stop_token_ids=[511])
    got = llm(llama_ckpt).generate([prompt, PROMPTS[0]], [sp, GREEDY], use_tqdm=False, lora_request=[b, None])
    assert [o.token_ids for o in got[0].outputs] == ref
    assert got[1].outputs[0].token_ids == peft_greedy(llama_ckpt, None, PROMPTS[0])


def test_score_under_adapters_equals_peft(llama_ckpt, adapters):
    """LLM.score with one adapter per pair: each continuation's log-likelihood is PEFT's under that adapter."""
    from lora_helpers import peft_logits

    a, b = adapters
    pairs = [(PROMPTS[0], PROMPTS[1][:4]), (PROMPTS[0], PROMPTS[1][:4]), (PROMPTS[3], [7, 9, 11])]
    loras = [a, None, b]
    scores = llm(llama_ckpt).score([c for c, _ in pairs], [x for _, x in pairs], lora_request=loras)
    for (ctx, cont), lr, got in zip(pairs, loras, scores):
        logp = torch.log_softmax(
            peft_logits(llama_ckpt, lr.lora_path if lr else None, ctx + cont).double(), -1
        )
        want = sum(float(logp[len(ctx) + j - 1, t]) for j, t in enumerate(cont))
        assert got.loglikelihood == pytest.approx(want, abs=1e-4)
    assert abs(scores[0].loglikelihood - scores[1].loglikelihood) > 1e-3  # the adapter changes the score
