"""jobs/cron/batchgen-inbox.sh: incremental processing of an inbox of Parquet files (runs the real CLI)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.job.merge import verify

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "jobs" / "cron" / "batchgen-inbox.sh"
BATCHGEN = Path(sys.executable).with_name("batchgen")
# Small and fast: a tiny model, few tokens, a small KV cache.
FAST = ["sampling.max_tokens=3", "engine.max_model_len=128", "engine.num_blocks=64", "run.progress=log"]


def run_inbox(inbox: Path, outbox: Path, *overrides: str, settle: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, BATCHGEN_BIN=str(BATCHGEN), BATCHGEN_INBOX_SETTLE_S=str(settle))
    return subprocess.run(
        ["bash", str(SCRIPT), str(inbox), str(outbox), *overrides],
        env=env,
        cwd=inbox.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def drop(path: Path, rows: int) -> None:
    """A producer delivering a file: written under a hidden name, then renamed into the inbox."""
    tmp = path.with_name("." + path.name)
    pq.write_table(pa.table({"prompt": [f"{path.stem} prompt number {i}:" for i in range(rows)]}), tmp)
    os.replace(tmp, path)


def test_second_run_processes_only_the_new_file(tmp_path: Path, llama_ckpt: str) -> None:
    inbox, outbox = tmp_path / "inbox", tmp_path / "outbox"
    inbox.mkdir()
    overrides = [
        f"model.path={llama_ckpt}",
        "data.window_rows=4",
        "data.part_rows=4",
        *FAST,
    ]  # a part per window
    drop(inbox / "a.parquet", 6)
    r1 = run_inbox(inbox, outbox, *overrides)
    assert r1.returncode == 0, r1.stdout + r1.stderr + (outbox / "a.log").read_text()
    assert "a: processing" in r1.stdout and "a: done" in r1.stdout
    report_a = verify(outbox / "a")
    assert report_a.ok and report_a.input_rows == 6
    parts_a = {p.name: p.stat().st_mtime_ns for p in (outbox / "a").glob("part-*.parquet")}
    assert len(parts_a) == 2

    drop(inbox / "b.parquet", 5)  # arrives between the runs
    (inbox / ".c.parquet").write_bytes(b"still being copied")  # hidden: ignored
    r2 = run_inbox(inbox, outbox, *overrides)
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert "a: processing" not in r2.stdout  # finished: skipped via its manifest, batchgen not started
    assert "b: processing" in r2.stdout and "b: done" in r2.stdout
    assert "finished 1, already done or skipped 1" in r2.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (outbox / "a").glob("part-*.parquet")} == parts_a
    report_b = verify(outbox / "b")
    assert report_b.ok and report_b.input_rows == 5
    t = pq.read_table(outbox / "b" / "part-000001.parquet")
    assert t.column("id").to_pylist() == [4] and t.column("status").to_pylist() == ["ok"]
    assert not (outbox / ".c").exists()


def test_rejected_file_is_marked_and_not_retried(tmp_path: Path) -> None:
    inbox, outbox = tmp_path / "inbox", tmp_path / "outbox"
    inbox.mkdir()
    (inbox / "broken.parquet").write_bytes(b"this is not parquet at all")
    os.utime(inbox / "broken.parquet", (1_000_000_000, 1_000_000_000))
    r1 = run_inbox(inbox, outbox, *FAST)
    assert r1.returncode == 1, r1.stdout + r1.stderr
    assert "broken: rejected by batchgen (exit 2)" in r1.stdout
    assert "not a Parquet file" in (outbox / "broken.failed").read_text()
    r2 = run_inbox(inbox, outbox, *FAST)
    assert r2.returncode == 0 and "broken: processing" not in r2.stdout
    os.utime(inbox / "broken.parquet")  # the file changed: tried again
    r3 = run_inbox(inbox, outbox, *FAST)
    assert "broken: processing" in r3.stdout and r3.returncode == 1


def test_recent_files_wait_and_a_held_lock_skips_the_run(tmp_path: Path) -> None:
    inbox, outbox = tmp_path / "inbox", tmp_path / "outbox"
    inbox.mkdir()
    drop(inbox / "fresh.parquet", 3)
    r = run_inbox(inbox, outbox, settle=3600)
    assert r.returncode == 0 and "fresh: modified in the last 3600s" in r.stdout
    assert not (outbox / "fresh").exists()
    with open(outbox / ".inbox.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = run_inbox(inbox, outbox)
    assert r.returncode == 0 and "another run holds" in r.stdout
    assert not (outbox / "fresh").exists()
