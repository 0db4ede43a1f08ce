"""The commit protocol on a local disk: one record per commit, ambiguous writes resolved by reading back,
fencing by epoch, committed parts checked (size and sha256) before they are trusted, one shard layout per
output, no bookkeeping through symbolic links."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from batchgen.data.commit_log import CommitLog, record_name
from batchgen.data.layout import COMMITS_DIR, MANIFEST_NAME, part_name
from batchgen.data.local_storage import LocalLocation
from batchgen.data.manifest import Manifest, WindowRecord
from batchgen.data.output_dir import OutputDir
from batchgen.data.storage import StorageError
from batchgen.errors import ConfigError


def _manifest(num_windows: int = 3) -> Manifest:
    return Manifest(
        fingerprint="f1",
        config={"sampling": {"temperature": 1.0}},
        input={"fingerprint": "i1", "num_files": 1, "num_rows": 30},
        shard={"index": 0, "count": 1, "row_start": 0, "row_end": 30},
        window_rows=10,
        num_windows=num_windows,
        batchgen_version="0.1.0",
    )


def _rec(w: int) -> WindowRecord:
    return WindowRecord("", w * 10, w * 10 + 10, 10, 10, 0, 0, 0, 0)


def _table(w: int) -> pa.Table:
    return pa.table({"x": list(range(w * 10, w * 10 + 10))})


def test_each_commit_writes_one_record_and_close_compacts(tmp_path: Path) -> None:
    out = OutputDir(tmp_path)
    out.open(_manifest())
    before = (tmp_path / MANIFEST_NAME).stat().st_mtime_ns
    for w in range(3):
        out.commit(w, _table(w), _rec(w))
    # the manifest is not rewritten by a commit; each commit is one small record after the holder's open record
    assert (tmp_path / MANIFEST_NAME).stat().st_mtime_ns == before
    assert sorted(os.listdir(tmp_path / COMMITS_DIR)) == [record_name(i) for i in range(1, 5)]
    assert Manifest.load(tmp_path).complete  # readers see the log applied, mid-run
    out.close()
    assert not (tmp_path / COMMITS_DIR).exists()
    m = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert m["complete"] and m["log_seq"] == 4 and m["windows"]["2"]["size"] > 0
    assert len(m["windows"]["2"]["sha256"]) == 64


def test_a_record_whose_answer_was_lost_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = OutputDir(tmp_path)
    out.open(_manifest())
    real = LocalLocation.put

    def put_then_fail(self, name, data, **kw):  # the write lands, its answer does not
        real(self, name, data, **kw)
        if name.endswith(".json") and COMMITS_DIR in str(self.dir):
            raise ConnectionResetError("answer lost")
        return None

    monkeypatch.setattr(LocalLocation, "put", put_then_fail)
    with pytest.raises(ConnectionResetError):
        out.commit(0, _table(0), _rec(0))
    monkeypatch.undo()
    out.close()  # the holder catches up with the log: nothing is deleted
    assert (tmp_path / part_name(0)).exists()
    m = OutputDir(tmp_path).open(_manifest())
    assert set(m.windows) == {0}


def test_a_retried_create_that_meets_itself_succeeds(tmp_path: Path) -> None:
    loc = LocalLocation(tmp_path)
    log = CommitLog(loc)
    m = _manifest()
    seq = log.append({"kind": "open", "epoch": 1}, m)
    data = (json.dumps({"kind": "window", "epoch": 1, "seq": 2}, sort_keys=True) + "\n").encode()
    loc.child(COMMITS_DIR).put(record_name(2), data)  # the first try landed
    assert log.append({"kind": "window", "epoch": 1}) == seq + 1  # the retry reads it back: its own


def test_a_stale_holder_can_neither_commit_nor_be_trusted(tmp_path: Path) -> None:
    a = OutputDir(tmp_path)
    a.open(_manifest())
    a.commit(0, _table(0), _rec(0))
    a.holder.release()  # as if A's lock were lost; B takes over at a higher epoch
    a._held = False
    b = OutputDir(tmp_path)
    mb = b.open(_manifest())
    assert mb.epoch == 2 and set(mb.windows) == {0}
    from batchgen.data.lease import LeaseLost

    with pytest.raises(LeaseLost, match="another job"):
        a.commit(1, _table(1), _rec(1))  # A's next record number is B's open record
    # A's record written behind B's back at a later number is fenced off by its epoch
    CommitLog(LocalLocation(tmp_path)).loc.put(
        record_name(b.log.next_seq),
        json.dumps(
            {"kind": "window", "epoch": 1, "window": 2, "record": vars(_rec(2)) | {"part": "x"}}
        ).encode(),
    )
    assert 2 not in Manifest.load(tmp_path).windows
    b.close()


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_missing_or_changed_part_is_recomputed_never_deleted(tmp_path: Path, damage: str) -> None:
    with OutputDir(tmp_path) as out:
        out.open(_manifest())
        for w in range(3):
            out.commit(w, _table(w), _rec(w))
    p = tmp_path / part_name(1)
    if damage == "missing":
        p.unlink()
    else:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    with OutputDir(tmp_path) as out:
        m = out.open(_manifest())
        assert set(m.windows) == {0, 2} and not m.complete
        assert p.exists() == (damage == "changed")  # what a record named stays until it is rewritten
        out.commit(1, _table(1), _rec(1))
    assert OutputDir(tmp_path).open(_manifest()).complete


def test_another_shard_layout_is_refused_while_it_runs(tmp_path: Path) -> None:
    a = OutputDir(tmp_path, 0, 1)
    a.open(_manifest())  # running, nothing committed yet
    with pytest.raises(ConfigError, match=r"another shard layout \(data.shard.count=1"):
        OutputDir(tmp_path, 0, 2).open(_manifest())
    a.close()
    assert json.loads((tmp_path / "_layout.json").read_text()) == {"shard_count": 1}


@pytest.mark.parametrize("name", [".batchgen.lock", MANIFEST_NAME])
def test_a_planted_symlink_is_refused_never_written_through(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / name).symlink_to(victim)
    with pytest.raises((ConfigError, StorageError), match="symbolic link"):
        OutputDir(out_dir).open(_manifest())
    assert victim.read_text() == "precious"


def test_a_killed_atomic_write_leaves_nothing_a_rerun_keeps(tmp_path: Path) -> None:
    from batchgen.runtime.atomic import atomic_write_bytes, remove_stale_temps

    target = tmp_path / "results.jsonl"
    (tmp_path / ".tmp-results.jsonl.abc123").write_bytes(b"half")  # a kill -9 during the write
    (tmp_path / ".tmp-other.jsonl.x").write_bytes(b"not ours to remove")
    assert remove_stale_temps(target) == 1
    atomic_write_bytes(target, b"done\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-other.jsonl.x", "results.jsonl"]


def test_the_cost_of_a_commit_does_not_grow_with_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the 1st and the 300th commit write: one part and one record of the same size (no manifest)."""
    n = 300
    out = OutputDir(tmp_path)
    out.open(_manifest(num_windows=n))
    writes: list[tuple[str, int]] = []
    real = LocalLocation.put

    def put(self, name, data, **kw):
        writes.append((name, len(data)))
        return real(self, name, data, **kw)

    monkeypatch.setattr(LocalLocation, "put", put)
    per_commit = []
    for w in range(n):
        writes.clear()
        out.commit(w, _table(0), WindowRecord("", w * 10, w * 10 + 10, 10, 10, 0, 0, 0, 0))
        per_commit.append(list(writes))
    assert all(len(c) == 2 and c[0][0] == part_name(i) for i, c in enumerate(per_commit))
    first, last = per_commit[0][1][1], per_commit[-1][1][1]
    assert last - first <= 16  # only the digits of the numbers in it grow
    out.close()
    assert Manifest.load(tmp_path).complete
