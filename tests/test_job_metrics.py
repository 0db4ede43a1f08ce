"""Prometheus metrics of a running job: scraped over HTTP while it runs, and the node-exporter textfile."""

from __future__ import annotations

import socket
import threading
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import EngineAtStep, job_config
from prometheus_client.parser import text_string_to_metric_families

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.job.run import run_job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels or set(s.labels) == {"le"} and s.labels["le"] == "+Inf":
                out[s.name] = s.value
    return out


def test_metrics_scraped_while_the_job_runs(tiny_ckpt: str, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    shared = "You are a helpful assistant. Answer the question in one short sentence, please. "
    pq.write_table(
        pa.table({"prompt": [shared + f"Question {i}: what is {i} + {i}?" for i in range(12)]}), inp
    )
    port = _free_port()
    textfile = tmp_path / "node" / "batchgen.prom"
    textfile.parent.mkdir()
    cfg = job_config(tiny_ckpt, inp, tmp_path / "out", data={"window_rows": 4}, engine={"max_num_seqs": 2})
    cfg.run.metrics_port = port
    cfg.run.metrics_file = str(textfile)
    scraped: list[dict[str, float]] = []
    got = threading.Event()

    def scrape() -> None:  # a Prometheus server's view: poll /metrics until one scrape shows work
        while not got.is_set():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            s = _samples(text)
            scraped.append(s)
            if s.get("batchgen:generation_tokens_total", 0) > 0 and s.get("batchgen:job_rows_done", 0) > 0:
                got.set()

    engine = LLMEngine(tiny_ckpt, EngineConfig(device="cpu", num_blocks=256, max_num_seqs=2))
    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    waiting = EngineAtStep(engine, 12, lambda: got.wait(30))  # hold the job mid-run until a scrape saw work
    result = run_job(cfg, engine=waiting, handle_signals=False, print_summary=False)
    got.set()
    thread.join(10)
    assert result.exit_code == 0
    mid = next(s for s in scraped if s.get("batchgen:job_rows_done", 0) > 0)
    assert 0 < mid["batchgen:job_rows_done"] < 12  # taken while the job ran
    assert mid["batchgen:job_rows_total"] == 12
    for name in ("batchgen:prompt_tokens_total", "batchgen:generation_tokens_total",
                 "batchgen:kv_cache_usage_perc", "batchgen:num_requests_running", "batchgen:num_requests_waiting",
                 "batchgen:prefix_cache_hits_total", "batchgen:prefix_cache_queries_total",
                 "batchgen:time_to_first_token_seconds_count", "batchgen:time_per_output_token_seconds_count",
                 "batchgen:job_error_rows", "batchgen:job_windows_committed", "batchgen:job_eta_seconds"):  # fmt: skip
        assert name in mid, name
    assert mid["batchgen:time_per_output_token_seconds_count"] > 0
    # the textfile holds the final figures, in the same format
    final = _samples(textfile.read_text())
    assert final["batchgen:job_rows_done"] == 12 and final["batchgen:job_eta_seconds"] == 0
    assert final["batchgen:job_windows_committed"] == 3
    assert final["batchgen:time_to_first_token_seconds_count"] == 12
    assert final["batchgen:prefix_cache_hits_total"] > 0
    assert final["batchgen:generation_tokens_total"] == engine.stats.generated_tokens
    assert not list(textfile.parent.glob("*.tmp*"))  # written atomically
    # vLLM's exposition: counters, gauges and histograms with buckets, and nothing else
    types = {f.name: f.type for f in text_string_to_metric_families(textfile.read_text())}
    assert types["batchgen:generation_tokens"] == types["batchgen:prefix_cache_hits"] == "counter"
    assert types["batchgen:kv_cache_usage_perc"] == types["batchgen:job_eta_seconds"] == "gauge"
    assert types["batchgen:time_to_first_token_seconds"] == "histogram"
    assert not [n for n in types if n.endswith("_created")]
    for name in ("batchgen:generation_tokens_total", "batchgen:prompt_tokens_total"):  # counters only grow
        seen = [s[name] for s in scraped if name in s] + [final[name]]
        assert seen == sorted(seen), name
    # the server is gone once the job returns
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
        served = True
    except OSError:
        served = False
    assert not served


def test_a_port_in_use_or_an_unwritable_textfile_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from batchgen.job.metrics import JobMetrics

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        textfile = tmp_path / "missing" / "batchgen.prom"
        with caplog.at_level("WARNING", logger="batchgen.metrics"):
            m = JobMetrics(busy.getsockname()[1], str(textfile))
            m.write_textfile()
            m.write_textfile()
            m.close()
    assert m.port is None and m.server is None  # the job runs on without the endpoint
    lines = [r.getMessage() for r in caplog.records]
    assert sum("run.metrics_port" in x and "run.metrics_port=0" in x for x in lines) == 1
    assert sum("cannot write run.metrics_file" in x for x in lines) == 1  # once, not at every rewrite


def test_the_live_eta_takes_only_a_plan_of_this_configuration(tmp_path: Path) -> None:
    import json
    from types import SimpleNamespace

    from batchgen.job.plan_report import planned_work

    plan = {"fingerprint": "abc", "rows": {"total": 10},
            "predicted": {"prompt_tokens_to_compute": 100, "output_tokens": 50}}  # fmt: skip
    (tmp_path / "_plan.json").write_text(json.dumps(plan))
    outdir = SimpleNamespace(path=tmp_path)
    assert planned_work(outdir, "abc").output_tokens == 50
    assert planned_work(outdir, "another configuration") is None


def test_dashboard_charts_only_exported_metrics() -> None:
    import json
    import re

    from batchgen.job.metrics import JobMetrics

    root = Path(__file__).resolve().parents[1]
    dash = json.loads((root / "jobs" / "grafana" / "batchgen-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"batchgen:[a-z_]+", e)}
    exported = set()
    for fam in text_string_to_metric_families(JobMetrics().text()):
        exported |= {s.name for s in fam.samples} | {fam.name}
    assert used and used <= exported, used - exported


def test_eta_counts_the_tokens_that_remain() -> None:
    from batchgen.engine.core.stats import EngineStats
    from batchgen.job.eta import PlannedWork, TokenETA

    # the plan: 10 rows, 1000 prompt tokens to compute, 2000 output tokens; half of each done in 10 s of steps
    eta = TokenETA(10, 0, PlannedWork(10, 1000.0, 2000.0))
    eta.step(EngineStats(), 0.0, 0.0)
    for i in range(1, 11):  # steps of 50 prefill + 100 decode tokens, 1 s each
        eta.step(EngineStats(prompt_tokens_computed=50 * i, generated_tokens=100 * i), 1.0, float(i))
    # rows x mean would say 10 s more for 5 rows left after 5 done; the tokens left say the same work: 10 s
    assert eta.eta_s(5) == pytest.approx(10.0, rel=0.05)
    # a long tail: 9 of 10 rows done but only half the tokens: still 10 s, not 10 s / 9
    assert eta.eta_s(9) == pytest.approx(10.0, rel=0.05)
    assert eta.eta_s(10) == 0.0


def test_progress_line_shows_errors_and_the_eta(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from batchgen.engine.core.stats import EngineStats
    from batchgen.job.eta import PlannedWork
    from batchgen.job.progress import Progress

    caplog.set_level(logging.INFO, logger="batchgen.progress")
    p = Progress(total=10, mode="log", interval_s=1e-9, planned=PlannedWork(10, 100.0, 1000.0))
    p.update(0, stats=EngineStats())
    p.update(1, errors=1)
    p.update(1, stats=EngineStats(prompt_tokens=20, prompt_tokens_computed=20, generated_tokens=200))
    line = caplog.records[-1].getMessage()
    assert "2/10 rows" in line and "errors 1" in line
    eta = line.rsplit("ETA ", 1)[1]
    assert eta != "?" and p.eta_s() > 0


@pytest.mark.parametrize("task", ["score", "embed"])
def test_prompt_only_jobs_feed_the_endpoint_while_they_run(
    tiny_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str
) -> None:
    """task=score / embed / classify run a window at a time outside the generation loop: each committed window
    still reaches /metrics (rows done and total, error rows, windows, the engine's prompt tokens) and the
    progress display's error count."""
    import dataclasses

    import pooling_zoo as zoo

    from batchgen.job import pool, score
    from batchgen.job.config import PoolingOptions

    texts = [f"text number {i} to read" for i in range(8)]
    texts[1] = ""  # an error row
    pq.write_table(pa.table({"prompt": texts, "completion": [" yes"] * 8}), tmp_path / "in.parquet")
    port = _free_port()
    model = tiny_ckpt if task == "score" else zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=11)
    cfg = job_config(model, tmp_path / "in.parquet", tmp_path / "out", data={"window_rows": 4})
    cfg.run.metrics_port = port
    cfg.run.max_error_fraction = 1.0
    if task == "score":
        cfg = dataclasses.replace(
            cfg, task="score", data=dataclasses.replace(cfg.data, continuation_column="completion")
        )
    else:
        cfg = dataclasses.replace(cfg, task="embed", pooling=PoolingOptions(method="mean"))
    module = score if task == "score" else pool
    real_commit = module.commit_window
    seen: list[dict[str, float]] = []

    def commit(*a, **kw):  # before the second window's commit: what a scrape shows of the first
        if len(seen) == 0 and getattr(commit, "calls", 0) == 1:
            seen.append(
                _samples(
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                )
            )
        commit.calls = getattr(commit, "calls", 0) + 1
        return real_commit(*a, **kw)

    monkeypatch.setattr(module, "commit_window", commit)
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    mid = seen[0]
    assert mid["batchgen:job_rows_total"] == 8 and mid["batchgen:job_rows_done"] == 4
    assert mid["batchgen:job_windows_committed"] == 1 and mid["batchgen:job_error_rows"] == 1
    assert mid["batchgen:job_eta_seconds"] > 0
    if task == "score":
        assert mid["batchgen:prompt_tokens_total"] > 0


def test_eta_charges_long_prompts_left_at_the_plans_token_costs() -> None:
    """Short prompts' prefill steps cost mostly per sequence, so a per-token fit over them overprices the long
    prompts of a length tail; with the dry run's calibrated costs the ETA weighs the tokens left by those costs
    and scales them by the run's own pace."""
    from batchgen.engine.core.stats import EngineStats
    from batchgen.job.eta import PlannedWork, TokenETA

    # 10 rows: 8 of 5 prompt tokens, 2 of 1000; 10 output tokens each; calibrated 1e-4 s / prompt token and
    # 1e-2 s / output token
    eta = TokenETA(10, 0, PlannedWork(10, 2040.0, 100.0, 1e-4, 1e-2))
    eta.step(EngineStats(), 0.0, 0.0)
    p = d = 0
    t = 0.0
    for i in range(
        8
    ):  # the short rows: a prefill step costs 0.05 s more than a decode step, whatever its size
        p, d = p + (5 if i % 2 == 0 else 0), d + 10
        dt = 0.15 if i % 2 == 0 else 0.1
        t += dt
        eta.step(EngineStats(prompt_tokens_computed=p, generated_tokens=d), dt, t)
    # left: 2020 prompt tokens (0.2 s at the calibrated cost) and 20 output tokens (0.2 s); the run went at
    # about the plan's pace: well under a second, not 2020 x the 0.01 s a prompt token cost so far
    assert 0.2 < eta.eta_s(8) < 1.0


def test_latency_histograms_over_replicas_count_each_engines_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over replicas the step count is the engines' sum and the job sees only some of those steps: a token's
    time is a replica's step time (not the wall time over the summed steps), and a request's first token comes
    (n - 1) of its own engine's steps before its last, not at its end."""
    from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
    from batchgen.engine.core.stats import EngineStats
    from batchgen.job import metrics

    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    m = metrics.JobMetrics()
    m.step(EngineStats(), ["a"], engines=2)
    for i in range(1, 11):  # two engines, 0.1 s per step each, one token each per step
        clock[0] += 0.1
        m.step(EngineStats(num_steps=2 * i, generated_tokens=2 * i), ["a"], engines=2)
    out = RequestOutput(request_id="a", prompt="", prompt_token_ids=[1],
                        outputs=[CompletionOutput(0, "", list(range(10)), "length")])  # fmt: skip
    m.finished(out, 20)
    s = _samples(m.text())
    assert s["batchgen:e2e_request_latency_seconds_sum"] == pytest.approx(1.0)
    assert s["batchgen:time_to_first_token_seconds_sum"] == pytest.approx(0.1)
    tpot = s["batchgen:time_per_output_token_seconds_sum"] / s["batchgen:time_per_output_token_seconds_count"]
    assert tpot == pytest.approx(0.1)
