"""End probabilities: the chance, at each sampled token, that the draw ended the sequence, as the engine's
sampler reports it (watched tokens), held to a float64 reference of the distribution the token was drawn from
(the transformers model's logits, temperature, top-k, top-p, the stop ids banned until ``min_tokens``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import hf_model

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.features.end_probability import EndProbability
from batchgen.engine.worker.sampler import Sampler, SamplingRow, SamplingTensors, WatchedTokens
from batchgen.sampling_params import SamplingParams


def _reference(logits: np.ndarray, params: SamplingParams, ends: list[int], banned: bool) -> float:
    """Float64: the probability of drawing one of ``ends`` after banning (``banned``), temperature, top-k,
    top-p (renormalised after top-k; a token is kept while the mass before it is under top_p)."""
    x = logits.astype(np.float64).copy()
    if banned:
        x[ends] = -np.inf
    if params.temperature < 1e-5:
        return float(int(np.argmax(x)) in ends)
    x = x / params.temperature
    if 0 < params.top_k < x.size:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x[x < kth] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[(before < params.top_p) | (np.arange(p.size) == 0)]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return float(p[ends].sum())


def _run_to_end(engine: LLMEngine) -> dict:
    """Step ``engine`` until it has nothing unfinished; its outputs by request id."""
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def _generated_logits(model, prompt: list[int], tokens: list[int]) -> np.ndarray:  # noqa: ANN001
    """The transformers model's float64 logits at each position that drew one of ``tokens`` after ``prompt``."""
    with torch.inference_mode():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double().numpy()


def test_the_sampler_returns_the_drawn_distributions_chance_of_the_watched_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    ends = WatchedTokens((3, 7, 11))
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, top_k=10),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
        SamplingParams(temperature=0.9),
    ]
    logits[3, 7] = 50.0  # the greedy row takes a watched token
    watch = {i: ends for i in (0, 1, 2, 3, 4)}  # row 5 is not watched
    rows = [
        SamplingRow(p, key=i, banned_token_ids=list(ends.ids) if i == 4 else []) for i, p in enumerate(params)
    ]
    for out in (
        Sampler(seed=1)(logits, rows, None, watch),  # rows built
        Sampler(seed=1)(
            logits[:4], None, SamplingTensors.from_params(params[:4]), {i: ends for i in range(4)}
        ),
    ):
        assert set(out.watched) == set(range(min(5, len(out.token_ids))))
        for i, got in out.watched.items():
            want = _reference(logits[i].numpy(), params[i], list(ends.ids), banned=i == 4)
            assert got == pytest.approx(want, abs=1e-6), i
    assert out.watched[3] == 1.0
    # greedy only: the argmax itself
    g = Sampler()(
        logits[:2], None, None, {0: WatchedTokens((int(logits[0].argmax()),)), 1: WatchedTokens((0,))}
    )
    assert g.watched == {0: 1.0, 1: float(int(logits[1].argmax()) == 0)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_records_each_tokens_chance_of_ending_as_drawn(
    llama_ckpt: str, async_scheduling: bool
) -> None:
    engine = LLMEngine(
        llama_ckpt,
        EngineConfig(
            device="cpu",
            num_blocks=64,
            block_size=8,
            max_num_seqs=4,
            async_scheduling=async_scheduling,
            seed=3,
        ),
    )
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(0)
    ends = [int(t) for t in rng.choice(vocab, vocab // 8, replace=False)]  # a wide net: sequences end early
    prompts = [rng.integers(1, vocab, size=k).tolist() for k in (5, 9, 14, 7, 11)]
    params = [
        SamplingParams(temperature=0.8, max_tokens=24, stop_token_ids=ends, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=30, max_tokens=24, stop_token_ids=ends, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.85, max_tokens=24, stop_token_ids=ends, ignore_eos=True, seed=5
        ),
        SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=ends, ignore_eos=True, min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=ends[:3], ignore_eos=True),
    ]
    watches = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        w = EndProbability(WatchedTokens(engine.stop.stop_token_ids(sp)))
        watches.append(w)
        engine.add_request(i, p, sp, addons=(w,))
    outs = _run_to_end(engine)
    model = hf_model(llama_ckpt)
    ended = 0
    for i, (p, sp, w) in enumerate(zip(prompts, params, watches)):
        toks = outs[i].outputs[0].token_ids
        chances = w.of(0, len(toks), None)
        assert chances is not None and len(chances) == len(toks)
        ended += outs[i].outputs[0].finish_reason == "stop"
        logits = _generated_logits(model, p, toks)
        end_ids = sorted(set(sp.stop_token_ids))
        for t, got in enumerate(chances):
            want = _reference(logits[t], sp, end_ids, banned=t < sp.min_tokens)
            assert got == pytest.approx(want, abs=2e-4), (i, t)
        if sp.min_tokens:
            assert chances[: sp.min_tokens] == [0.0] * sp.min_tokens
    assert ended >= 2  # the chances were watched where sequences did end


def test_a_one_character_stop_string_is_watched_through_the_tokens_that_hold_it(llama_ckpt: str) -> None:
    """The calibration's watch for ``stop=["e"]``: every token whose text holds "e" (drawn, it ends the sequence);
    a sample ended by it counts that end as its chance there, not once more as seen. A longer stop string, or
    ``min_tokens``, leaves the strings' ends counted as seen."""
    from batchgen.job.calibrate import _end_watch

    engine = LLMEngine(
        llama_ckpt, EngineConfig(device="cpu", num_blocks=64, block_size=8, max_num_seqs=4, seed=2)
    )
    tok = engine.tokenizer
    sp = SamplingParams(temperature=1.0, max_tokens=24, stop=["e"], ignore_eos=True)
    memo: dict = {}
    w = _end_watch(engine, sp, memo)
    assert w is not None and w.covered == ("e",)
    holding = {i for i in range(len(tok)) if "e" in tok.decode([i], skip_special_tokens=True)}
    assert holding and set(w.end_token_ids) >= {i for i in holding if "\ufffd" not in tok.decode([i])}
    assert _end_watch(engine, sp, memo).end_token_ids is w.end_token_ids  # one tuple for the same ends
    assert _end_watch(
        engine, SamplingParams(temperature=1.0, stop=["e", "xy"], ignore_eos=True), memo
    ).covered == ("e",)
    assert (
        _end_watch(
            engine, SamplingParams(temperature=1.0, stop=["e"], min_tokens=2, ignore_eos=True), memo
        ).covered
        == ()
    )
    assert _end_watch(engine, SamplingParams(temperature=0.0, stop=["e"]), memo) is None
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, engine.model.config.vocab_size, size=6).tolist() for _ in range(4)]
    watches = []
    for i, p in enumerate(prompts):
        watches.append(_end_watch(engine, sp, memo))
        engine.add_request(i, p, sp, addons=(watches[-1],))
    outs = _run_to_end(engine)
    model = hf_model(llama_ckpt)
    by_string = 0
    for i, p in enumerate(prompts):
        c = outs[i].outputs[0]
        toks = c.token_ids
        chances = watches[i].of(0, len(toks), c.stop_reason if isinstance(c.stop_reason, str) else None)
        assert chances is not None
        logits = _generated_logits(model, p, toks)
        for t, got in enumerate(chances):
            assert got == pytest.approx(
                _reference(logits[t], sp, list(w.end_token_ids), banned=False), abs=2e-4
            )
        if c.stop_reason == "e":
            by_string += 1
            assert (
                toks[-1] in w.end_token_ids and chances[-1] < 1.0
            )  # the end is its chance, not added as seen
    assert by_string >= 1
