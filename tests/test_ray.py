"""batchgen on Ray: ``batchgen.ray.Generator`` (a Ray Data ``map_batches`` stage) equals ``LLM.generate``;
``run.executor=ray`` on a local Ray with 2 replica actors writes what the local executor writes, and an actor
killed with SIGKILL mid-run is replaced. Tests needing Ray skip without it; one local Ray serves them all."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, part_contents, read_parts

import batchgen.job.replicas.run as replicas_run
from batchgen.job.run import EXIT_OK, run_job
from batchgen.llm import LLM
from batchgen.ray import Generator
from batchgen.sampling_params import SamplingParams

ENGINE = {"device": "cpu", "num_blocks": 256, "max_num_seqs": 8}
PROMPTS = [f"{['Summarise the report:', 'Translate to French:'][i % 2]} item {i}" for i in range(10)]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'batchgen[ray]')")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _expected(ckpt: str, prompts: list[str], max_tokens: int) -> list:
    llm = LLM(ckpt, **ENGINE)
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)


def test_generator_call_equals_llm_generate_and_keeps_bad_rows(llama_ckpt: str) -> None:
    gen = Generator(llama_ckpt, sampling={"temperature": 0, "max_tokens": 7}, engine=ENGINE)
    batch = {"prompt": np.array([*PROMPTS[:4], None, ""], dtype=object), "k": np.arange(6)}
    out = gen(batch)
    want = _expected(llama_ckpt, PROMPTS[:4], 7)
    assert list(out["generated_text"][:4]) == [o.outputs[0].text for o in want]
    assert [list(t) for t in out["token_ids"][:4]] == [o.outputs[0].token_ids for o in want]
    assert list(out["k"]) == list(range(6)) and list(out["status"]) == ["ok"] * 4 + ["error"] * 2
    assert out["error"][4] and out["finish_reason"][5] == "error"
    n2 = Generator(
        llama_ckpt, sampling={"temperature": 0.8, "max_tokens": 5, "n": 2}, engine=ENGINE, id_column="k"
    )
    table = n2(pa.table({"prompt": PROMPTS[:3], "k": [10, 11, 12]}))  # n = 2: one output row per sample
    assert table.column("k").to_pylist() == [10, 10, 11, 11, 12, 12]
    assert table.column("sample_index").to_pylist() == [0, 1] * 3


def test_generator_with_id_column_samples_like_the_job(llama_ckpt: str, tmp_path: Path) -> None:
    rows = [{"uid": f"u{i}", "prompt": p} for i, p in enumerate(PROMPTS[:4])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    cfg = job_config(llama_ckpt, tmp_path / "in.parquet", tmp_path / "out", data={"id_column": "uid"})
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    job = read_parts(tmp_path / "out")
    sampling = {"temperature": 0.8, "max_tokens": 6}  # job_config's sampling, seed 0 as in the job
    gen = Generator(llama_ckpt, sampling=sampling, engine=ENGINE, id_column="uid")
    out = gen(pa.Table.from_pylist(rows))
    assert out.column("generated_text").to_pylist() == job.column("generated_text").to_pylist()


def test_map_batches_equals_llm_generate(local_ray, llama_ckpt: str) -> None:
    import ray.data

    ds = ray.data.from_items([{"prompt": p, "i": i} for i, p in enumerate(PROMPTS)])
    out = ds.map_batches(
        Generator,
        fn_constructor_kwargs={
            "model": llama_ckpt,
            "sampling": {"temperature": 0, "max_tokens": 6},
            "engine": ENGINE,
        },
        concurrency=2,
        num_cpus=0.5,  # docs/replicas.md's CPU setup
        batch_size=4,
    ).take_all()
    got = {r["i"]: (r["generated_text"], list(r["token_ids"]), r["status"]) for r in out}
    want = _expected(llama_ckpt, PROMPTS, 6)
    assert got == {i: (o.outputs[0].text, o.outputs[0].token_ids, "ok") for i, o in enumerate(want)}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray_data")
    rows = [{"uid": f"u{i:02d}", "prompt": p} for i, p in enumerate(PROMPTS * 2)]
    pq.write_table(pa.Table.from_pylist(rows), root / "in.parquet")
    return root / "in.parquet"


def _cfg(ckpt: str, inp: Path, out: Path, executor: str, dp: int):
    cfg = job_config(
        ckpt,
        inp,
        out,
        data={"id_column": "uid", "window_rows": 5},
        engine={"data_parallel_size": dp},
        sampling={"max_tokens": 40},  # windows long enough to be killed in the middle of
    )
    cfg.run.executor = executor
    return cfg


def test_ray_executor_equals_local_and_replaces_a_killed_actor(
    local_ray, llama_ckpt, dataset, tmp_path, monkeypatch
):
    from batchgen.job.replicas.ray_actors import RayReplicas

    single = tmp_path / "single"
    assert (
        run_job(
            _cfg(llama_ckpt, dataset, single, "local", 1), handle_signals=False, print_summary=False
        ).exit_code
        == 0
    )

    class Killing(RayReplicas):  # SIGKILL replica 0's actor process mid-window
        killed = 0

        def start(self, setup):  # replica 0 reports after every step: its first reports leave rows unfinished
            super().start(replace(setup, step_budget_s=0.0) if setup.replica == 0 else setup)

        def events(self, timeout):
            out = super().events(timeout)
            for kind, r, payload in out:  # while it holds unfinished rows
                if kind == "report" and r == 0 and payload.busy and not self.killed:
                    os.kill(self.pid(0), signal.SIGKILL)
                    Killing.killed += 1
            return out

    monkeypatch.setattr(replicas_run, "make_executor", lambda cfg: Killing(cfg.run.ray_address))
    res = run_job(
        _cfg(llama_ckpt, dataset, tmp_path / "ray", "ray", 2), handle_signals=False, print_summary=False
    )
    assert res.exit_code == EXIT_OK, res.message
    assert Killing.killed == 1 and res.report["replica_restarts"] == 1 and res.report["executor"] == "ray"
    assert part_contents(tmp_path / "ray") == part_contents(single)
    assert sorted(read_parts(tmp_path / "ray").column("id").to_pylist()) == [f"u{i:02d}" for i in range(20)]


CPU_NODE_SCRIPT = """
import sys, ray, ray.data
import batchgen.ray

model, data, address = sys.argv[1], sys.argv[2], sys.argv[3]
ray.init(address=address, runtime_env={"env_vars": {"BATCHGEN_RAY_IDLE_WARNING_S": "2"}})
# two actors that take every free CPU between them (one each on a 2-CPU node): the read tasks never run; each
# actor says so on stderr
cpus = ray.available_resources()["CPU"] / 2
kwargs = {"model": model, "sampling": {"max_tokens": 2}, "engine": {"device": "cpu", "num_blocks": 64}}
ray.data.read_parquet(data).map_batches(
    batchgen.ray.Generator, fn_constructor_kwargs=kwargs, concurrency=2, num_cpus=cpus, batch_size=2
).take_all()
"""


def test_cpu_node_actors_starving_the_reads_say_so(local_ray, llama_ckpt: str, tmp_path: Path) -> None:
    """map_batches(Generator, concurrency=2) whose two actors hold every CPU of the cluster (as one CPU each
    does on 2 CPUs): the read tasks never run; instead of waiting silently an actor prints the one-line warning
    naming docs/replicas.md's CPU setup (num_cpus per actor below the node's; that setup runs as
    test_map_batches_equals_llm_generate). The pipeline is a second driver on this module's local Ray."""
    import subprocess
    import sys
    import time

    address = local_ray.get_runtime_context().gcs_address
    pq.write_table(pa.table({"prompt": PROMPTS[:4]}), tmp_path / "in.parquet")
    script = tmp_path / "pipeline.py"
    script.write_text(CPU_NODE_SCRIPT)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [sys.executable, str(script), llama_ckpt, str(tmp_path / "in.parquet"), address],
            stdout=o, stderr=e, cwd=tmp_path, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if "no CPU of the Ray cluster is free" in err.read_text():
                break
            time.sleep(1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    warning = [line for line in err.read_text().splitlines() if "batchgen.ray.Generator: no batch" in line]
    assert warning and "num_cpus=0.5" in warning[0] and "docs/replicas.md" in warning[0], err.read_text()[
        -3000:
    ]
