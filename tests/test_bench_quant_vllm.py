"""vLLM's rows of ``batchgen.bench.quant_formats``: the same checkpoint directory, prompt ids and thread count as
batchgen's run, through ``batchgen.bench.vllm_child`` under another interpreter (here a fake ``vllm``); a
checkpoint vLLM refuses, a missing interpreter and ``--drain`` give ``skipped`` rows with the reason."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
from vllm_helpers import fake_vllm_interpreter

from batchgen.bench import quant_formats
from batchgen.bench.quant import Run, bench_model, bench_prompts, peer_agreement


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return bench_model(tmp_path_factory.mktemp("quant-vllm"), argparse.Namespace(hidden=64, layers=1))


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(
        **{"prompt": 8, "new": 3, "drain": False, "vllm_compile": False, "vllm_timeout": 120, **kw}
    )


def _ours(batch: int) -> Run:
    """A batchgen run whose tokens are the fake vLLM's for the first prompt only."""
    prompts = bench_prompts(batch, _args())
    tokens = [[(p[-1] + i + 1) % 100 for i in range(3)] for p in prompts]
    tokens[1:] = [[0, 0, 0] for _ in tokens[1:]]
    return Run(tok_s=1.0, tok_per_cpu_s=1.0, weight_bytes=0, decoder_weight_bytes=0, tokens=tokens)


def test_vllm_runs_the_same_checkpoint_and_prompts(model, tmp_path) -> None:
    exe = fake_vllm_interpreter(tmp_path)
    row = quant_formats.vllm_row(str(exe), "float32", model, 2, _args(), _ours(2), tmp_path)
    assert row["system"] == "vLLM float32" and row["seqs"] == 2, row
    assert row["tok_s"] > 0 and row["tok_per_cpu_s"] > 0
    assert row["build"].startswith("vllm 0.0-fake LLM.generate on token ids (eager)")
    theirs = [[(p[-1] + i + 1) % 100 for i in range(3)] for p in bench_prompts(2, _args())]
    assert {k: row[k] for k in ("greedy_agreement_with_batchgen", "first_token_agreement")} == peer_agreement(
        theirs, _ours(2).tokens
    )
    assert row["greedy_agreement_with_batchgen"] == 0.5
    tag = f"{Path(model).name}-2"
    spec = json.loads((tmp_path / f"{tag}.spec.json").read_text())
    assert spec["model_path"] == model and spec["dtype"] == "auto"
    assert spec["token_ids"] == bench_prompts(2, _args()) and spec["max_tokens"] == [3, 3]
    assert len(spec["omp_threads_bind"].split(",")) == row["threads"] == spec["threads"]
    res = json.loads((tmp_path / f"{tag}.result.json").read_text())
    assert res["settings"]["VLLM_CPU_OMP_THREADS_BIND"] == spec["omp_threads_bind"]
    assert res["settings"]["kv_cache_memory_bytes"] <= 2**29 and len(res["cpu_s"]) == 1


def test_a_checkpoint_vllm_refuses_is_skipped_with_its_root_cause(model, tmp_path) -> None:
    exe = fake_vllm_interpreter(tmp_path)
    refused = shutil.copytree(model, tmp_path / "refused")
    row = quant_formats.vllm_row(str(exe), "x", str(refused), 2, _args(), _ours(2), tmp_path)
    assert row == {
        "system": "vLLM x",
        "seqs": 2,
        "skipped": "vLLM refuses it: ValueError: no kernel for this format",
    }


def test_a_vllm_process_past_the_timeout_is_an_error_row(model, tmp_path) -> None:
    exe = fake_vllm_interpreter(tmp_path)
    hangs = shutil.copytree(model, tmp_path / "hangs-forever")
    args = _args(vllm_timeout=1.5)
    row = quant_formats.vllm_row(str(exe), "x", str(hangs), 2, args, _ours(2), tmp_path)
    assert row["error"] == "vLLM's process timed out after 1.5 s (--vllm-timeout)"


def test_without_vllm_or_with_drain_the_rows_say_skipped(model, tmp_path) -> None:
    missing = tmp_path / "no" / "python"
    row = quant_formats.vllm_row(str(missing), "x", model, 2, _args(), _ours(2), tmp_path)
    assert row["skipped"] == f"no interpreter {missing} (--vllm-python)"
    row = quant_formats.vllm_row(str(missing), "x", model, 2, _args(drain=True), _ours(2), tmp_path)
    assert row["skipped"].startswith("--drain")


def test_root_cause_is_vllms_first_exception_in_one_line() -> None:
    log = "\n".join(
        [
            "(EngineCore pid=4) INFO 12-05 05:54:30 [core.py:1] starting",
            "(Worker pid=5) ERROR 12-05 05:54:30 [multiproc_executor.py:953] Traceback (most recent call last):",
            "(Worker pid=5) ERROR 12-05 05:54:30 [multiproc_executor.py:953] ValueError: Failed to find a kernel. "
            "Reasons: ",
            "(Worker pid=5) ERROR 12-05 05:54:30 [multiproc_executor.py:953] ",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert quant_formats.root_cause(log) == "ValueError: Failed to find a kernel. Reasons"
    pydantic = (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
        "  Value error, desc_act=True is no longer supported. [type=value_error, input_value=...]\n"
    )
    assert quant_formats.root_cause(pydantic) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig "
        "Value error, desc_act=True is no longer supported."
    )
    assert quant_formats.root_cause("INFO all fine\n") is None
