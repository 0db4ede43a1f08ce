"""Beam search against transformers' ``generate(num_beams=k, num_return_sequences=n, length_penalty,
early_stopping, do_sample=False)`` (CPU, float32): identical token sequences, with eos (finished hypotheses, length
penalty), without (``ignore_eos``), with stop tokens and ``min_tokens``; beams on shared blocks; beam requests
mixed with other requests; beam groups preempted and resumed whole (recompute and swap).

The random tiny checkpoints almost never emit their eos tokens, so the "eos" cases add stop tokens that the beams
do produce (taken from an ``ignore_eos`` run) to both sides' end-of-sequence set: on our side
``stop_token_ids`` next to the model's eos ids, on transformers' side ``eos_token_id=[*eos, *stops]``.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, SamplingParams

BS = 16
NEW = 12
NEVER = 10**6  # an eos id outside the vocabulary: transformers' side of ignore_eos without stop tokens


def make_prompts(lengths: list[int], seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


_models: dict[str, torch.nn.Module] = {}
_llms: dict[str, LLM] = {}


def hf_model(path: str):
    if path not in _models:
        _models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return _models[path]


def engine(path: str) -> LLM:
    if path not in _llms:
        _llms[path] = LLM(path, num_blocks=256, block_size=BS)
    return _llms[path]


def hf_beam(path, prompt, k, n, length_penalty, early_stopping, eos_ids, min_new=None, max_new=NEW):
    """transformers' returned beams, each cut to its own generated length (the stop token included)."""
    extra = {"min_new_tokens": min_new} if min_new else {}
    out = hf_model(path).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=k,
        num_return_sequences=n,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos_ids,
        pad_token_id=0,
        return_dict_in_generate=True,
        **extra,
    )
    p = len(prompt)
    return [out.sequences[i, p : p + int((out.beam_indices[i] >= 0).sum())].tolist() for i in range(n)]


def stop_tokens(path: str, prompt: list[int]) -> list[int]:
    """Two tokens the beams produce early (from an ignore_eos run): hypotheses then finish at various lengths."""
    out = engine(path).generate(
        [prompt], SamplingParams(beam_width=4, n=4, max_tokens=NEW, ignore_eos=True), use_tqdm=False
    )[0]
    return [out.outputs[0].token_ids[3], out.outputs[1].token_ids[6]]


def compare(path, prompt, k, n, lp, es, mode) -> list:
    """Our beams and transformers' for one case; returns our outputs."""
    eos = list(hf_model(path).generation_config.eos_token_id)
    common = dict(beam_width=k, n=n, length_penalty=lp, early_stopping=es, max_tokens=NEW)
    if mode == "ignore_eos":
        ref = hf_beam(path, prompt, k, n, lp, es, [NEVER])
        sp = SamplingParams(ignore_eos=True, **common)
    else:
        stops = stop_tokens(path, prompt)
        if mode == "ignore_eos_stop":
            ref = hf_beam(path, prompt, k, n, lp, es, stops[:1])
            sp = SamplingParams(ignore_eos=True, stop_token_ids=stops[:1], **common)
        elif mode == "eos":
            ref = hf_beam(path, prompt, k, n, lp, es, eos + stops)
            sp = SamplingParams(stop_token_ids=stops, **common)
        else:  # min_tokens
            ref = hf_beam(path, prompt, k, n, lp, es, eos + stops, min_new=5)
            sp = SamplingParams(stop_token_ids=stops, min_tokens=5, **common)
    outs = engine(path).generate([prompt], sp, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in outs] == ref, f"k={k} n={n} length_penalty={lp} early_stopping={es} {mode}"
    assert [o.index for o in outs] == list(range(n))
    return outs


CASES = [
    ("llama", 2, 1, 1.0, False, "eos"),
    ("llama", 4, 4, 0.0, False, "eos"),
    ("llama", 4, 2, -1.0, "never", "min_tokens"),
    ("llama", 4, 4, 1.0, True, "ignore_eos"),
    ("qwen3", 4, 1, 2.0, "never", "eos"),
    ("qwen3", 2, 2, -1.0, True, "eos"),
    ("qwen3", 2, 2, 1.0, False, "ignore_eos_stop"),
    ("qwen2", 4, 4, 1.0, False, "eos"),
]


@pytest.mark.parametrize("arch,k,n,lp,es,mode", CASES)
def test_beam_search_matches_transformers(arch, k, n, lp, es, mode, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{arch}_ckpt")
    for prompt in make_prompts([BS + 1, 2 * BS + 3], seed=21):
        compare(path, prompt, k, n, lp, es, mode)


def test_finished_hypotheses_and_length_penalty_matter(llama_ckpt: str) -> None:
    """The eos cases really exercise finished hypotheses of several lengths, and the penalty changes the pick."""
    prompt = make_prompts([2 * BS + 3], seed=21)[0]
    by_penalty = {lp: compare(llama_ckpt, prompt, 4, 4, lp, False, "eos") for lp in (-1.0, 2.0)}
    short = by_penalty[-1.0]
    assert any(o.finish_reason == "stop" for o in short) and len({len(o.token_ids) for o in short}) > 1
    assert [o.token_ids for o in short] != [o.token_ids for o in by_penalty[2.0]]
    scores = [o.cumulative_logprob for o in by_penalty[2.0]]
    assert all(s is not None and s < 0 for s in scores)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_beam_search_matches_transformers_full_matrix(arch: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(f"{arch}_ckpt")
    prompts = make_prompts([5, 2 * BS + 3], seed=22)
    modes = ("eos", "ignore_eos", "ignore_eos_stop", "min_tokens")
    cases = list(
        itertools.product(
            prompts, ((2, 1), (2, 2), (4, 1), (4, 4)), (1.0, 0.0, 2.0, -1.0), (False, True, "never"), modes
        )
    )
    # 384 cases per architecture take ~10 minutes on 2 cores: the suite runs every 13th (a coprime stride, so
    # every value of every axis is covered); BATCHGEN_FULL_BEAM_MATRIX=1 runs them all.
    if os.environ.get("BATCHGEN_FULL_BEAM_MATRIX") != "1":
        cases = cases[::13]
    for prompt, (k, n_of), lp, es, mode in cases:
        compare(path, prompt, k, n_of, lp, es, mode)


def test_beams_share_blocks_and_free_them(llama_ckpt: str) -> None:
    """Memory of a beam group: blocks in use stay a fraction of k independent sequences; all freed at the end."""
    llm = LLM(llama_ckpt, num_blocks=128, block_size=BS)
    engine_ = llm.engine
    k, prompt = 4, make_prompts([3 * BS + 5], seed=23)[0]
    engine_.add_request("b", prompt, SamplingParams(beam_width=k, n=k, max_tokens=40, ignore_eos=True))
    ratios, outs = [], []
    while engine_.has_unfinished():
        outs += engine_.step()
        kv = engine_.scheduler.kv.stats()
        if kv.num_seqs == k:
            seq_len = engine_.scheduler.running_seqs()[0].num_tokens
            ratios.append(kv.blocks_used / (k * -(-seq_len // BS)))
            assert kv.live_token_slots < kv.logical_tokens  # fewer physical slots than logical ones
    assert ratios and max(ratios) < 0.6, ratios
    assert engine_.stats.num_cow_copies > 0
    (out,) = outs
    assert len(out.outputs) == k and all(len(o.token_ids) == 40 for o in out.outputs)
    kv = engine_.scheduler.kv.stats()
    assert kv.blocks_used == 0 and kv.num_seqs == 0


def test_beam_requests_mix_with_other_requests(llama_ckpt: str) -> None:
    prompts = make_prompts([7, BS + 2, 2 * BS + 1, 9, 20], seed=24)
    params = [
        SamplingParams(beam_width=4, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(beam_width=2, n=1, max_tokens=8, length_penalty=0.0),
        SamplingParams(temperature=0.8, max_tokens=10, seed=5, n=2),
        SamplingParams(beam_width=3, n=3, max_tokens=9, early_stopping=True),
    ]
    llm = engine(llama_ckpt)
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    for a, m in zip(alone, mixed):
        assert [o.token_ids for o in m.outputs] == [o.token_ids for o in a.outputs]
    assert len(mixed[0].outputs) == 2 and len(mixed[4].outputs) == 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_groups_preempted_and_resumed_whole(llama_ckpt: str, mode: str) -> None:
    prompts = make_prompts([BS + 3, 2 * BS + 5, 9, 3 * BS, 12, 2 * BS], seed=25)
    params = [
        SamplingParams(beam_width=4, n=2, max_tokens=24, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ref = engine(llama_ckpt).generate(prompts, params, use_tqdm=False)
    small = LLM(llama_ckpt, num_blocks=22, block_size=BS, preemption_mode=mode, num_swap_blocks=64)
    got = small.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in ref]
    st = small.engine.stats
    assert st.num_preemptions > 0
    assert (st.num_swapped_out_blocks > 0) == (mode == "swap")
    assert small.engine.scheduler.kv.stats().blocks_used == 0


def test_beam_params_validated_per_request(llama_ckpt: str) -> None:
    llm = LLM(llama_ckpt, num_blocks=64, block_size=BS, max_num_seqs=4)
    ok, too_wide = llm.generate(
        [make_prompts([5], seed=26)[0]] * 2,
        [SamplingParams(beam_width=4, max_tokens=4), SamplingParams(beam_width=8, max_tokens=4)],
        use_tqdm=False,
    )
    assert ok.error is None and len(ok.outputs[0].token_ids) == 4
    assert "beam_width=8" in too_wide.error and "max_num_seqs" in too_wide.error
    with pytest.raises(ValueError, match="n .* beam_width"):
        SamplingParams(beam_width=2, n=3)
    with pytest.raises(ValueError, match="stop not supported"):
        SamplingParams(beam_width=2, stop=["x"])
