"""Object stores: input and output on a real local S3 server (moto's server mode), exactly-once commits without
rename, the lease, and the one-line errors (missing credentials, missing bucket, truncated object)."""

# ruff: noqa: F811 - the s3 fixture is imported from s3_server and used as an argument

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, part_contents
from s3_server import S3, s3, s3_endpoint  # noqa: F401 - fixtures

from batchgen.data.lease import LEASE_NAME, Lease, LeaseLost
from batchgen.data.storage import Location, PreconditionFailed
from batchgen.job.run import EXIT_CONFIG, EXIT_OK, run_job

NUM_ROWS, WINDOW = 12, 3
ENGINE = {"device": "cpu", "num_blocks": 256, "max_num_seqs": 6}
SAMPLING = {"max_tokens": 5, "temperature": 0.9}


def _rows(n: int = NUM_ROWS) -> pa.Table:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return pa.Table.from_pylist(
        [{"prompt": f"Note {i}: {' '.join(words[(i + k) % 10] for k in range(2 + i % 4))}"} for i in range(n)]
    )


def _config(ckpt: str, inp: str, out: str, **data):
    return job_config(ckpt, inp, out, data={"window_rows": WINDOW, **data}, engine=ENGINE, sampling=SAMPLING)


def _run(cfg):
    return run_job(cfg, handle_signals=False, print_summary=False)


@pytest.fixture(scope="module")
def reference(llama_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The input (two files) and the output of an uninterrupted local run."""
    root = tmp_path_factory.mktemp("s3ref")
    t = _rows()
    (root / "in").mkdir()
    pq.write_table(t.slice(0, 5), root / "in" / "a.parquet", row_group_size=2)
    pq.write_table(t.slice(5), root / "in" / "b.parquet", row_group_size=3)
    assert _run(_config(llama_ckpt, str(root / "in"), str(root / "out"))).exit_code == EXIT_OK
    return root, part_contents(root / "out")


def _upload_input(s3: S3, root: Path) -> str:  # noqa: F811
    for name in ("a.parquet", "b.parquet"):
        s3.client.put_object(Bucket=s3.bucket, Key=f"in/{name}", Body=(root / "in" / name).read_bytes())
    s3.client.put_object(Bucket=s3.bucket, Key="in/_SUCCESS", Body=b"")  # bookkeeping names are skipped
    return s3.url("in/")


def test_input_and_output_on_s3_equal_a_local_run_and_changes_are_refused(
    llama_ckpt: str, reference, s3: S3
) -> None:  # noqa: F811
    root, expected = reference
    inp = _upload_input(s3, root)
    res = _run(_config(llama_ckpt, inp, s3.url("out")))
    assert res.exit_code == EXIT_OK, res.message
    assert s3.parts("out") == expected
    keys = s3.keys("out/")
    assert "out/_manifest.json" in keys and "out/_report.json" in keys
    assert "out/" + LEASE_NAME not in keys  # released at the end
    # the output is a dataset: readers given the prefix see exactly the rows
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint)
    t = pq.read_table(f"{s3.bucket}/out", filesystem=fs)
    assert t.num_rows == NUM_ROWS
    man = json.loads(s3.get("out/_manifest.json"))
    assert set(man["input"]["versions"]) == {"a.parquet", "b.parquet"}  # ETags recorded for resume
    # a rerun finds everything done without rereading rows: the versions match
    cfg = _config(llama_ckpt, inp, s3.url("out"))
    assert "nothing to do" in _run(cfg).message
    # an object rewritten with other rows is refused on resume
    t = pq.read_table(root / "in" / "b.parquet").to_pylist()
    t[0]["prompt"] = "something else entirely"
    s3.put_table("in/b.parquet", pa.Table.from_pylist(t), row_group_size=3)
    res = _run(cfg)
    assert res.exit_code == EXIT_CONFIG and "different input data" in res.message


@pytest.mark.slow
def test_kill_9_mid_job_then_resume_is_exactly_once(
    llama_ckpt: str,
    reference,
    s3: S3,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGKILL once a window and a checkpoint are committed; the rerun completes with the local run's parts."""
    root, expected = reference
    inp = _upload_input(s3, root)
    out = s3.url("out")
    cmd = [
        sys.executable, "-m", "batchgen.cli", f"model.path={llama_ckpt}", f"data.input={inp}", f"data.output={out}",
        f"data.window_rows={WINDOW}", "run.progress=off", "run.checkpoint_interval_s=0.01", "data.lease_ttl_s=600",
        *[f"engine.{k}={v}" for k, v in ENGINE.items()], *[f"sampling.{k}={v}" for k, v in SAMPLING.items()],
    ]  # fmt: skip
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=s3.env(TMPDIR=str(tmp_path)))
    deadline = time.monotonic() + 240
    done = 0
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            done = json.loads(s3.get("out/_manifest.json")).get("rows_done", 0)
        except Exception:  # noqa: BLE001 - not written yet
            done = 0
        if done >= 4:
            break
        time.sleep(0.02)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    assert killed, f"the job ended before it could be killed: {(tmp_path / 'log.txt').read_text()[-2000:]}"
    assert "out/" + LEASE_NAME in s3.keys("out/")  # the killed job's lease is left behind, unexpired...
    with caplog.at_level("WARNING"):
        res = _run(_config(llama_ckpt, inp, out))  # ...and taken over at once: its process is gone
    assert "whose process is gone" in caplog.text
    assert res.exit_code == EXIT_OK, res.message
    assert s3.parts("out") == expected
    assert not [k for k in s3.keys("out/") if "_checkpoint/" in k]


def test_second_writer_refused_and_stale_lease_taken_over(
    llama_ckpt: str,
    reference,
    s3: S3,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, expected = reference
    inp = _upload_input(s3, root)
    held = {"owner": "pid 1 on elsewhere", "token": "x", "expires_at": time.time() + 600, "ttl_s": 600}
    s3.client.put_object(Bucket=s3.bucket, Key=f"out/{LEASE_NAME}", Body=json.dumps(held).encode())
    res = _run(_config(llama_ckpt, inp, s3.url("out")))
    assert res.exit_code == EXIT_CONFIG
    assert "pid 1 on elsewhere" in res.message and "holds the lease" in res.message
    assert "\n" not in res.message
    assert s3.keys("out/") == [f"out/{LEASE_NAME}"]  # nothing written
    held["expires_at"] = time.time() - 5  # a killed job's lease
    s3.client.put_object(Bucket=s3.bucket, Key=f"out/{LEASE_NAME}", Body=json.dumps(held).encode())
    with caplog.at_level("WARNING"):
        res = _run(_config(llama_ckpt, inp, s3.url("out")))
    assert res.exit_code == EXIT_OK, res.message
    assert "took over the lease of pid 1 on elsewhere" in caplog.text
    assert s3.parts("out") == expected


def test_lease_conditional_writes(s3: S3) -> None:  # noqa: F811
    """Two holders of one location: the second is refused; once the first's lease expires and is taken over,
    the first's renewal finds it lost and its manifest write is refused (fencing)."""
    loc = Location(s3.url("lease"))
    a = Lease(loc, ttl_s=2)
    a.acquire()
    b = Lease(loc, ttl_s=30)
    with pytest.raises(Exception, match="holds the lease"):
        b.acquire()
    a._stop.set()  # a hangs: its lease is no longer renewed
    a._thread.join()
    time.sleep(2.1)
    b.acquire()
    a._stop.clear()
    a.renew()
    with pytest.raises(LeaseLost, match="lost the lease"):
        a.check()
    with pytest.raises(PreconditionFailed):
        loc.put("x", b"1", if_match='"not-the-etag"')
    etag = loc.put("x", b"1", if_absent=True)
    with pytest.raises(PreconditionFailed):
        loc.put("x", b"2", if_absent=True)
    assert loc.put("x", b"3", if_match=etag) != etag
    b.release()
    assert loc.info(LEASE_NAME) is None


def test_truncated_object_is_one_line(llama_ckpt: str, s3: S3) -> None:  # noqa: F811
    data = s3.put_table("in/ok.parquet", _rows(4))
    s3.client.put_object(Bucket=s3.bucket, Key="in/cut.parquet", Body=data[: len(data) // 2])
    res = _run(_config(llama_ckpt, s3.url("in/"), s3.url("out")))
    assert res.exit_code == EXIT_CONFIG
    assert "cut.parquet" in res.message and "not a Parquet file" in res.message and "\n" not in res.message


def test_missing_credentials_is_one_line(llama_ckpt: str, s3: S3, monkeypatch, tmp_path: Path) -> None:  # noqa: F811
    s3.put_table("in/x.parquet", _rows(3))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    res = _run(_config(llama_ckpt, s3.url("in/"), str(tmp_path / "out")))
    assert res.exit_code == EXIT_CONFIG
    assert res.message.startswith("data.input: no credentials found") and "AWS_ACCESS_KEY_ID" in res.message
    res = _run(_config(llama_ckpt, str(tmp_path / "in.parquet"), s3.url("out")))
    pq.write_table(_rows(3), tmp_path / "in.parquet")
    res = _run(_config(llama_ckpt, str(tmp_path / "in.parquet"), s3.url("out")))
    assert res.exit_code == EXIT_CONFIG
    assert res.message.startswith("data.output: no credentials found") and "\n" not in res.message


def test_missing_bucket_is_one_line(llama_ckpt: str, s3: S3, tmp_path: Path) -> None:  # noqa: F811
    pq.write_table(_rows(3), tmp_path / "in.parquet")
    res = _run(_config(llama_ckpt, str(tmp_path / "in.parquet"), "s3://no-such-bucket-xyz/out"))
    assert res.exit_code == EXIT_CONFIG
    assert "'no-such-bucket-xyz'" in res.message and "does not exist" in res.message
    res = _run(_config(llama_ckpt, "s3://no-such-bucket-xyz/in/", str(tmp_path / "out")))
    assert res.exit_code == EXIT_CONFIG and "does not exist" in res.message


def test_secrets_never_written(llama_ckpt: str, s3: S3, tmp_path: Path) -> None:  # noqa: F811
    """Credentials given in data.storage_options reach the store but no log, manifest, report, Hydra record
    or output."""
    s3.put_table("in/x.parquet", _rows(3))
    secret, key_id = "Zr9SuperSecretValue0123456789", "AKIAEXAMPLEKEY0001"
    env = s3.env(TMPDIR=str(tmp_path))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(k)
    cmd = [
        sys.executable, "-m", "batchgen.cli", f"model.path={llama_ckpt}", f"data.input={s3.url('in/')}",
        f"data.output={s3.url('out')}", "run.progress=off", "sampling.max_tokens=3", "engine.num_blocks=64",
        f"data.storage_options={{key:{key_id},endpoint_url:'{s3.endpoint}'}}", f"data.storage_options.secret={secret}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert secret not in proc.stdout + proc.stderr
    hydra_files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in hydra_files) and any(
        p.name == "overrides.yaml" for p in hydra_files
    )
    for p in hydra_files:
        text = p.read_text(errors="replace")
        assert secret not in text and key_id not in text, p
    assert "endpoint_url" in next(p for p in hydra_files if p.name == "config.yaml").read_text()
    for k in s3.keys("out/"):
        body = s3.get(k)
        assert secret.encode() not in body and key_id.encode() not in body, k


def test_hf_url_through_a_local_mock(llama_ckpt: str, tmp_path: Path, monkeypatch) -> None:
    """hf://datasets/... goes through fsspec's filesystem for the protocol (here a local mock of the Hub)."""
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.local import LocalFileSystem

    hub = tmp_path / "hub"
    (hub / "datasets/org/prompts/data").mkdir(parents=True)
    pq.write_table(_rows(4), hub / "datasets/org/prompts/data/train-0.parquet")

    class MockHub(LocalFileSystem):
        protocol = "hf"

        @classmethod
        def _strip_protocol(cls, path):  # type: ignore[override]
            p = str(path)
            p = p[len("hf://") :] if p.startswith("hf://") else p
            return str(hub / p) if not p.startswith(str(hub)) else p

    fsspec.register_implementation("hf", MockHub, clobber=True)
    try:
        res = _run(_config(llama_ckpt, "hf://datasets/org/prompts/data", str(tmp_path / "out")))
    finally:
        from fsspec.registry import _registry

        _registry.pop("hf", None)
    assert res.exit_code == EXIT_OK, res.message
    t = pq.read_table(tmp_path / "out")
    assert t.num_rows == 4 and t.column("status").to_pylist() == ["ok"] * 4
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["input"]["spec"].startswith("hf://")


def test_s3_output_read_by_batchgen_show(llama_ckpt: str, s3: S3, tmp_path: Path) -> None:  # noqa: F811
    pq.write_table(_rows(3), tmp_path / "in.parquet")
    assert _run(_config(llama_ckpt, str(tmp_path / "in.parquet"), s3.url("out"))).exit_code == EXIT_OK
    from batchgen.job.merge_cli import main as merge_main
    from batchgen.job.show import read_rows

    rows, total = read_rows(s3.url("out"), 2)
    assert total == 3 and len(rows) == 2 and rows[0]["status"] == "ok"
    assert merge_main([s3.url("out"), "--write", s3.url("merged.parquet")]) == 0
    merged = pq.read_table(io.BytesIO(s3.get("merged.parquet")))
    assert merged.column("id").to_pylist() == [0, 1, 2]
    assert merge_main([s3.url("out"), "--write", s3.url("out/merged.parquet")]) == 2  # inside the dataset


def test_lease_holder_gone_on_this_host() -> None:
    """A lease whose holder ran here is stale once its process is gone — killed (even while a zombie not yet
    reaped) or its pid reused; a live holder, or one on another host, is not."""
    from batchgen.data.lease import _holder_is_dead, _start_time

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = {"host": os.uname().nodename, "pid": p.pid, "start": _start_time(p.pid)}
        assert not _holder_is_dead({"process": here})
        assert not _holder_is_dead({"process": {**here, "host": "elsewhere"}})
        assert _holder_is_dead({"process": {**here, "start": "1"}})  # the pid now names another process
        os.kill(p.pid, signal.SIGKILL)
        time.sleep(0.3)
        assert _holder_is_dead({"process": here})  # a zombie
    finally:
        p.kill()
        p.wait()
    assert _holder_is_dead({"process": here})
    assert not _holder_is_dead({"owner": "pid 1 on elsewhere"})  # no process record: wait for the expiry
