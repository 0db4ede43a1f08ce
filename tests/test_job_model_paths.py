"""Every job task on both model roads: native code (Llama) and transformers' modeling code (GPT-2, OLMo 2),
chosen by ``model.implementation`` exactly as ``LLM`` chooses it; outputs equal transformers' own."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import model_zoo
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import job_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.job.run import EXIT_CONFIG, EXIT_OK, run_job

PROMPTS = ["The quick brown fox", "def main():", "Once upon a time there"]
CONTINUATIONS = [" jumps over", " return 0", " was a king"]


def _read(directory: Path) -> dict:
    parts = sorted(directory.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]).sort_by("id").to_pydict()


@functools.cache
def _hf(ckpt: str):
    return AutoTokenizer.from_pretrained(ckpt), AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32
    ).eval()


def _ckpt(arch: str, llama_ckpt: str) -> str:
    return llama_ckpt if arch == "llama" else model_zoo.checkpoint(arch)


def _hf_greedy(ckpt: str, prompt: str, max_tokens: int) -> list[int]:
    tok, model = _hf(ckpt)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, ids.shape[1] :].tolist()


def _hf_loglikelihood(ckpt: str, context: str, continuation: str) -> float:
    tok, model = _hf(ckpt)
    ctx = tok(context).input_ids
    whole = tok(context + continuation).input_ids
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    return float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("paths") / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "continuation": CONTINUATIONS}), path)
    return path


ROADS = [("llama", "auto"), ("gpt2", "auto"), ("olmo2", "transformers")]


@pytest.mark.parametrize(("arch", "impl"), ROADS)
def test_generate_on_every_model_road(
    llama_ckpt: str, inputs: Path, tmp_path: Path, arch: str, impl: str
) -> None:
    ckpt = _ckpt(arch, llama_ckpt)
    cfg = job_config(ckpt, inputs, tmp_path / "out", sampling={"temperature": 0.0, "max_tokens": 4})
    cfg.sampling.ignore_eos = True
    cfg.model.implementation = impl
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    out = _read(tmp_path / "out")
    assert out["status"] == ["ok"] * len(PROMPTS)
    assert out["token_ids"][0] == _hf_greedy(ckpt, PROMPTS[0], 4)


@pytest.mark.parametrize(("arch", "impl"), ROADS)
def test_score_on_every_model_road(
    llama_ckpt: str, inputs: Path, tmp_path: Path, arch: str, impl: str
) -> None:
    ckpt = _ckpt(arch, llama_ckpt)
    cfg = job_config(ckpt, inputs, tmp_path / "out")
    cfg = dataclasses.replace(
        cfg, task="score", data=dataclasses.replace(cfg.data, continuation_column="continuation")
    )
    cfg.model.implementation = impl
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    out = _read(tmp_path / "out")
    assert out["status"] == ["ok"] * len(PROMPTS)
    want = _hf_loglikelihood(ckpt, PROMPTS[1], CONTINUATIONS[1])
    assert out["loglikelihood"][1] == pytest.approx(want, abs=1e-3)


def test_native_only_refuses_a_generic_architecture_before_loading(inputs: Path, tmp_path: Path) -> None:
    cfg = job_config(model_zoo.checkpoint("gpt2"), inputs, tmp_path / "out")
    cfg.model.implementation = "native"
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_CONFIG
    assert "GPT2LMHeadModel" in res.message and "model.implementation=transformers" in res.message
