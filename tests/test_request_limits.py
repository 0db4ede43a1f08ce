"""Requests that would cost unbounded memory are refused with a clear error: logprobs above
``engine.max_logprobs`` (vLLM's name and default, 20); and task=score refuses sampling options that do not
apply to it instead of ignoring them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, read_parts

from batchgen import LLM, EngineConfig, SamplingParams
from batchgen.errors import ConfigError
from batchgen.job.config import validate
from batchgen.job.run import EXIT_CONFIG, EXIT_OK, run_job


@pytest.fixture(scope="module")
def llm(llama_ckpt: str) -> LLM:
    return LLM(llama_ckpt, num_blocks=64, max_logprobs=30)


def test_logprobs_above_the_cap_fail_alone(llm: LLM) -> None:
    assert EngineConfig().max_logprobs == 20
    params = [
        SamplingParams(max_tokens=2, logprobs=30),
        SamplingParams(max_tokens=2, logprobs=31),
        SamplingParams(max_tokens=2, prompt_logprobs=31),
    ]
    ok, too_many, prompt_too_many = llm.generate(["hello there"] * 3, params, use_tqdm=False)
    assert ok.error is None and all(len(d) >= 30 for d in ok.outputs[0].logprobs)
    assert too_many.error == (
        "logprobs=31 is more than engine.max_logprobs=30: ask for at most 30 per token, or raise "
        "engine.max_logprobs (-1: no cap)"
    )
    assert prompt_too_many.error.startswith("prompt_logprobs=31 is more than engine.max_logprobs=30")
    with pytest.raises(ValueError, match="engine.max_logprobs must be >= 0"):
        EngineConfig(max_logprobs=-2)


def test_job_refuses_the_configuration_and_fails_an_override_row(llama_ckpt: str, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    sampling = pa.array([None, {"logprobs": 1000}], pa.struct([("logprobs", pa.int64())]))
    pq.write_table(pa.table({"prompt": ["one two", "three four"], "sampling": sampling}), inp)
    cfg = job_config(llama_ckpt, inp, tmp_path / "out", sampling={"logprobs": 100000})
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert (
        res.exit_code == EXIT_CONFIG
        and "sampling.logprobs=100000 is more than engine.max_logprobs=20" in (res.message)
    )
    cfg = job_config(llama_ckpt, inp, tmp_path / "out", sampling={"logprobs": 2})
    cfg.run.max_error_fraction = 1.0
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    out = read_parts(tmp_path / "out").to_pydict()
    assert out["status"] == ["ok", "error"] and "logprobs=1000 is more than" in out["error"][1]


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"n": 3}, "sampling.n=3 does not apply to task=score"),
        ({"beam_width": 2}, "sampling.beam_width=2 does not apply to task=score"),
        ({"regex": "a+"}, "structured outputs (sampling.json_schema/regex/choice/grammar) do not apply"),
    ],
)
def test_score_refuses_sampling_that_does_not_apply(sampling: dict, message: str, tmp_path: Path) -> None:
    cfg = job_config("unused", tmp_path / "in.parquet", tmp_path / "out", sampling=sampling)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(dataclasses.replace(cfg, task="score"))
    validate(cfg)  # the same sampling is fine for generation
