"""The commit protocol on an object store under injected faults: a proxy (:mod:`fault_proxy`) between the job
and the local S3 server loses answers after the server acted (commit writes and the lease's), partitions a job for longer than its lease,
refuses connections, and kills the job at commit steps. Every case ends with each input row exactly once."""

# ruff: noqa: F811 - the s3 fixture is imported from s3_server and used as an argument

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, part_contents
from fault_proxy import FaultProxy, Rule
from s3_server import S3, s3, s3_endpoint  # noqa: F401 - fixtures

from batchgen.job.run import EXIT_INTERRUPTED, EXIT_OK, run_job

NUM_ROWS, WINDOW = 9, 3
ENGINE = {"device": "cpu", "num_blocks": 128, "max_num_seqs": 4}
SAMPLING = {"max_tokens": 3, "temperature": 0.9}
RECORD = r"/_commits/\d+\.json"


def _config(ckpt: str, inp: str, out: str, **data):
    return job_config(ckpt, inp, out, data={"window_rows": WINDOW, **data}, engine=ENGINE, sampling=SAMPLING)


def _run(cfg):
    return run_job(cfg, handle_signals=False, print_summary=False)


@pytest.fixture(scope="module")
def reference(llama_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("faultref")
    rows = [{"prompt": f"Row {i}: the {'quick ' * (1 + i % 3)}fox"} for i in range(NUM_ROWS)]
    pq.write_table(pa.Table.from_pylist(rows), root / "in.parquet")
    assert _run(_config(llama_ckpt, str(root / "in.parquet"), str(root / "out"))).exit_code == EXIT_OK
    return root, part_contents(root / "out")


@pytest.fixture
def proxy(s3: S3, monkeypatch: pytest.MonkeyPatch):
    u = urlsplit(s3.endpoint)
    p = FaultProxy((u.hostname, u.port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)  # the job talks to the store through the proxy
    yield p
    p.close()


def _input(s3: S3, root: Path) -> str:
    s3.client.put_object(Bucket=s3.bucket, Key="in/in.parquet", Body=(root / "in.parquet").read_bytes())
    return s3.url("in/in.parquet")


def _rerun_is_complete(ckpt: str, inp: str, s3: S3, expected: dict) -> None:
    res = _run(_config(ckpt, inp, s3.url("out")))
    assert res.exit_code == EXIT_OK and "nothing to do" in res.message, res.message
    assert s3.parts("out") == expected  # rows lost 0, rows duplicated 0


@pytest.mark.parametrize(
    "method,target",
    [
        ("PUT", RECORD),
        ("PUT", r"/_windows/part-000001\.arrow"),
        ("PUT", r"/part-000000\.parquet"),  # the rolled part
        ("PUT", r"/_manifest\.json"),
        ("PUT", r"/_layout\.json"),
        ("PUT", r"/_lease\.json"),  # the lease's creation: its retry meets it (not another job's lease)
    ],
)
def test_a_lost_answer_to_a_commit_write_loses_and_duplicates_nothing(
    llama_ckpt: str, reference, s3: S3, proxy: FaultProxy, method: str, target: str
) -> None:
    """The server applies the write, the answer never comes back: the client retries (its conditional retry
    meets its own first write) and the job resolves it by reading back — it neither deletes nor stops."""
    root, expected = reference
    inp = _input(s3, root)
    proxy.rules.append(Rule(method, target, "drop", times=1 if "manifest" not in target else 2))
    res = _run(_config(llama_ckpt, inp, s3.url("out")))
    assert res.exit_code == EXIT_OK, "\n".join(
        f"{a} {b} {c[:150]!r}" for a, b, c in proxy.seen if "manifest" in b
    )
    assert any(what == "dropped" for _, _, what in proxy.seen)
    assert s3.parts("out") == expected
    _rerun_is_complete(llama_ckpt, inp, s3, expected)


def test_a_lost_answer_to_a_lease_renewal_keeps_the_lease(s3: S3, proxy: FaultProxy) -> None:
    """The renewal landed, its answer was lost, the client's retry failed its If-Match against it: the lease
    object holds this holder's token, so the lease is still this job's (not lost to another job)."""
    from batchgen.data.lease import Lease
    from batchgen.data.storage import Location

    lease = Lease(Location(s3.url("out")), ttl_s=600)
    lease.acquire()
    try:
        rule = Rule("PUT", r"/_lease\.json", "drop")
        proxy.rules.append(rule)
        lease.renew()
        assert rule.fired == 1 and lease.lost is None, lease.lost
        lease.check()
    finally:
        lease.release()
    assert s3.keys("out/") == []  # released: the object it renewed was its own


def test_a_storage_outage_is_retried_then_exit_75(
    llama_ckpt: str, reference, s3: S3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from batchgen.data import storage

    monkeypatch.setattr(storage, "RETRY_DELAYS_S", (0.05, 0.1))
    # batchgen's retries are under test: s3fs's own (5 tries with backoff inside each of batchgen's) only
    # make every refused write take seconds
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    root, expected = reference
    inp = _input(s3, root)
    proxy.rules.append(Rule("PUT", r"/_windows/part-000001\.arrow", "refuse", times=10**6))
    res = _run(
        _config(
            llama_ckpt,
            inp,
            s3.url("out"),
            storage_options={"config_kwargs": {"retries": {"max_attempts": 1}}},
        )
    )
    assert res.exit_code == EXIT_INTERRUPTED, res.message
    assert "does not answer" in res.message and "\n" not in res.message
    proxy.rules.clear()
    res = _run(_config(llama_ckpt, inp, s3.url("out")))
    assert res.exit_code == EXIT_OK, res.message
    assert s3.parts("out") == expected


def _job(ckpt: str, inp: str, out: str, env: dict, cwd: Path, *over: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", f"model.path={ckpt}", f"data.input={inp}", f"data.output={out}",
         f"data.window_rows={WINDOW}", "engine.device=cpu", "engine.num_blocks=128", "engine.max_num_seqs=4",
         "sampling.max_tokens=3", "sampling.temperature=0.9", "hydra.run.dir=.", "hydra.output_subdir=null",
         *over],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_a_partition_longer_than_the_lease_neither_commits_nor_deletes(
    llama_ckpt: str, reference, s3: S3, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Job A is cut off (its requests held) after its first window's part, for longer than its lease; job B
    takes over and completes; when the partition heals A's held writes land: A stops (75) without deleting
    anything and the output holds every row exactly once."""
    root, expected = reference
    inp = _input(s3, root)
    ttl = 3.0
    proxy.rules.append(Rule("PUT", r"/_windows/part-000000\.arrow", "delay", on_match=proxy.partition))
    a = _job(
        llama_ckpt,
        inp,
        s3.url("out"),
        {**s3.env(), "AWS_ENDPOINT_URL": proxy.url},
        tmp_path,
        f"data.lease_ttl_s={ttl}",
    )
    deadline = time.monotonic() + 120
    while not proxy.rules[0].fired and a.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert a.poll() is None
    time.sleep(ttl + 1.0)  # A's lease expires while it is cut off
    os.environ["AWS_ENDPOINT_URL"] = s3.endpoint  # B talks to the store directly
    res = _run(_config(llama_ckpt, inp, s3.url("out"), lease_ttl_s=ttl))
    assert res.exit_code == EXIT_OK, res.message
    assert s3.parts("out") == expected
    proxy.heal()
    text, _ = a.communicate(timeout=120)
    assert a.returncode == EXIT_INTERRUPTED, text[-2000:]
    assert "Traceback" not in text
    assert s3.parts("out") == expected  # nothing B committed was deleted or duplicated
    _rerun_is_complete(llama_ckpt, inp, s3, expected)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("target", [RECORD, r"/_windows/part-000001\.arrow", r"/part-000000\.parquet"])
def test_kill_9_at_a_commit_write_on_an_object_store(
    llama_ckpt: str, reference, s3: S3, proxy: FaultProxy, when: str, target: str, tmp_path: Path
) -> None:
    """kill -9 the job the moment it sends a commit write: before the store acts on it, or after (the write
    landed, the job never knew). The rerun completes with every row exactly once."""
    root, expected = reference
    inp = _input(s3, root)
    procs: list[subprocess.Popen] = []

    def kill() -> None:
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)

    skip = 2 if target == RECORD else 0  # the record of the 2nd window (after the open record and the 1st)
    rule = Rule("PUT", target, "refuse" if when == "before" else "drop", skip=skip)
    rule.on_match, rule.after_forward = (kill, None) if when == "before" else (None, kill)
    proxy.rules.append(rule)
    procs.append(_job(llama_ckpt, inp, s3.url("out"), {**s3.env(), "AWS_ENDPOINT_URL": proxy.url}, tmp_path))
    text, _ = procs[0].communicate(timeout=180)
    assert procs[0].returncode == -signal.SIGKILL and rule.fired == 1, text[-2000:]
    os.environ["AWS_ENDPOINT_URL"] = s3.endpoint
    res = _run(_config(llama_ckpt, inp, s3.url("out")))
    assert res.exit_code == EXIT_OK, res.message
    assert s3.parts("out") == expected
