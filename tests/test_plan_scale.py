"""Planning costs O(files), never O(rows) or O(windows): a billion rows over a thousand files are planned
(and resumed) holding three integers for the windows, and a real input's planning reads each footer once and
no row. Structure is asserted (types, counts of calls, bytes allocated), never time."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config

import batchgen.data.reader as reader
import batchgen.job.plan as plan_mod
from batchgen.data.manifest import WindowRecord
from batchgen.data.reader import InputFile, WindowPlan, WindowSpec, input_set, iter_windows, open_input
from batchgen.job.plan import fresh_manifest, plan_job
from batchgen.job.resume import WindowsTodo, windows_to_do

FILES = 1000
ROWS_PER_FILE = 1_000_000  # 1e9 rows in all
SCHEMA = pa.schema([("prompt", pa.string())])


def _billion_rows() -> reader.InputSet:
    """A 1e9-row input described by its footers' facts only (what planning reads of a file)."""
    files, start = [], 0
    for i in range(FILES):
        rgs = [ROWS_PER_FILE // 4] * 4
        files.append(InputFile(f"/big/f{i:05d}.parquet", f"f{i:05d}.parquet", 1 << 20, ROWS_PER_FILE, start,
                               rgs, SCHEMA, f"{i:064x}"))  # fmt: skip
        start += ROWS_PER_FILE
    return input_set("/big", files)


def test_windows_are_arithmetic() -> None:
    wins = WindowPlan(10, 95, 8)
    assert len(wins) == 11 and wins[0] == WindowSpec(0, 10, 18) and wins[-1] == WindowSpec(10, 90, 95)
    assert list(wins) == [WindowSpec(w, 10 + 8 * w, min(18 + 8 * w, 95)) for w in range(11)]
    assert len(WindowPlan(5, 5, 8)) == 0 and list(WindowPlan(5, 5, 8)) == []
    with pytest.raises(IndexError):
        wins[11]
    huge = WindowPlan(0, 10**12, 1024)  # a trillion rows: still three integers
    assert len(huge) == 976_562_500 and huge[976_562_499] == WindowSpec(976_562_499, 10**12 - 1024, 10**12)


def test_a_billion_rows_plan_and_resume_in_o_files(
    llama_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = _billion_rows()
    monkeypatch.setattr(plan_mod, "open_input", lambda *a, **k: big)
    cfg = job_config(
        llama_ckpt, "/big", tmp_path / "out", data={"window_rows": 1024, "shard": {"index": 1, "count": 3}}
    )
    plan_job(cfg)  # warm the imports the model's facts need: what is measured below is planning itself

    tracemalloc.start()
    plan = plan_job(cfg)
    manifest = fresh_manifest(plan)
    for w in (0, 1, 5):  # a resume: three windows committed
        s = plan.windows[w]
        manifest.windows[w] = WindowRecord(
            f"p{w}", s.row_start, s.row_end, s.num_rows, s.num_rows, 0, 0, 0, 0
        )
    todo = windows_to_do(plan, manifest, None)  # type: ignore[arg-type]
    it = iter(todo)
    first = [next(it) for _ in range(4)]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert (plan.row_start, plan.row_end) == (333_333_333, 666_666_666)
    assert isinstance(plan.windows, WindowPlan)  # no list of windows
    assert len(plan.windows) == manifest.num_windows == -(-333_333_333 // 1024)
    assert isinstance(todo, WindowsTodo) and len(todo) == len(plan.windows) - 3
    assert [t.spec.index for t in first] == [2, 3, 4, 6]
    assert first[0].spec.row_start == 333_333_333 + 2 * 1024
    assert peak < 4 << 20, peak  # bytes: nothing per row or per window (325,521 windows) was held


def test_windows_are_read_from_a_lazy_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pq.write_table(pa.table({"k": list(range(50))}), tmp_path / "a.parquet", row_group_size=7)
    inp = open_input(str(tmp_path / "a.parquet"))
    pulled: list[int] = []

    def specs():  # an endless stream of windows: the reader must consume it one at a time
        w = 0
        while True:
            pulled.append(w)
            yield WindowSpec(w, 10 * w, 10 * w + 10)
            w += 1

    got = iter_windows(inp, (s for s in specs() if s.index % 2 == 0 or s.row_start > 50), ["k"])
    first = next(got)
    assert first.table.column("k").to_pylist() == list(range(10))
    assert pulled == [0]  # nothing read ahead
    second = next(got)
    assert second.index == 2 and second.table.column("k").to_pylist() == list(range(20, 30))
    assert pulled == [0, 1, 2]
    with pytest.raises(ValueError, match="ascending"):
        list(iter_windows(inp, [WindowSpec(1, 10, 20), WindowSpec(0, 0, 10)], ["k"]))


def test_planning_reads_each_footer_once_and_no_row(
    llama_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    for i in range(60):
        pq.write_table(
            pa.table({"prompt": [f"p{i}-{j}" for j in range(1 + i % 5)]}), inp / f"{i:03d}.parquet"
        )
    footers: list[str] = []
    real_footer = reader.read_footer

    def counted(path: str, size: int):
        footers.append(path)
        return real_footer(path, size)

    def no_rows(*a, **k):
        raise AssertionError("planning opened a file to read rows")

    monkeypatch.setattr(reader, "read_footer", counted)
    monkeypatch.setattr(reader.pq, "ParquetFile", no_rows)
    monkeypatch.setattr(reader.pq, "read_table", no_rows)
    plan = plan_job(job_config(llama_ckpt, inp, tmp_path / "out", data={"window_rows": 4}))
    assert sorted(footers) == sorted(str(p) for p in inp.glob("*.parquet"))  # each footer once
    assert plan.input.num_rows == sum(1 + i % 5 for i in range(60))
    assert len({id(f.schema) for f in plan.input.files}) == 1  # one schema object for files of one schema


def test_many_remote_files_keep_the_manifest_small() -> None:
    from batchgen.job.input_versions import input_versions_unchanged

    def remote(n: int, changed: int | None = None) -> reader.InputSet:
        files = [InputFile(f"s3://b/f{i}", f"f{i}", 10, 1, i, [1], SCHEMA, "x", None, "v2" if i == changed else "v1")
                 for i in range(n)]  # fmt: skip
        return input_set("s3://b", files)

    few, many = remote(3).describe(), remote(reader.LISTED_VERSIONS + 1).describe()
    assert set(few["versions"]) == {"f0", "f1", "f2"} and "versions" not in many
    assert len(json.dumps(many)) < 500  # one digest, not a line per object
    assert input_versions_unchanged(many, remote(reader.LISTED_VERSIONS + 1).describe())
    assert not input_versions_unchanged(many, remote(reader.LISTED_VERSIONS + 1, changed=7).describe())
