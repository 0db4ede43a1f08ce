"""The dry run: a plan read from the input as the job reads it, its prefix-cache prediction checked against
the engine, its sharing notes, the Python API, and the report's prediction section after the real run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, read_parts
from s3_server import S3, s3, s3_endpoint  # noqa: F401 - fixtures

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.job.calibrate import CalibrationRow, StepModel, fit_step_model
from batchgen.job.prefix_sim import simulate_prefix_cache
from batchgen.job.run import run_job
from batchgen.job.schedule_sim import SimRequest, simulate_schedule
from batchgen.job.tally import error_key
from batchgen.sampling_params import SamplingParams

INSTRUCTION = (
    "Answer the question below in one short sentence. Be precise, cite no sources and do not repeat "
    "the question. Keep the answer under twenty words. "
)


def _engine(ckpt: str, **kw) -> LLMEngine:
    return LLMEngine(
        ckpt, EngineConfig(device="cpu", num_blocks=256, max_num_seqs=kw.pop("max_num_seqs", 4), **kw)
    )


def test_prefix_cache_simulation_matches_the_engine(tiny_ckpt: str) -> None:
    engine = _engine(tiny_ckpt)
    tok = engine.tokenizer
    texts = [INSTRUCTION + f"Question {i}: what is {i} times {i + 3}?" for i in range(6)] + ["x" * 40, "abc"]
    prompts = [tok.encode(t) for t in texts]
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_tokens=2, temperature=0))
        while engine.has_unfinished():  # one at a time: each sees every block registered before it
            engine.step()
    sim = simulate_prefix_cache(prompts, engine.stats.block_size)
    assert sim.cached_tokens == engine.stats.prompt_tokens_cached
    assert sim.copied_tokens == engine.stats.prompt_tokens_copied
    assert sim.hit_rate == pytest.approx(engine.stats.prefix_hit_rate)


def test_rows_asking_for_prompt_logprobs_read_nothing_from_the_cache(tiny_ckpt: str) -> None:
    # every prompt token's logprob needs its logits: such a row computes its whole prompt (and still fills the
    # cache for the rows after it); the plan's hit rate is the engine's
    from batchgen.job.dry_run import PlanInput, PlanRow

    engine = _engine(tiny_ckpt)
    prompts = [engine.tokenizer.encode(INSTRUCTION + f"Question {i}?") for i in range(6)]
    params = [
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1 if i % 2 else None) for i in range(6)
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(i, p, sp)
        while engine.has_unfinished():
            engine.step()
    inp = PlanInput(rows_total=6, block_size=engine.stats.block_size, max_model_len=engine.max_model_len)
    inp.add_window([PlanRow(i, i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))], list(range(6)))
    assert list(inp.cached)[1::2] == [0, 0, 0] and sum(inp.cached) > 0
    assert sum(inp.cached) == engine.stats.prompt_tokens_cached
    assert inp.hit_rate == pytest.approx(engine.stats.prefix_hit_rate)


def test_a_structured_output_job_is_calibrated(tiny_ckpt: str, tmp_path: Path) -> None:
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cfg = job_config(tiny_ckpt, _input(tmp_path, 12), tmp_path / "out", sampling={"json_schema": schema})
    cfg.run.dry_run = True
    res = run_job(cfg, engine=_engine(tiny_ckpt), handle_signals=False, print_summary=False)
    assert res.exit_code == 0, res.message
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert plan["predicted"]["wall_time_s"] > 0 and plan["calibration"]["rows"] >= 1


def test_schedule_simulation_and_step_model() -> None:
    unit = StepModel((1.0, 0.0, 0.0, 0.0))
    # one request: its prefill step gives the first token, then 4 decode steps
    assert simulate_schedule([SimRequest(10, 10, 5)], unit, 4, 4096, None).steps == 5
    # four at once under a cap of 2: two rounds of 5 steps
    reqs = [SimRequest(10, 10, 5) for _ in range(4)]
    assert simulate_schedule(reqs, unit, 2, 4096, None).seconds == pytest.approx(10.0)
    # a token budget of 8 splits a 20-token prompt into 3 chunks
    assert simulate_schedule([SimRequest(20, 20, 1)], unit, 4, 8, None).steps == 3
    m = fit_step_model([(p, d, 0.0, 0.01 + 0.001 * p + 0.002 * d) for p in (0, 5, 40) for d in (1, 3, 8)])
    assert (
        m.coef[0] == pytest.approx(0.01)
        and m.coef[1] == pytest.approx(0.001)
        and m.coef[2] == pytest.approx(0.002)
    )


def _input(tmp_path: Path, n: int = 24) -> Path:
    prompts: list[str | None] = [INSTRUCTION + f"Question {i}: what is {i} plus {2 * i}?" for i in range(n)]
    prompts[5] = None  # an error row
    prompts[9] = ""
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": prompts, "key": [f"k{i}" for i in range(n)]}), inp)
    return inp


def test_dry_run_plans_without_touching_the_output_then_the_report_compares(
    tiny_ckpt: str, tmp_path: Path
) -> None:
    inp = _input(tmp_path)
    out = tmp_path / "out"
    cfg = job_config(tiny_ckpt, inp, out, data={"window_rows": 8, "id_column": "key"})
    cfg.run.dry_run = True
    cfg.plan.cost_per_hour = 2.0
    res = run_job(cfg, engine=_engine(tiny_ckpt), handle_signals=False, print_summary=False)
    assert res.exit_code == 0 and res.status == "planned"
    assert sorted(p.name for p in out.iterdir()) == ["_plan.json"]  # no rows, no manifest, no lock
    plan = json.loads((out / "_plan.json").read_text())
    assert plan["rows"] == {"total": 24, "sampled": 24, "valid": 22, "error": 2}
    assert sum(e["rows"] for e in plan["errors"].values()) == 2
    assert sorted(i for e in plan["errors"].values() for i in e["first_ids"]) == ["k5", "k9"]
    tok = _engine(tiny_ckpt).tokenizer
    valid = [INSTRUCTION + f"Question {i}: what is {i} plus {2 * i}?" for i in range(24) if i not in (5, 9)]
    lens = [len(tok.encode(t)) for t in valid]
    assert plan["prompt_tokens"]["total"] == sum(lens) and plan["prompt_tokens"]["max"] == max(lens)
    pred = plan["predicted"]
    assert plan["output_tokens"]["bound"] == 22 * 6
    assert 0 < pred["output_tokens"] <= 22 * 6
    assert (
        pred["wall_time_s"] > 0
        and pred["wall_time_range_s"][0] < pred["wall_time_s"] < pred["wall_time_range_s"][1]
    )
    assert pred["cost"] == pytest.approx(pred["device_hours"] * 2.0)
    assert plan["calibration"]["rows"] >= 2
    cal = plan["calibration"]
    assert cal["fraction_of_predicted"] == pytest.approx(cal["seconds"] / pred["wall_time_s"], rel=0.05)
    assert cal["budget_fraction"] == 0.05 and cal["batch_steps"] >= 1 and cal["budget_s"] >= 0
    assert plan["memory"]["kv_bytes_per_token"] > 0 and plan["recommended"]["engine.max_num_seqs"] >= 1
    assert "character" in plan["sharing"]["first_difference"]
    # the real job, on a fresh engine: the report sets the prediction beside what happened
    cfg.run.dry_run = False
    res = run_job(cfg, engine=_engine(tiny_ckpt), handle_signals=False, print_summary=False)
    assert res.exit_code == 0
    report = json.loads((out / "_report.json").read_text())
    p = report["prediction"]
    assert p["prefix_hit_rate"]["predicted"] == pytest.approx(report["tokens"]["prefix_hit_rate"], abs=0.02)
    assert p["prompt_tokens"]["actual"] == p["prompt_tokens"]["predicted"]
    assert p["wall_time_s"]["actual"] == report["run"]["wall_time_s"] and "error" in p["wall_time_s"]
    assert p["engine_steps"]["actual"] == report["scheduler"]["steps"]
    assert p["engine_steps"]["predicted"] == plan["predicted"]["schedule"]["steps"] > 0
    assert p["load"]["plan"] == plan["calibration"]["load"] and p["load"]["run"] >= 0  # why a run deviated
    from batchgen.job.report import format_table

    assert "planned wall time" in format_table(report) and "planned engine steps" in format_table(report)
    # a dry run over changed input: the plan says the job would refuse the output, which stays as it is
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.name != "_plan.json"}
    pq.write_table(pa.table({"prompt": ["another input"], "key": ["k0"]}), inp)
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    (warning,) = json.loads((out / "_plan.json").read_text())["warnings"]
    assert "would refuse this output (exit status 2)" in warning and "different input data" in warning
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.name != "_plan.json"} == before


def test_sample_rows_and_sharing_notes(tiny_ckpt: str, tmp_path: Path) -> None:
    # a per-row field before a long shared instruction: the plan says what to move first
    rows = [f"Ticket {i * 7919 % 1000}: " + INSTRUCTION + f"Topic {i}." for i in range(32)]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": rows}), inp)
    cfg = job_config(tiny_ckpt, inp, tmp_path / "out", data={"window_rows": 8})
    cfg.run.dry_run = True
    cfg.plan.sample_rows = 8
    cfg.plan.calibrate = False
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert plan["rows"]["total"] == 32 and plan["rows"]["sampled"] == 8
    assert plan["predicted"]["wall_time_s"] is None  # no calibration: tokens and memory only
    run = plan["sharing"]["shared_run"]
    assert run["rows_fraction"] == 1.0 and run["first_char"] > 0 and "Answer the question" in run["text"]
    assert run["hit_rate_if_first"] > plan["predicted"]["prefix_hit_rate"] + 0.3
    assert any("put that text after them" in n for n in plan["sharing"]["notes"])


def test_chat_system_prompt_that_differs_is_named(qwen2_ckpt: str, tmp_path: Path) -> None:
    msgs = [
        [{"role": "system", "content": f"Today is 2026-01-{i + 10:02d}. " + INSTRUCTION},
         {"role": "user", "content": f"What is {i} + {i}?"}]
        for i in range(6)
    ]  # fmt: skip
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(m) for m in msgs]}), inp)
    cfg = job_config(qwen2_ckpt, inp, tmp_path / "out", data={"messages_column": "messages"})
    cfg.run.dry_run = True
    cfg.plan.calibrate = False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert "message 0 (system)" in plan["sharing"]["first_difference"]
    # the instruction after the date: found in the rendered prompt, named by its message
    run = plan["sharing"]["shared_run"]
    assert "message 0 (system)" in run["where"] and "Answer the question" in run["text"]
    assert run["hit_rate_if_first"] > plan["predicted"]["prefix_hit_rate"] + 0.3


def test_a_shared_run_is_what_most_rows_hold_not_what_two_share_by_chance() -> None:
    from batchgen.job.prefix_sim import shared_run_after_start

    # the rows compared first share by chance the id's last digit before the shared text and the question's
    # first word after it; the run is the shared text most rows hold
    words = ["Which", "How", "Where", "Why", "When", "Who", "Name", "Give"]
    texts = [
        f"Request {1000 + (10 if i == 8 else i)}. " + INSTRUCTION
        + ("What" if i in (0, 8) else words[i % 8]) + f" is {i}?"
        for i in range(16)
    ]  # fmt: skip
    run, held, first_char = shared_run_after_start(texts)
    assert held == 1.0 and INSTRUCTION.strip() in run and "0" not in run and "What" not in run
    assert first_char == texts[0].index(run) > 0


def test_the_first_windows_one_time_setup_is_start_up_not_work(
    tiny_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first window pays a one-time set-up (as a chat template's first render loads the tokenizer): the job
    # reads it before its work starts, so the plan counts it in the start-up, not once per later window
    import time

    import batchgen.data.prompts as prompts

    build, calls = prompts.build_prompts, []

    def slow_first(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.5)
        return build(*args, **kwargs)

    monkeypatch.setattr(prompts, "build_prompts", slow_first)
    cfg = job_config(tiny_ckpt, _input(tmp_path, 32), tmp_path / "out", data={"window_rows": 8})
    cfg.run.dry_run = True
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    pred = json.loads((tmp_path / "out" / "_plan.json").read_text())["predicted"]
    assert len(calls) == 4 and pred["startup_s"] >= 1.5 and pred["wall_time_s"] < 0.8


def test_llm_plan(tiny_ckpt: str) -> None:
    from batchgen import LLM

    llm = LLM(tiny_ckpt, device="cpu", num_blocks=256, max_num_seqs=4)
    prompts = [INSTRUCTION + f"Question {i}?" for i in range(10)]
    plan = llm.plan(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert plan.wall_time_s is not None and plan.wall_time_s > 0
    assert plan["rows"]["total"] == 10 and plan["output_tokens"]["bound"] == 40
    assert 0 < plan.prefix_hit_rate < 1
    assert "predicted wall time" in str(plan)
    # the same setup again: the step model starts from the steps the first calibration timed
    assert plan["calibration"]["reused_steps"] == 0
    again = llm.plan(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert again["calibration"]["reused_steps"] == plan["calibration"]["steps"]
    assert (
        again["calibration"]["steps"]
        == again["calibration"]["reused_steps"] + again["calibration"]["batch_steps"]
    )
    # steps timed at another thread count are another machine's speed: not reused
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        other = llm.plan(prompts, SamplingParams(max_tokens=4, temperature=0))
    finally:
        torch.set_num_threads(threads)
    assert other["calibration"]["reused_steps"] == 0
    # and steps timed through another sampler path (drawn with top-k, log-probabilities): not reused either
    drawn = llm.plan(prompts, SamplingParams(max_tokens=4, temperature=0.8, top_k=5, logprobs=2))
    assert drawn["calibration"]["reused_steps"] == 0
    off = LLM(tiny_ckpt, device="cpu", num_blocks=256, max_num_seqs=4, enable_prefix_caching=False)
    plan = off.plan(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert plan.prefix_hit_rate == 0.0
    outs = off.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) == 0


def test_dry_run_reads_and_writes_an_object_store(tiny_ckpt: str, s3) -> None:  # noqa: ANN001, F811
    s3.put_table("in/a.parquet", pa.table({"prompt": [INSTRUCTION + f"Question {i}?" for i in range(10)]}))
    cfg = job_config(tiny_ckpt, s3.url("in/"), s3.url("out"))
    cfg.run.dry_run = True
    cfg.plan.calibrate = False
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == 0, res.message
    assert s3.keys("out/") == ["out/_plan.json"]  # no manifest, no lease, no part
    plan = json.loads(s3.get("out/_plan.json"))
    assert plan["rows"]["total"] == 10 and plan["predicted"]["prefix_hit_rate"] > 0.3
    # the job then runs into the same output, the plan beside it
    cfg.run.dry_run = False
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == 0, res.message
    report = json.loads(s3.get("out/_report.json"))
    assert report["rows"]["ok"] == 10
    hit = report["prediction"]["prefix_hit_rate"]
    assert hit["predicted"] == pytest.approx(hit["actual"], abs=0.05)


def test_a_sample_of_windows_counts_the_cold_cache_once(tiny_ckpt: str, tmp_path: Path) -> None:
    # the first window starts on an empty cache: a sample of 2 of 10 windows must not count its misses as a
    # fifth of the job
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [INSTRUCTION + f"Question {i}?" for i in range(40)]}), inp)
    rates, compute = {}, {}
    for sample in (None, 8, 1000):  # every row, a sample, more than the rows
        cfg = job_config(tiny_ckpt, inp, tmp_path / f"out{sample}", data={"window_rows": 4})
        cfg.run.dry_run, cfg.plan.calibrate, cfg.plan.sample_rows = True, False, sample
        assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
        plan = json.loads((tmp_path / f"out{sample}" / "_plan.json").read_text())
        assert plan["rows"]["total"] == 40 and plan["rows"]["sampled"] == (8 if sample == 8 else 40)
        rates[sample] = plan["predicted"]["prefix_hit_rate"]
        # the tokens whole cached blocks do not serve (computed, or copied from a block another row's output
        # filled: which rows' outputs fill one depends on the windows sampled)
        compute[sample] = (
            plan["predicted"]["prompt_tokens_to_compute"] + plan["predicted"]["prompt_tokens_copied"]
        )
    assert rates[1000] == rates[None] and compute[1000] == compute[None]
    assert rates[8] == pytest.approx(rates[None], abs=0.02)
    assert compute[8] == pytest.approx(compute[None], rel=0.05)


def test_each_replica_has_its_own_prefix_cache() -> None:
    from batchgen.job.dry_run import PlanInput, PlanRow

    shared = list(range(100, 148))  # three blocks of 16 every row shares
    windows = [[shared + [w, i] for i in range(3)] for w in range(4)]
    inp = PlanInput(rows_total=12, block_size=16, max_model_len=512, replicas=2)
    for w in windows:
        inp.add_window([PlanRow(i, i, t, SamplingParams(max_tokens=2)) for i, t in enumerate(w)], [0, 1, 2])
    # windows 0 and 2 on one replica, 1 and 3 on the other: each pays the shared blocks once
    parts = [simulate_prefix_cache(windows[k] + windows[k + 2], 16) for k in (0, 1)]
    assert inp.hit_rate == pytest.approx(sum(p.cached_tokens for p in parts) / sum(inp.lens))
    assert inp.hit_rate < simulate_prefix_cache([t for w in windows for t in w], 16).hit_rate


def test_a_shard_of_an_array_plans_its_slice_and_estimates_the_array(tiny_ckpt: str, tmp_path: Path) -> None:
    inp = _input(tmp_path, 16)
    cfg = job_config(tiny_ckpt, inp, tmp_path / "out", data={"shard": {"index": 1, "count": 2}})
    cfg.run.dry_run = True
    cfg.plan.cost_per_hour = 1.0
    assert run_job(cfg, engine=_engine(tiny_ckpt), handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "shard-00001-of-00002" / "_plan.json").read_text())
    assert plan["shard"]["row_start"] == 8 and plan["rows"]["total"] == 8
    alls = plan["predicted"]["all_shards"]
    assert alls["shards"] == 2 and alls["rows"] == 16
    assert alls["device_hours"] == pytest.approx(2 * plan["predicted"]["device_hours"])


def test_replicas_on_the_cpu_are_calibrated_at_their_share_of_the_cores(
    tiny_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each of N local CPU replicas computes with cores // N threads: the calibration times steps so, then the
    # dry run's process has its own threads back
    import os

    import torch

    import batchgen.job.replicas.run as replicas_run

    monkeypatch.setattr(replicas_run, "_cpu_count", lambda: 6)
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    cfg = job_config(tiny_ckpt, _input(tmp_path, 16), tmp_path / "out", engine={"data_parallel_size": 3})
    cfg.run.dry_run = True
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert plan["calibration"]["threads"] == 2
    assert torch.get_num_threads() == before and os.environ.get("OMP_NUM_THREADS") == env


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_plan_sizes_kv_in_the_caches_dtype(llama_ckpt: str, tmp_path: Path, kv_dtype: str) -> None:
    # without calibration no engine: bytes per token come from the checkpoint's config and the cache's dtype,
    # and must equal what the engine allocates
    cfg = job_config(
        llama_ckpt, _input(tmp_path), tmp_path / "out",
        engine={"num_blocks": None, "kv_cache_memory": "1MiB", "kv_cache_dtype": kv_dtype},
    )  # fmt: skip
    cfg.run.dry_run = True
    cfg.plan.calibrate = kv_dtype == "auto"  # then the dry run starts the engine itself and times it
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    mem = plan["memory"]
    if cfg.plan.calibrate:
        pred = plan["predicted"]
        assert pred["startup_s"] > 0 and pred["total_time_s"] == pred["startup_s"] + pred["wall_time_s"]
    else:
        assert plan["predicted"]["startup_s"] is None
    engine = LLMEngine(llama_ckpt, EngineConfig(device="cpu", num_blocks=16, kv_cache_dtype=kv_dtype))
    per_token = engine.stats.bytes_per_block // engine.stats.block_size
    assert mem["kv_bytes_per_token"] == per_token and mem["kv_cache_dtype"] == kv_dtype
    assert mem["kv_pool_tokens"] == (1 << 20) // per_token  # a narrower cache holds proportionally more
    assert mem["sequences_that_fit"] == pytest.approx(mem["kv_pool_tokens"] / 25, rel=0.5)


def test_plan_weights_bytes_follow_model_dtype(llama_ckpt: str, tmp_path: Path) -> None:
    from batchgen.job.dry_run import _weights_bytes, checkpoint_dtype, kv_element_bytes

    stored = sum(f.stat().st_size for f in Path(llama_ckpt).glob("*.safetensors"))
    ck = checkpoint_dtype(llama_ckpt)
    assert _weights_bytes(llama_ckpt, "auto") == stored
    half = _weights_bytes(llama_ckpt, "bfloat16")
    assert half == (stored // 2 if ck == "float32" else stored)
    assert kv_element_bytes("auto", "bfloat16", llama_ckpt, on_cpu=True) == 4  # computed in float32 on a CPU
    assert kv_element_bytes("auto", "bfloat16", llama_ckpt, on_cpu=False) == 2
    assert kv_element_bytes("fp8_e5m2", "auto", llama_ckpt, on_cpu=False) == 1


def test_calibration_keeps_to_its_budget_and_a_small_sample_widens_the_range(tiny_ckpt: str) -> None:
    from batchgen.job.calibrate import FULL_SAMPLE_STEPS, MIN_BATCH_STEPS, relative_spread, run_calibration

    engine = _engine(tiny_ckpt, max_num_seqs=8)
    params = SamplingParams(max_tokens=FULL_SAMPLE_STEPS + 8, temperature=0.8, seed=1, ignore_eos=True)
    rows = [
        CalibrationRow(i, engine.tokenizer.encode(INSTRUCTION + f"Question {i}?"), params, (0, 0))
        for i in range(24)
    ]
    # a budget already spent (a job far shorter than the warm-up): the floor of steps, then it stops
    spent = run_calibration(engine, rows, len(rows), lambda cal: 0.0, batch=8)
    assert spent.batch_steps == MIN_BATCH_STEPS and spent.rows < len(rows) and "budget" in spent.note
    assert spent.seconds >= spent.warmup_seconds > 0 and spent.budget == 0.0
    assert len(spent.observations) >= spent.rows  # the rows cut short are censored observations, kept
    # an ample budget: every row runs to its end, at the job's concurrency
    ample = run_calibration(engine, rows[:8], 8, lambda cal: 1e9, batch=8)
    assert ample.rows == 8 and not ample.note and ample.concurrency == 8
    assert ample.batch_steps >= FULL_SAMPLE_STEPS
    # the same machine load for both (the load's own term is not what this compares)
    spent, ample = dataclasses.replace(spent, load=None), dataclasses.replace(ample, load=None)
    assert relative_spread(spent, params.max_tokens) > relative_spread(ample, params.max_tokens) + 0.05


def test_a_calibration_short_of_the_jobs_concurrency_probes_its_decode_steps(
    tiny_ckpt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a budget that admits a few rows of a job running 16 at once: the probe times decode steps at 16
    # sequences over contexts of the rows' length, their prompts a prefix cache hit but for one token each
    from batchgen.job.calibrate import PROBE_TOKENS, _probe_concurrency, fit_step_model, run_calibration

    engine = _engine(tiny_ckpt, max_num_seqs=16)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True)
    rows = [
        CalibrationRow(i, engine.tokenizer.encode(INSTRUCTION + f"Question {i}?"), params, (0, 0))
        for i in range(24)
    ]
    steps: list = [(40.0, 4.0, 0.0, 0.006), (0.0, 4.0, 160.0, 0.0025)] * 3
    assert fit_step_model(steps).coef[2] == 0  # decode steps at one batch size: the cost per sequence unknown
    assert _probe_concurrency(engine, rows, 16, 4, 10.0, steps) == 16
    probe = [s for s in steps if s[1] == 16]
    assert len(probe) == PROBE_TOKENS  # the prefill step's tokens, then the decode steps
    mean = sum(len(r.token_ids) for r in rows) / len(rows)
    assert probe[0][0] == 16 and all(s[2] >= 16 * (mean - 16) for s in probe[1:])
    assert fit_step_model(steps).coef[2] > 0
    # not worth it (the batch reached half the job's concurrency) or not affordable: no probe
    assert _probe_concurrency(engine, rows, 16, 8, 10.0, steps) == 0
    assert _probe_concurrency(engine, rows, 16, 4, 0.0, steps) == 0
    # within a calibration: its budget spent at once (the probe allowed whatever this machine's speed), the
    # probe runs unless the batch reached 8 all the same
    monkeypatch.setattr("batchgen.job.calibrate.PROBE_MIN_S", 1e9)
    cal = run_calibration(engine, rows, len(rows), lambda cal: 0.0, batch=16)
    assert cal.probe_seqs == (16 if cal.concurrency < 8 else 0)
    assert run_calibration(engine, rows[:16], 16, lambda cal: 1e9, batch=16).probe_seqs == 0


def test_the_warm_up_is_a_one_time_cost_added_once_per_engine(tiny_ckpt: str) -> None:
    # a fresh engine's first batch (lazy initialisation, first writes into the KV pool) is timed apart: left
    # out of the step model, its excess over the model is added to each replica's time once
    from batchgen.job.calibrate import Calibration, _overhead, run_calibration
    from batchgen.job.dry_run import _simulate_parts

    engine = _engine(tiny_ckpt, max_num_seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rows = [
        CalibrationRow(i, engine.tokenizer.encode(f"Question {i} " * 8), params, (0, 0)) for i in range(4)
    ]
    cal = run_calibration(engine, rows, 4, lambda cal: 1e9, batch=4)
    # the first timed step is the one-sequence request's prefill (of the last row, less the blocks the warm-up
    # cached): the warm-up's steps are not there
    p, d = cal.timed_steps[0][:2]
    assert d == 1.0 and 0 < p <= len(rows[-1].token_ids) and cal.first_calls_s >= 0
    model = StepModel((0.01, 0.0, 0.0, 0.0))
    assert _overhead(model, [(0.0, 1.0, 0.0, 0.02)] * 10) == pytest.approx(2.0)
    assert _overhead(model, [(0.0, 1.0, 0.0, 0.005)] * 10) == 1.0  # never under the model
    reqs = [SimRequest(8, 8, 4) for _ in range(8)]
    inp = dataclasses.make_dataclass("Inp", ["window_sizes", "block_size"])([4, 4], 16)
    ecfg = EngineConfig(device="cpu", max_num_seqs=4)
    base = Calibration(model)
    times, *_ = _simulate_parts(reqs, base, inp, ecfg, 1.0, 2, None)
    once, *_ = _simulate_parts(reqs, dataclasses.replace(base, first_calls_s=0.5), inp, ecfg, 1.0, 2, None)
    assert [b - a for a, b in zip(times, once)] == pytest.approx([0.5, 0.5])
    # LLM.plan: the rows run on the calibrated engine itself, which paid them
    paid = dataclasses.replace(base, first_calls_s=0.5, first_calls_paid=True)
    assert _simulate_parts(reqs, paid, inp, ecfg, 1.0, 2, None)[0] == pytest.approx(times)


def test_the_sampling_signature_names_the_samplers_path_not_the_rows_values() -> None:
    from batchgen.job.calibrate import sampling_signature

    greedy, drawn = SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0.7, top_p=0.9)
    assert sampling_signature([greedy]) == sampling_signature(
        [SamplingParams(temperature=0, max_tokens=90, seed=3)]
    )
    assert len(sampling_signature([greedy, drawn, drawn, None])) == 2
    assert sampling_signature([drawn]) != sampling_signature([dataclasses.replace(drawn, logprobs=1)])
    assert sampling_signature([greedy]) != sampling_signature(
        [dataclasses.replace(greedy, choice=["a", "b"])]
    )
    assert sampling_signature([greedy, object()])  # a prompt-only job's rows: named by their kind, sortable


def test_a_resumed_run_is_compared_with_its_part_of_the_plan() -> None:
    from batchgen.job.plan_report import prediction_lines, prediction_section

    plan = {"rows": {"total": 24}, "predicted": {"wall_time_s": 6.0, "wall_time_range_s": [3.0, 9.0],
            "prompt_tokens": 1200, "prompt_tokens_to_compute": 300, "output_tokens": 240, "prefix_hit_rate": 0.7,
            "schedule": {"steps": 60, "preemptions": 0}}}  # fmt: skip
    report = {"run": {"rows": 16, "wall_time_s": 4.0}, "scheduler": {"steps": 41, "preemptions": 0},
              "tokens": {"prompt_admitted": 800, "prompt_computed": 200, "generated": 160}}  # fmt: skip
    p = prediction_section(plan, report)
    assert p["fraction_of_plan"] == pytest.approx(2 / 3)
    assert p["prompt_tokens"] == {"predicted": 800, "actual": 800}
    assert p["generated_tokens"]["predicted"] == 160 and p["engine_steps"]["predicted"] == 40
    assert p["wall_time_s"]["predicted"] == pytest.approx(4.0) and p["wall_time_s"]["inside_range"]
    assert "planned for this run" in dict(prediction_lines(p))
    report["run"]["rows"] = 24  # every planned row in this run: the plan as it is
    assert "fraction_of_plan" not in prediction_section(plan, report)
    # over replicas the run's threads are the replicas' (the coordinator computes nothing)
    report["replicas"] = [{"replica": 0, "threads": 3}, {"replica": 1, "threads": 3}]
    assert prediction_section(plan, report)["load"]["threads_run"] == 3


def test_a_dry_run_on_a_started_output_plans_what_is_left(tiny_ckpt: str, tmp_path: Path) -> None:
    # an earlier run stopped with windows committed and rows of an unfinished window checkpointed: the plan
    # covers the rows the job has left to do, and says so; the resumed run is compared with all of it
    from conftest import signal_after

    out = tmp_path / "out"
    cfg = job_config(tiny_ckpt, _input(tmp_path, 24), out, data={"window_rows": 4, "id_column": "key"})
    cfg.run.checkpoint_interval_s = 0
    res = run_job(cfg, engine=signal_after(_engine(tiny_ckpt, max_num_seqs=8), at=12), print_summary=False)
    assert res.exit_code == 75, res.message
    manifest = json.loads((out / "_manifest.json").read_text())
    cfg.run.dry_run = True
    assert run_job(cfg, engine=_engine(tiny_ckpt), handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((out / "_plan.json").read_text())
    resume = plan["resume"]
    assert resume["windows_done"] == len(manifest["windows"]) and resume["windows"] == 6
    assert (
        0 < resume["rows_done"] and resume["rows_left"] == plan["rows"]["total"] == 24 - resume["rows_done"]
    )
    assert plan["shard"]["windows"] == resume["windows_left"]
    cfg.run.dry_run = False
    report = run_job(cfg, engine=_engine(tiny_ckpt), handle_signals=False, print_summary=False).report
    p = report["prediction"]
    assert "fraction_of_plan" not in p and report["run"]["rows"] == plan["rows"]["total"]
    assert p["prompt_tokens"]["predicted"] == p["prompt_tokens"]["actual"]


@pytest.mark.parametrize(
    ("sampling", "sequences"), [({"n": 2}, 2), ({"beam_width": 3, "temperature": 0.0}, 3)]
)
def test_output_bound_counts_each_rows_max_tokens_and_sequences(
    tiny_ckpt: str, tmp_path: Path, sampling: dict, sequences: int
) -> None:
    # per-row max_tokens from the sampling column; every sample, and every beam (the engine generates them all)
    max_tokens = [1, 2, 3, None, 2, 1]
    table = pa.table({"prompt": [INSTRUCTION + f"Question {i}?" for i in range(6)],
                      "sampling": [{"max_tokens": m} for m in max_tokens]})  # fmt: skip
    pq.write_table(table, tmp_path / "in.parquet")
    cfg = job_config(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "out", sampling=sampling)
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert plan["output_tokens"]["bound"] == sequences * sum(m or 6 for m in max_tokens)


@pytest.mark.parametrize(
    ("engine", "sampling"),
    [({"num_blocks": 2}, {}), ({}, {"beam_width": 12, "temperature": 0.0})],
    ids=["pool too small", "beams over max_num_seqs"],
)
def test_rows_the_engine_would_refuse_are_error_rows(
    tiny_ckpt: str, tmp_path: Path, engine: dict, sampling: dict
) -> None:
    cfg = job_config(tiny_ckpt, _input(tmp_path, 12), tmp_path / "out", engine=engine, sampling=sampling)
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert plan["rows"] == {"total": 12, "sampled": 12, "valid": 0, "error": 12}
    refused = max(plan["errors"].values(), key=lambda e: e["rows"])
    assert refused["rows"] == 10  # the two others are a null and an empty prompt
    # the job's error rows say the same (written as error rows rather than stopping the job)
    cfg.run.dry_run, cfg.run.max_error_fraction = False, 1.0
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    errors = [error_key(r["error"]) for r in read_parts(tmp_path / "out").to_pylist()]
    assert errors.count(error_key(refused["example"])) == 10


@pytest.mark.parametrize("prompts", [[None, "", None], []], ids=["only error rows", "empty input"])
def test_a_plan_with_no_row_to_run(tiny_ckpt: str, tmp_path: Path, prompts: list) -> None:
    pq.write_table(pa.table({"prompt": pa.array(prompts, pa.string())}), tmp_path / "in.parquet")
    cfg = job_config(tiny_ckpt, tmp_path / "in.parquet", tmp_path / "out")
    cfg.run.dry_run, cfg.plan.cost_per_hour = True, 2.0
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert plan["rows"]["error"] == len(prompts) and plan["rows"]["valid"] == 0
    pred = plan["predicted"]
    assert (pred["wall_time_s"], pred["wall_time_range_s"], pred["cost"]) == (0.0, [0.0, 0.0], 0.0)
    assert "engine.max_num_seqs" not in plan["recommended"]  # nothing runs: no advice on running it
    assert [("exit status 2" in w) for w in plan["warnings"]] == ([True] if prompts else [])
    cfg.run.dry_run = False  # which the job confirms
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == (2 if prompts else 0)


def test_a_last_block_an_output_fills_is_copied_by_later_rows(tiny_ckpt: str, tmp_path: Path) -> None:
    """Rows differing inside their last block: once a row's output fills that block the engine registers it,
    and rows admitted later copy its prompt part instead of computing it; the plan counts those copies (it
    counted only blocks full at admission, and predicted about 3x the tokens the job computed)."""
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"short {i}" for i in range(48)]}), inp)
    cfg = job_config(tiny_ckpt, inp, tmp_path / "out", data={"window_rows": 4}, engine={"max_num_seqs": 4},
                     sampling={"max_tokens": 16, "ignore_eos": True})  # fmt: skip
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    predicted = json.loads((tmp_path / "out" / "_plan.json").read_text())["predicted"]
    cfg.run.dry_run = False
    assert (
        run_job(
            cfg, engine=_engine(tiny_ckpt, max_num_seqs=4), handle_signals=False, print_summary=False
        ).exit_code
        == 0
    )
    tokens = json.loads((tmp_path / "out" / "_report.json").read_text())["tokens"]
    assert tokens["prompt_copied"] > tokens["prompt_computed"] / 2  # the workload copies
    assert predicted["prompt_tokens_copied"] == pytest.approx(tokens["prompt_copied"], rel=0.25)
    assert predicted["prompt_tokens_to_compute"] == pytest.approx(tokens["prompt_computed"], rel=0.25)


def test_a_dry_run_removes_the_temporary_plan_a_killed_one_left(tmp_path: Path) -> None:
    """A dry run killed while writing ``_plan.json`` left its temporary file: the next one removes it."""
    from types import SimpleNamespace

    from batchgen.data.local_storage import LocalLocation
    from batchgen.job.plan_report import write_plan

    out = tmp_path / "out"
    out.mkdir()
    (out / ".tmp-_plan.json.5e1f0c2a").write_text('{"rows": ')  # cut off by the kill
    write_plan(SimpleNamespace(loc=LocalLocation(out), path=out), {"rows": {"total": 1}})
    assert sorted(p.name for p in out.iterdir()) == ["_plan.json"]
    assert json.loads((out / "_plan.json").read_text()) == {"rows": {"total": 1}}
