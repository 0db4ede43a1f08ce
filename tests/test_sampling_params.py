"""SamplingParams: defaults, validation messages, normalisation, dict round trip."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from batchgen.sampling_params import SamplingParams


def test_defaults_match_the_contract():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, None, None)
    assert not p.include_stop_str_in_output and not p.ignore_eos and p.skip_special_tokens
    assert p.logprobs is None and p.seed is None
    assert not p.greedy and not p.needs_penalties


@pytest.mark.parametrize("t, greedy", [(0, True), (0.0, True), (5e-6, True), (1e-5, False), (0.7, False)])
def test_greedy(t, greedy):
    assert SamplingParams(temperature=t).greedy is greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > max_tokens (16)
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_range_is_in_the_message():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature must be .*>= 0"):
        SamplingParams(temperature=-1)


def test_boundaries_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, temperature=0)
    SamplingParams(min_tokens=16, max_tokens=16, logprobs=0, top_k=1, seed=0)
    SamplingParams(max_tokens=None, min_tokens=10_000)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=[3, 3, 7])
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.stop_token_ids == [3, 7]
    assert SamplingParams(stop=("a", "b", "a")).stop == ["a", "b"]
    assert SamplingParams(stop=[]).stop is None


def test_numpy_and_integral_floats_are_coerced():
    p = SamplingParams(
        n=np.int64(2),
        temperature=np.float32(0.5),
        top_k=np.int32(5),
        max_tokens=32.0,
        seed=np.int64(7),
        ignore_eos=np.bool_(True),
        stop_token_ids=np.array([1, 2]),
    )
    assert type(p.n) is int and type(p.temperature) is float and type(p.top_k) is int
    assert p.max_tokens == 32 and type(p.max_tokens) is int
    assert p.seed == 7 and type(p.seed) is int
    assert p.ignore_eos is True
    assert p.stop_token_ids == [1, 2] and all(type(t) is int for t in p.stop_token_ids)


def test_penalties_flag():
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties


def test_dict_round_trip_is_json_serialisable():
    p = SamplingParams(
        n=3, temperature=0.8, top_p=0.9, top_k=40, stop=["\n\n"], stop_token_ids=[2], logprobs=5, seed=11
    )
    d = p.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert SamplingParams.from_dict(json.loads(json.dumps(d))) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict({"temperature": 0}).greedy


def test_from_dict_rejects_unknown_and_invalid():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2})


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    assert dataclasses.replace(p, temperature=0).greedy
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1)
