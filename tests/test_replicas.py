"""A job over several engine replicas (``engine.data_parallel_size``): output identical to one engine, exactly
once; a replica killed with SIGKILL mid-run is replaced and its windows rerun elsewhere; past
``run.max_replica_restarts`` the job exits 75 and a rerun completes exactly once; uneven windows."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, part_contents, read_parts

import batchgen.job.replicas.run as replicas_run
from batchgen.engine.core.stats import EngineStats
from batchgen.job.replicas.coordinator import combine_stats
from batchgen.job.replicas.local import LocalReplicas
from batchgen.job.run import EXIT_INTERRUPTED, EXIT_OK, run_job

PREFIXES = ["Summarise the report on river levels in spring:", "Translate to French: good morning and"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """27 rows: windows of 8 rows are uneven (8, 8, 8, 3), and row 5 asks for many more tokens."""
    root = tmp_path_factory.mktemp("replica_data")
    rows = [{"uid": f"u{i:02d}", "prompt": f"{PREFIXES[i % 2]} item {i}", "sampling": {"max_tokens": 6}}
            for i in range(27)]  # fmt: skip
    rows[5]["sampling"] = {"max_tokens": 40}
    pq.write_table(pa.Table.from_pylist(rows), root / "in.parquet")
    return root / "in.parquet"


@pytest.fixture(scope="module")
def single(llama_ckpt: str, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of the same job on one engine in the job's own process."""
    out = tmp_path_factory.mktemp("single") / "out"
    res = run_job(_cfg(llama_ckpt, dataset, out), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK
    return out


def _cfg(ckpt: str, inp: Path, out: Path, dp: int = 1, restarts: int = 3):
    cfg = job_config(ckpt, inp, out, data={"id_column": "uid"}, engine={"data_parallel_size": dp})
    cfg.run.max_replica_restarts = restarts
    return cfg


class ReportingReplicas(LocalReplicas):
    """Local replicas; replica ``victim`` reports after every engine step (``step_budget_s=0``), so that its
    first reports leave rows unfinished however fast the machine (row 5 alone takes 40 steps)."""

    def __init__(self, victim: int = 0) -> None:
        super().__init__()
        self.victim = victim

    def start(self, setup) -> None:
        super().start(replace(setup, step_budget_s=0.0) if setup.replica == self.victim else setup)


class KillingReplicas(ReportingReplicas):
    """SIGKILLs replica ``victim``'s process after its ``after``-th report that leaves rows unfinished (some
    of its rows are back, its windows are not), then, up to ``times`` kills, each replacement as it starts
    (before its engine is ready)."""

    def __init__(self, victim: int = 0, after: int = 1, times: int = 1) -> None:
        super().__init__(victim)
        self.after, self.times, self.reports, self.killed = after, times, 0, 0

    def events(self, timeout: float):
        out = super().events(timeout)
        for kind, r, payload in out:
            if r != self.victim or self.killed >= self.times:
                continue
            if kind == "report" and payload.busy and not self.killed:
                self.reports += 1
                if self.reports >= self.after:
                    self._kill(r)
        return out

    def start(self, setup) -> None:
        super().start(setup)
        if setup.replica == self.victim and 0 < self.killed < self.times:
            self._kill(setup.replica)  # a replacement, killed while it starts

    def _kill(self, r: int) -> None:
        os.kill(self.pid(r), signal.SIGKILL)
        self.killed += 1


def _rows_exactly_once(out: Path, n: int) -> None:
    ids = read_parts(out).column("id").to_pylist()
    assert sorted(ids) == [f"u{i:02d}" for i in range(n)]


def test_two_replicas_identical_to_one_engine(llama_ckpt: str, dataset: Path, single: Path, tmp_path: Path):
    res = run_job(
        _cfg(llama_ckpt, dataset, tmp_path / "out", dp=2), handle_signals=False, print_summary=False
    )
    assert res.exit_code == EXIT_OK, res.message
    assert part_contents(tmp_path / "out") == part_contents(single)
    _rows_exactly_once(tmp_path / "out", 27)
    reps = res.report["replicas"]
    assert [r["replica"] for r in reps] == [0, 1] and sum(r["rows"] for r in reps) == 27
    assert res.report["run"]["rows"] == 27 and res.report["tokens"]["generated"] > 0


def test_sigkilled_replica_is_replaced(llama_ckpt, dataset, single, tmp_path, monkeypatch):
    """A SIGKILL mid-window (rows of its windows unfinished) is absorbed: the windows go back to the queue, a
    replacement starts (1 of run.max_replica_restarts=1), and the output is identical to one engine's."""
    killer = KillingReplicas(victim=0, after=1, times=1)
    monkeypatch.setattr(replicas_run, "make_executor", lambda cfg: killer)
    out = tmp_path / "out"
    res = run_job(_cfg(llama_ckpt, dataset, out, dp=2, restarts=1), handle_signals=False, print_summary=False)
    assert killer.killed == 1
    assert res.exit_code == EXIT_OK, res.message
    assert part_contents(out) == part_contents(single)
    _rows_exactly_once(out, 27)


def test_sigkilled_replica_past_the_bound_exits_75_and_rerun_completes(
    llama_ckpt, dataset, single, tmp_path, monkeypatch
):
    """With run.max_replica_restarts=0, the first loss of a replica with unfinished windows is past the
    bound: exit 75 with every finished row saved; a rerun completes exactly once."""
    killer = KillingReplicas(victim=0, after=1, times=1)
    monkeypatch.setattr(replicas_run, "make_executor", lambda cfg: killer)
    out = tmp_path / "out"
    res = run_job(_cfg(llama_ckpt, dataset, out, dp=2, restarts=0), handle_signals=False, print_summary=False)
    assert killer.killed == 1
    assert res.exit_code == EXIT_INTERRUPTED, res.message
    assert "run.max_replica_restarts=0" in res.message and "1 replica(s) lost" in res.message
    monkeypatch.undo()
    res = run_job(_cfg(llama_ckpt, dataset, out, dp=1), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    assert part_contents(out) == part_contents(single)
    _rows_exactly_once(out, 27)


def test_combined_stats_sum_counters_and_pools() -> None:
    a = EngineStats(num_blocks=10, kv_blocks_used=5, generated_tokens=7, peak_kv_usage=0.5, block_size=16)
    b = EngineStats(num_blocks=30, kv_blocks_used=5, generated_tokens=3, peak_kv_usage=0.9, block_size=16)
    c = combine_stats([a, b])
    assert (c.num_blocks, c.generated_tokens, c.peak_kv_usage, c.kv_usage) == (40, 10, 0.9, 0.25)


def test_llm_refuses_data_parallel_and_score_jobs_refuse_replicas(llama_ckpt, dataset, tmp_path) -> None:
    from batchgen.errors import ConfigError
    from batchgen.job.config import validate
    from batchgen.llm import LLM

    with pytest.raises(ValueError, match="batchgen.ray.Generator"):
        LLM(llama_ckpt, data_parallel_size=2)
    cfg = _cfg(llama_ckpt, dataset, tmp_path / "out", dp=2)
    cfg.task = "score"
    with pytest.raises(ConfigError, match="task=score runs on one engine"):
        validate(cfg)


def test_replica_resources(llama_ckpt, dataset, tmp_path, monkeypatch) -> None:
    """CUDA: replica i takes visible devices [i*T, (i+1)*T); CPU: the cores are split between replicas."""
    from batchgen.errors import ConfigError

    cfg = _cfg(llama_ckpt, dataset, tmp_path / "out", dp=3)
    cfg.engine.device = "cuda"
    cfg.engine.tensor_parallel_size = 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2")
    setups = replicas_run.replica_setups(cfg, llama_ckpt)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in setups] == ["4,5", "6,7", "0,1"]
    assert all(s.engine.device == "cuda" and s.engine.data_parallel_size == 1 for s in setups)
    cfg.engine.data_parallel_size = 4
    with pytest.raises(ConfigError, match="needs 8 GPUs; 7 are visible"):
        replicas_run.replica_setups(cfg, llama_ckpt)
    cfg.engine.device, cfg.engine.tensor_parallel_size, cfg.engine.data_parallel_size = "cpu", 1, 2
    monkeypatch.setattr(replicas_run, "_cpu_count", lambda: 16)
    assert [(s.threads, s.env) for s in replicas_run.replica_setups(cfg, llama_ckpt)] == [(8, {}), (8, {})]


class StoppingReplicas(ReportingReplicas):
    """SIGSTOPs replica 0 after its first report that leaves rows unfinished (it stays alive but silent: no
    report, no heartbeat)."""

    def __init__(self) -> None:
        super().__init__(victim=0)
        self.stopped = 0

    def events(self, timeout: float):
        out = super().events(timeout)
        for kind, r, payload in out:
            if r == self.victim and kind == "report" and payload.busy and not self.stopped:
                os.kill(self.pid(r), signal.SIGSTOP)
                self.stopped = self.pid(r)
        return out


def test_a_silent_replica_is_declared_lost_and_its_windows_requeued(
    llama_ckpt, dataset, single, tmp_path, monkeypatch
):
    from batchgen.job.replicas import coordinator

    monkeypatch.setattr(coordinator, "SILENT_S", 3.0)
    stopper = StoppingReplicas()
    monkeypatch.setattr(replicas_run, "make_executor", lambda cfg: stopper)
    out = tmp_path / "out"
    res = run_job(_cfg(llama_ckpt, dataset, out, dp=2, restarts=1), handle_signals=False, print_summary=False)
    assert stopper.stopped
    assert res.exit_code == EXIT_OK, res.message
    assert part_contents(out) == part_contents(single)
    _rows_exactly_once(out, 27)
