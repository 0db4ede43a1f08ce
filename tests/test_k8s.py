"""The Kubernetes Indexed Job example (jobs/k8s/) and the shard defaults it relies on: pod i of N
(``JOB_COMPLETION_INDEX`` / ``JOB_COMPLETIONS``) processes shard i of N, like task i of a Slurm array."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module

from batchgen.data.reader import shard_range
from batchgen.errors import ConfigError
from batchgen.job.config import to_job_config
from batchgen.job.hydra_setup import register_configs, register_resolvers
from batchgen.job.shard_env import missing_count_message, shard_from_env

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "k8s" / "generate-indexed-job.yaml"
ENV = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "JOB_COMPLETION_INDEX", "JOB_COMPLETIONS",
       "SUBMITIT_EXECUTOR")  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    register_configs()
    register_resolvers()


def _shard(overrides: list[str] | None = None) -> tuple[int, int]:
    with initialize_config_module(config_module="batchgen.conf", version_base="1.3"):
        job = to_job_config(compose(config_name="config", overrides=overrides or []))
    return job.data.shard.index, job.data.shard.count


def test_mapping_from_the_environment() -> None:
    assert (shard_from_env("index", {}), shard_from_env("count", {})) == (0, 1)
    k8s = {"JOB_COMPLETION_INDEX": "3", "JOB_COMPLETIONS": "8"}
    assert (shard_from_env("index", k8s), shard_from_env("count", k8s)) == (3, 8)
    both = {**k8s, "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}  # a Slurm array comes first
    assert (shard_from_env("index", both), shard_from_env("count", both)) == (1, 2)
    sweep = {**both, "SUBMITIT_EXECUTOR": "slurm"}  # a submitit sweep's array is not a shard array
    assert (shard_from_env("index", sweep), shard_from_env("count", sweep)) == (3, 8)
    with pytest.raises(ValueError, match="JOB_COMPLETIONS"):
        shard_from_env("count", {"JOB_COMPLETION_INDEX": "3"})
    assert shard_from_env("index", {"JOB_COMPLETION_INDEX": "3"}) == 3  # with an explicit data.shard.count
    assert "JOB_COMPLETIONS" in missing_count_message({"JOB_COMPLETION_INDEX": "3"})
    assert missing_count_message(k8s) is None and missing_count_message({}) is None


def test_pods_of_an_indexed_job_cover_every_row_once(monkeypatch: pytest.MonkeyPatch) -> None:
    n, rows = 4, 103
    covered: list[int] = []
    monkeypatch.setenv("JOB_COMPLETIONS", str(n))
    for i in range(n):
        monkeypatch.setenv("JOB_COMPLETION_INDEX", str(i))
        index, count = _shard()
        assert (index, count) == (i, n)
        start, end = shard_range(rows, index, count)
        covered += range(start, end)
    assert covered == list(range(rows))
    assert _shard(["data.shard.count=2", "data.shard.index=1"]) == (1, 2)  # explicit overrides win


def test_a_pod_without_the_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    with pytest.raises(ConfigError, match="JOB_COMPLETIONS"):
        _shard()


def test_example_job_is_indexed_and_consistent() -> None:
    job = yaml.safe_load(EXAMPLE.read_text())
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["JOB_COMPLETIONS"]) == spec["completions"]
    assert container["command"] == ["batchgen"]
    args = dict(a.split("=", 1) for a in container["args"])
    assert "data.shard.index" not in args and "data.shard.count" not in args  # from the environment
    assert int(args["engine.data_parallel_size"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert pod["restartPolicy"] == "Never"
    exits = {
        r["action"]: r["onExitCodes"]["values"]
        for r in spec["podFailurePolicy"]["rules"]
        if "onExitCodes" in r
    }
    assert exits == {"Ignore": [75], "FailJob": [2]}


def test_cli_refuses_a_pod_without_the_count_in_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env["JOB_COMPLETION_INDEX"] = "1"
    cmd = [sys.executable, "-m", "batchgen.cli", f"data.output={tmp_path / 'out'}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "JOB_COMPLETIONS" in p.stderr
    assert not (tmp_path / "out").exists()
