"""Plain sampling (no penalties, min_tokens, logprobs or seeds): the engine passes the sampler the rows' filter
settings only, no per-row objects — and the tokens are exactly those of the per-row path."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.sched.sequence import Request
from batchgen.engine.worker.sampler import Sampler, SamplingRow, SamplingTensors
from batchgen.engine.worker.step_builder import StepBuilder

PLAIN = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.2, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.01),
]


@pytest.mark.parametrize("order", [0, 1, 2])
def test_settings_only_draws_equal_the_per_row_draws(order: int) -> None:
    params = random.Random(order).choices(PLAIN, k=9)
    settings = SamplingTensors.from_params(params)
    for step in range(4):
        logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(10 * order + step))
        rows = [SamplingRow(params=p, prompt_token_ids=[1], output_token_ids=[]) for p in params]
        with_rows, settings_only = Sampler(seed=order), Sampler(seed=order)
        for _ in range(step + 1):  # the generators advance the same way step after step
            a = with_rows(logits, rows, settings)
            b = settings_only(logits, None, settings)
            assert a.token_ids == b.token_ids and b.logprobs == [None] * len(params)


def test_which_requests_are_plain() -> None:
    def plain(**kw) -> bool:
        return Request(request_id=0, prompt_token_ids=[1], params=SamplingParams(**kw)).plain_sampling

    assert plain(temperature=0.8) and plain(temperature=0.0) and plain(temperature=0.0, seed=3)
    assert plain(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1)
    assert not plain(temperature=0.8, seed=3)  # its own generator
    assert not plain(temperature=0.8, logprobs=2)
    assert not plain(temperature=0.8, min_tokens=2)  # banned tokens while short
    assert not plain(temperature=0.8, repetition_penalty=1.2)
    assert not plain(temperature=0.8, presence_penalty=0.5)


def test_engine_builds_no_rows_for_plain_sampling_and_tokens_are_unchanged(
    llama_ckpt: str, monkeypatch
) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    params = [replace(PLAIN[i % len(PLAIN)], max_tokens=10, ignore_eos=True) for i in range(8)]
    built: list[int] = []
    real_rows = StepBuilder.sampling_rows

    def counting(self, out):
        rows = real_rows(self, out)
        built.append(len(rows))
        return rows

    monkeypatch.setattr(StepBuilder, "sampling_rows", counting)
    fast = LLM(llama_ckpt, num_blocks=64, seed=5).generate(prompts, params, use_tqdm=False)
    assert not built, "plain sampling built per-row objects"

    real_inputs = StepBuilder.sampling_inputs

    def per_row(self, out):  # the general path: rows built for every step
        out.plain_sampling = out.plain_greedy
        return real_inputs(self, out)

    monkeypatch.setattr(StepBuilder, "sampling_inputs", per_row)
    slow = LLM(llama_ckpt, num_blocks=64, seed=5).generate(prompts, params, use_tqdm=False)
    assert any(built)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]
