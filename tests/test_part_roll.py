"""Output parts sized by data.part_rows / data.part_size, independent of the window: rows in input order, each
exactly once, in parts a reader sees only when complete — also when the job is killed (-9) during a roll."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import env_without_slurm, job_config

from batchgen.data.manifest import Manifest
from batchgen.job.run import EXIT_OK, run_job

ROWS = 30


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i}: say something about {i % 7}" for i in range(ROWS)]}), p)
    return p


def _cfg(ckpt: str, inp: Path, out: Path, **data):
    cfg = job_config(
        ckpt, inp, out, data={"window_rows": 4, **data}, sampling={"max_tokens": 3, "temperature": 0}
    )
    return cfg


def _rows(out: Path) -> pa.Table:
    return pq.read_table(out).drop_columns(["num_cached_tokens"]).replace_schema_metadata(None)


def _parts(out: Path) -> list[list[int]]:
    return [[p.first, p.last] for p in Manifest.load(out).parts]


def test_parts_sized_by_rows_and_bytes(llama_ckpt: str, prompts: Path, tmp_path: Path) -> None:
    by_rows = tmp_path / "rows"
    assert (
        run_job(_cfg(llama_ckpt, prompts, by_rows, part_rows=10), handle_signals=False).exit_code == EXIT_OK
    )
    # 8 windows of 4 rows: a part closes at the first window that brings it to 10 rows; the last is smaller
    assert _parts(by_rows) == [[0, 2], [3, 5], [6, 7]]
    names = sorted(p.name for p in by_rows.glob("*.parquet"))
    assert names == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert [pq.read_metadata(by_rows / n).num_rows for n in names] == [12, 12, 6]
    meta = json.loads(pq.read_schema(by_rows / names[1]).metadata[b"batchgen"])
    assert meta["part"] == {"index": 1, "windows": [3, 5], "row_start": 12, "row_end": 24}
    assert not (by_rows / "_windows").exists()  # every piece is in a part
    assert _rows(by_rows).column("id").to_pylist() == list(range(ROWS))

    one_per_window = tmp_path / "bytes"  # a size every window reaches: a part per window
    cfg = _cfg(llama_ckpt, prompts, one_per_window, part_size="1B")
    assert run_job(cfg, handle_signals=False).exit_code == EXIT_OK
    assert _parts(one_per_window) == [[w, w] for w in range(8)]
    big = tmp_path / "big"  # the default size: one part
    assert run_job(_cfg(llama_ckpt, prompts, big), handle_signals=False).exit_code == EXIT_OK
    assert _parts(big) == [[0, 7]]
    assert _rows(one_per_window) == _rows(big) == _rows(by_rows)


_KILLER = """
import os, signal, sys
import batchgen.data.part_roll as pr
from batchgen.data.commit_log import CommitLog
from batchgen.data.local_storage import LocalLocation

point = sys.argv[1]
rolls = {"write": 0, "part": 0}

def die():
    os.kill(os.getpid(), signal.SIGKILL)

class Writer(pr.pq.ParquetWriter):
    def close(self):
        if point == "writing" and rolls["write"] == 1:
            die()  # the second part is being written
        super().close()

pr.pq.ParquetWriter = Writer
write, append, delete = pr.PartRoller._write, CommitLog.append, LocalLocation.delete

def _write(self, *args):
    write(self, *args)
    rolls["write"] += 1

def _append(self, rec, m=None):
    if rec.get("kind") == "part":
        rolls["part"] += 1
        if point == "part_written" and rolls["part"] == 2:
            die()  # the second part is in place, not recorded
    seq = append(self, rec, m)
    if rec.get("kind") == "part" and point == "recorded" and rolls["part"] == 2:
        die()  # recorded, no piece deleted
    return seq

def _delete(self, name):
    delete(self, name)
    if point == "deleting" and rolls["part"] == 2 and name.startswith("_windows/"):
        die()  # one piece of the second part deleted, the others not

pr.PartRoller._write, CommitLog.append, LocalLocation.delete = _write, _append, _delete
"""


@pytest.mark.parametrize("point", ["writing", "part_written", "recorded", "deleting"])
def test_kill_9_during_a_part_roll_keeps_every_row_once(
    llama_ckpt: str, prompts: Path, tmp_path: Path, point: str
) -> None:
    ref = tmp_path / "ref"
    assert run_job(_cfg(llama_ckpt, prompts, ref, part_rows=10), handle_signals=False).exit_code == EXIT_OK
    out = tmp_path / "out"
    script = _KILLER + textwrap.dedent(f"""
        from batchgen.engine.config import EngineConfig
        from batchgen.job.config import DataOptions, JobConfig, ModelOptions, RunOptions, default_sampling
        from batchgen.job.run import run_job
        import dataclasses
        cfg = JobConfig(
            model=ModelOptions(path={llama_ckpt!r}),
            data=DataOptions(input={str(prompts)!r}, output={str(out)!r}, window_rows=4, part_rows=10),
            engine=EngineConfig(device="cpu", num_blocks=256, max_num_seqs=8),
            sampling=dataclasses.replace(default_sampling(), max_tokens=3, temperature=0),
            run=RunOptions(progress="off"),
        )
        sys.exit(run_job(cfg, handle_signals=False, print_summary=False).exit_code)
    """)
    proc = subprocess.run([sys.executable, "-c", script, point], env=env_without_slurm(), capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]

    # at the moment of the kill a reader sees complete parts, each row at most once, in input order
    ids = pq.read_table(out).column("id").to_pylist() if list(out.glob("*.parquet")) else []
    assert ids == list(range(len(ids))) and len(ids) in (0, 12, 24), ids

    res = run_job(_cfg(llama_ckpt, prompts, out, part_rows=10), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    assert _parts(out) == [[0, 2], [3, 5], [6, 7]]
    assert _rows(out) == _rows(ref)  # every row exactly once, as an uninterrupted run wrote it
    assert not (out / "_windows").exists() and not [p for p in out.iterdir() if p.name.startswith(".tmp")]
    assert not (out / "_commits").exists()  # compacted into the manifest, which names the parts
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(p.name for p in ref.glob("*.parquet"))


def test_retried_error_rows_rewrite_the_parts_holding_them(llama_ckpt: str, tmp_path: Path) -> None:
    from test_job_robust import LONG

    inp = tmp_path / "in.parquet"
    rows = [
        (LONG if i % 9 == 4 else "short ") + f"row {i}" for i in range(ROWS)
    ]  # rows 4, 13, 22: windows 1, 3, 5
    pq.write_table(pa.table({"prompt": rows}), inp)
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_job(_cfg(llama_ckpt, inp, ref, part_rows=10), handle_signals=False).exit_code == EXIT_OK
    small = _cfg(llama_ckpt, inp, out, part_rows=10)
    small.engine.num_blocks = 1  # the long rows do not fit: error rows, retryable
    small.run.max_error_fraction = 1.0
    assert run_job(small, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    assert _rows(out).column("status").to_pylist().count("error") == 3 and _parts(out) == [
        [0, 2],
        [3, 5],
        [6, 7],
    ]
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}

    retry = _cfg(llama_ckpt, inp, out, part_rows=10, retry_errors=True)
    res = run_job(retry, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK and res.report["run"]["rows"] == 3, res.message
    assert _rows(out) == _rows(ref) and _parts(out) == [[0, 2], [3, 5], [6, 7]]
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    changed = sorted(k for k in before if after[k] != before[k])
    assert changed == ["part-000000.parquet", "part-000001.parquet"]  # the parts holding retried rows
    assert not (out / "_windows").exists()


def _window_table(w: int) -> pa.Table:
    return pa.table({"id": [2 * w, 2 * w + 1], "generated_text": ["a", "b"], "status": ["ok", "ok"]})


def test_parts_are_commit_records_checked_on_open(tmp_path: Path) -> None:
    from batchgen.data.manifest import WindowRecord
    from batchgen.data.output_dir import OutputDir
    from batchgen.data.part_roll import PartRoller

    def fresh() -> Manifest:
        return Manifest("fp", {}, {"fingerprint": "i"}, {"index": 0, "count": 1}, 2, 4, "test")

    with OutputDir(tmp_path) as od:
        m = od.open(fresh())
        roller = PartRoller(od, part_rows=4)
        for w in range(4):
            od.commit(w, _window_table(w), WindowRecord("", 2 * w, 2 * w + 2, 2, 2, 0, 0, 0, 0))
            roller.roll_ready()
        assert [(p.name, p.first, p.last) for p in m.parts] == [
            ("part-000000.parquet", 0, 1),
            ("part-000001.parquet", 2, 3),
        ]
        assert all(p.size and p.sha256 for p in m.parts) and m.windows[3].part == "part-000001.parquet"
        assert not list((tmp_path / "_windows").glob("*.arrow"))  # garbage once the part record exists
    assert not (tmp_path / "_commits").exists() and _parts(tmp_path) == [[0, 1], [2, 3]]
    assert pq.read_table(tmp_path).column("id").to_pylist() == list(range(8))

    # a rolled part changed since its record: its windows and the later parts' are recomputed
    pq.write_table(pa.table({"id": [0, 1, 99, 3]}), tmp_path / "part-000000.parquet")
    with OutputDir(tmp_path) as od:
        m = od.open(fresh())
        assert m.parts == [] and m.windows == {}
        assert not list(tmp_path.glob("*.parquet"))  # no longer named: a reader sees no stale rows


def test_a_part_is_streamed_a_piece_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A roll reads one piece, writes it as row groups into the file being written, then reads the next: the
    part never exists in memory (its size is many pieces), and a rewrite streams the old part the same way."""
    import os
    import tracemalloc

    import batchgen.data.part_roll as pr
    from batchgen.data.manifest import WindowRecord
    from batchgen.data.output_dir import OutputDir

    windows, rows = 8, 300
    monkeypatch.setattr(pr, "ROW_GROUP_BYTES", 1)  # every piece is a row group of its own
    events: list[str] = []
    writer_cls = pr.pq.ParquetWriter

    class Writer(writer_cls):  # type: ignore[misc, valid-type]
        def write_table(self, table: pa.Table, *a, **k) -> None:
            events.append(f"write {table.num_rows}")
            super().write_table(table, *a, **k)

    monkeypatch.setattr(pr.pq, "ParquetWriter", Writer)
    fresh = Manifest("fp", {}, {"fingerprint": "i"}, {"index": 0, "count": 1}, rows, windows, "test")
    with OutputDir(tmp_path) as od:
        m = od.open(fresh)
        for w in range(windows):  # incompressible text: ~0.5 MB a piece in memory, the part ~2 MB
            text = [os.urandom(1300).hex() for _ in range(rows)]
            table = pa.table({"id": range(w * rows, (w + 1) * rows), "generated_text": text})
            od.commit(w, table, WindowRecord("", w * rows, (w + 1) * rows, rows, rows, 0, 0, 0, 0))
        read_piece = od.read_piece
        monkeypatch.setattr(od, "read_piece", lambda name: events.append(f"read {name}") or read_piece(name))
        roller = pr.PartRoller(od, part_rows=10**9)
        tracemalloc.start()
        roller.finish()  # every window committed: one part of all of them
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert [(p.first, p.last) for p in m.parts] == [(0, windows - 1)]
        size = (tmp_path / "part-000000.parquet").stat().st_size
        assert size > 2 << 20 and peak < size / 3, (peak, size)  # about one piece, never the part
        expect = [e for w in range(windows) for e in (f"read _windows/part-{w:06d}.arrow", f"write {rows}")]
        assert events == expect  # each piece written before the next is read
        md = pq.read_metadata(tmp_path / "part-000000.parquet")
        assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [rows] * windows
        assert m.parts[0].size == size and not list((tmp_path / "_windows").glob("*.arrow"))

        # a rewrite (a window committed again) streams the old part: the same bound
        redo = pa.table({"id": range(3 * rows, 4 * rows), "generated_text": ["again"] * rows})
        od.commit(3, redo, WindowRecord("", 3 * rows, 4 * rows, rows, rows, 0, 0, 0, 0))
        tracemalloc.start()
        roller.finish()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < size / 3, (peak, size)
    table = pq.read_table(tmp_path)
    assert table.column("id").to_pylist() == list(range(windows * rows))
    assert table.column("generated_text").to_pylist()[3 * rows : 4 * rows] == ["again"] * rows


_CHECKPOINT_KILLER = """
import json, os, signal, sys
import batchgen.data.output_dir as od

point, at, note = sys.argv[1], int(sys.argv[2]), sys.argv[3]
calls = [0]
write_checkpoint, put_unit = od.OutputDir.write_checkpoint, od.OutputDir._put_unit

def die(self):
    json.dump({"saved": self.manifest.rows_done}, open(note, "w"))  # what the state held (recorded)
    os.kill(os.getpid(), signal.SIGKILL)

def _put_unit(self, name, data):
    out = put_unit(self, name, data)
    if point == "file" and name.startswith("_checkpoint/") and calls[0] == at:
        die(self)  # the checkpoint file written, its record not
    return out

def _write_checkpoint(self, *a, **k):
    calls[0] += 1
    name = write_checkpoint(self, *a, **k)
    if point == "record" and calls[0] == at:
        die(self)  # recorded
    return name

od.OutputDir.write_checkpoint, od.OutputDir._put_unit = _write_checkpoint, _put_unit
"""


@pytest.mark.parametrize("point", ["file", "record"])
def test_kill_9_during_an_interval_checkpoint_with_parts_far_larger_than_windows(
    llama_ckpt: str, prompts: Path, tmp_path: Path, point: str
) -> None:
    """Windows of 8 rows, one part for the whole job (``data.part_rows`` far above the window), a checkpoint
    after every engine step: killed during the third checkpoint, the run keeps every window committed (as
    pieces: no part rolled yet) and every row of the checkpoints before it; the rerun recomputes only the rest
    and the output is the uninterrupted run's, each row exactly once."""
    from batchgen.data.commit_log import read_state
    from batchgen.data.local_storage import LocalLocation

    kw = {"window_rows": 8, "part_rows": 10_000}
    ref = tmp_path / "ref"
    assert run_job(_cfg(llama_ckpt, prompts, ref, **kw), handle_signals=False).exit_code == EXIT_OK
    out, note = tmp_path / "out", tmp_path / "note.json"
    script = _CHECKPOINT_KILLER + textwrap.dedent(f"""
        from batchgen.engine.config import EngineConfig
        from batchgen.job.config import DataOptions, JobConfig, ModelOptions, RunOptions, default_sampling
        from batchgen.job.run import run_job
        import dataclasses
        cfg = JobConfig(
            model=ModelOptions(path={llama_ckpt!r}),
            data=DataOptions(input={str(prompts)!r}, output={str(out)!r}, window_rows=8, part_rows=10_000),
            engine=EngineConfig(device="cpu", num_blocks=256, max_num_seqs=2),
            sampling=dataclasses.replace(default_sampling(), max_tokens=3, temperature=0),
            run=RunOptions(progress="off", checkpoint_interval_s=1e-9),
        )
        sys.exit(run_job(cfg, handle_signals=False, print_summary=False).exit_code)
    """)
    args = [sys.executable, "-c", script, point, "3", str(note)]
    proc = subprocess.run(args, env=env_without_slurm(), capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]

    state = read_state(LocalLocation(out))[0]
    assert state is not None and state.parts == []  # the part was far from full: windows are pieces
    before = json.loads(note.read_text())["saved"]
    assert state.rows_done >= before > 0  # nothing the earlier checkpoints (and commits) held was lost
    if point == "record":  # `before` counts the checkpoint recorded before the kill: its rows are kept
        assert state.rows_done == before and state.partial
    assert not list(out.glob("*.parquet"))  # a reader sees no part yet, never a partial one

    res = run_job(_cfg(llama_ckpt, prompts, out, **kw), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    assert res.report["run"]["rows"] <= ROWS - state.rows_done  # only what no checkpoint held is redone
    assert _parts(out) == [[0, 3]]
    assert _rows(out) == _rows(ref)
    assert not (out / "_checkpoint").exists() and not (out / "_windows").exists()
