"""Smoke test of the throughput benchmark: tiny model, 8 rows, 4 tokens, 1 repeat, HF systems included, with
the greedy equality check (``check=true``; on CPU only the torch backend runs, against transformers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import link_shared_kernels

from batchgen.bench.common import kv_bytes_per_token, layer_params, llama_13b, model_flops, num_params
from batchgen.bench.workloads import WORKLOADS, WorkloadSpec, describe, make_workload
from batchgen.models.config import ModelConfig


def test_flop_count_matches_hand_count() -> None:
    mc = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "intermediate_size": 16,
            "vocab_size": 10,
        }
    )
    lp = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16
    assert layer_params(mc) == lp
    # prompt 3 (1 cached), 2 generated: forwards positions 1, 2 (prefill) and 3 (decode)
    pairs = 2 + 3 + 4
    want = 2 * 2 * lp * 3 + 2 * 8 * 10 * 2 + 4 * 2 * 4 * 2 * pairs
    assert model_flops(mc, 3, 1, 2) == want
    assert kv_bytes_per_token(mc) == 2 * 2 * 4 * 4  # K and V, 2 layers, 1 KV head of 4, float32


def test_llama_13b_shapes() -> None:
    mc = llama_13b()
    assert kv_bytes_per_token(mc) == 819_200
    assert 12.9e9 < num_params(mc) < 13.1e9


def test_workloads_are_deterministic(tmp_path) -> None:
    from batchgen.models.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    for name in WORKLOADS:
        spec = WorkloadSpec(rows=12, max_tokens=8, seed=3)
        a, b = make_workload(name, spec, tok), make_workload(name, spec, tok)
        assert a.equals(b)
        info = describe(a)
        assert info["rows"] == 12
        ids = a.column("prompt_token_ids").to_pylist()
        assert ids == tok(a.column("prompt").to_pylist())["input_ids"]
        if name == "shared_prefix":
            tmpl = a.column("template").to_pylist()
            group = [p for p, t in zip(ids, tmpl) if t == tmpl[0]]
            assert len(os.path.commonprefix(group)) >= 250  # the template is a token prefix
        if name == "long_tail":
            assert "sampling" in a.column_names
            assert a.column("sampling").to_pylist()[0]["max_tokens"] == a.column("max_tokens")[0].as_py()


@pytest.mark.timeout(180)
def test_throughput_smoke(tmp_path) -> None:
    out = tmp_path / "bench"
    link_shared_kernels(tmp_path / "cache")
    env = dict(os.environ, BATCHGEN_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "batchgen.bench.throughput",
        "workload=long_tail",
        "rows=8",
        "max_tokens=4",
        "repeats=1",
        "threads=1",
        "matmul_seconds=0.02",
        "device=cpu",
        f"output_dir={out}",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.intermediate_size=64",
        "engine.kv_cache_memory=1MiB",  # 4,096 token slots: every row of the workload at once
        "systems=[batchgen,hf_generate,hf_generate_batch,vllm]",
        f"python.vllm={tmp_path / 'no-venv' / 'bin' / 'python'}",
        "check=true",
        "check_max_tokens=8",
        "settle_max_s=0",  # beside other tests: the figures do not matter here
        "check_model.hidden_size=32",
        "check_model.num_layers=1",
        "check_model.num_heads=2",
        "check_model.num_kv_heads=1",
        "check_model.intermediate_size=64",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "cache"]  # nothing written elsewhere
    for f in ("results.json", "results.md"):
        assert (out / f).is_file(), f
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        for f in ("throughput.png", "timeline_long_tail.png"):
            assert (out / f).is_file(), f
    assert pq.read_table(out / "workloads" / "long_tail.parquet").num_rows == 8
    res = json.loads((out / "results.json").read_text())
    systems = res["workloads"]["long_tail"]["systems"]
    for name in ("batchgen", "hf_generate", "hf_generate_batch"):
        s = systems[name]
        assert s["status"] == "ok", s
        assert s["mismatch_rows"] == 0, (name, s.get("mismatch_examples"))
        assert s["generated_tokens_produced"] == s["generated_tokens"]
        assert s["gen_tok_s"] > 0 and 0 < s["mfu"] < 1
    assert systems["vllm"]["status"] == "skipped" and "not found" in systems["vllm"]["reason"]
    assert systems["batchgen"]["via"].startswith("pipeline")
    assert systems["batchgen"]["kv_sizing"]["source"] == "engine.kv_cache_memory=1MiB"
    steps = systems["batchgen"]["engine_stats"]["num_steps"]
    assert len(res["workloads"]["long_tail"]["timeline"]["rows"]) >= steps > 0  # the step listener
    check = res["greedy_check"]
    assert check["passed"] and check["mismatching_prompts"] == {"torch vs transformers": 0}
    assert "| batchgen |" in (out / "results.md").read_text()
    assert "| batchgen |" in proc.stdout


def test_ct2_system_skips_with_reason_without_ctranslate2(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.bench import ct2, systems

    monkeypatch.setattr(ct2, "missing_reason", lambda: "ctranslate2 is not installed (test)")
    res = systems.run({"system": "ct2", "threads": 1, "device": "cpu"})
    assert res["status"] == "skipped" and "ctranslate2" in res["reason"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ct2_system_matches_transformers(tmp_path) -> None:
    """CTranslate2 (float32, converted from the same checkpoint) gives transformers' greedy tokens."""
    pytest.importorskip("ctranslate2", reason="the bench-ct2 extra (ctranslate2) is not installed")
    out = tmp_path / "bench"
    link_shared_kernels(tmp_path / "cache")
    env = dict(os.environ, BATCHGEN_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "batchgen.bench.throughput", "workload=long_tail", "rows=8", "max_tokens=4"]
    cmd += ["repeats=1", "threads=1", "matmul_seconds=0.02", "device=cpu", f"output_dir={out}"]
    cmd += ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1"]
    cmd += ["model.intermediate_size=64", "systems=[hf_generate,ct2]", "ct2_batch_sizes=[4,8]"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "results.json").read_text())["workloads"]["long_tail"]["systems"]["ct2"]
    assert s["status"] == "ok", s
    assert s["mismatch_rows"] == 0, s.get("mismatch_examples")
    assert s["settings"]["max_batch_size"] in (4, 8)
    assert set(s["settings"]["batch_size_sweep_tok_s"]) == {"4", "8"}


def test_unique_prompt_lengths_follow_the_range(tmp_path) -> None:
    from batchgen.bench.throughput import ThroughputConfig, run_benchmark
    from batchgen.models.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok")
    table = make_workload("unique", WorkloadSpec(rows=20, max_tokens=8, min_prompt=16, max_prompt=40), tok)
    lens = [len(x) for x in table.column("prompt_token_ids").to_pylist()]
    assert 16 <= min(lens) and max(lens) <= 41
    with pytest.raises(ValueError, match="prompt_tokens"):
        run_benchmark(ThroughputConfig(prompt_tokens=[40, 16], output_dir=str(tmp_path / "o")))


def test_a_system_starts_once_the_previous_ones_processes_have_left() -> None:
    """`launch.settle` waits while other processes keep the CPUs busy (here: busy loops that stop after 1.5 s,
    as a previous system's processes do while they exit), and returns at once with no time to wait."""
    import time

    from batchgen.bench import launch

    n = (os.cpu_count() or 1) + 1
    code = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    loops = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        time.sleep(0.3)
        waited, _ = launch.settle(max_s=5.0)
        assert waited >= 0.7
    finally:
        for p in loops:
            p.kill()
            p.wait()
    waited, _ = launch.settle(max_s=0.0)
    assert waited < 2.0
