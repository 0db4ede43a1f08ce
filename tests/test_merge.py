"""batchgen-merge on synthetic shard outputs (written with batchgen's own OutputDir/Manifest, no engine)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.data.layout import METADATA_KEY, rolled_part_name, shard_dir_name
from batchgen.data.manifest import Manifest, PartRecord, WindowRecord
from batchgen.data.output_dir import OutputDir
from batchgen.data.part_roll import PartRoller
from batchgen.data.reader import open_input, plan_windows, shard_range
from batchgen.job.merge import verify
from batchgen.job.merge_cli import EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, main


def write_input(path: Path, num_rows: int, id_column: str | None = None, files: int = 1) -> str:
    """A Parquet input (one file, or a directory of `files` files) with a prompt column."""
    rows = list(range(num_rows))
    chunks = [rows[i * num_rows // files : (i + 1) * num_rows // files] for i in range(files)]
    if files > 1:
        path.mkdir(parents=True)
    for k, chunk in enumerate(chunks):
        cols = {"prompt": [f"prompt {i}" for i in chunk]}
        if id_column:
            cols[id_column] = [f"row-{i:04d}" for i in chunk]
        pq.write_table(pa.table(cols), path / f"part-{k}.parquet" if files > 1 else path)
    return str(path)


def fake_job(
    out: Path,
    input_spec: str,
    *,
    shards: int = 1,
    window_rows: int = 4,
    id_column: str | None = None,
    n: int = 1,
    skip_windows: set[tuple[int, int]] = frozenset(),
) -> None:
    """Write what `batchgen` would write for this input, with `generated_text = "gen <id> <sample>"`.

    `skip_windows` holds (shard, window) pairs left unfinished (absent from the manifest).
    """
    inp = open_input(input_spec)
    ids_all: list = (
        [x for f in inp.files for x in pq.read_table(f.path, columns=[id_column]).column(0).to_pylist()]
        if id_column
        else list(range(inp.num_rows))
    )
    config = {
        "data": {"id_column": id_column, "window_rows": window_rows},
        "sampling": {"n": n, "max_tokens": 4},
    }
    for index in range(shards):
        start, end = shard_range(inp.num_rows, index, shards)
        windows = plan_windows(start, end, window_rows)
        manifest = Manifest(
            fingerprint="cfg-fp",
            config=config,
            input=inp.describe(),
            shard={"index": index, "count": shards, "row_start": start, "row_end": end},
            window_rows=window_rows,
            num_windows=len(windows),
            batchgen_version="test",
        )
        od = OutputDir(out, index, shards)
        od.open(manifest)
        for w in windows:
            if (index, w.index) in skip_windows:
                continue
            od.commit(w.index, part_table(ids_all[w.row_start : w.row_end], n, w.index), record(w))
        PartRoller(od, part_rows=1).open()  # a part per window, as far as the windows are contiguous
        od.close()


def part_table(ids: list, n: int, window: int) -> pa.Table:
    cols: dict = {"id": [i for i in ids for _ in range(n)]}
    if n > 1:
        cols["sample_index"] = pa.array([k for _ in ids for k in range(n)], pa.int32())
    cols["generated_text"] = [f"gen {i} {k}" for i in ids for k in range(n)]
    cols["status"] = ["ok"] * len(cols["id"])
    meta = {"input": {}, "window": {"index": window}, "shard": {"index": 0, "count": 1}}
    return pa.table(cols).replace_schema_metadata({METADATA_KEY: json.dumps(meta)})


def record(w) -> WindowRecord:
    return WindowRecord("", w.row_start, w.row_end, w.num_rows, w.num_rows, 0, 0, 0, 0)


def add_part(shard_dir: Path, table: pa.Table, row_start: int, row_end: int) -> None:
    """Register an extra part after a shard's last (to fake duplicates / unknown ids): a window of its own in
    the manifest, the next part in its ``parts``."""
    m = Manifest.load(shard_dir)
    window = m.parts[-1].last + 1
    name = rolled_part_name(len(m.parts))
    pq.write_table(table, shard_dir / name)
    m.parts.append(PartRecord(name, window, window))
    m.windows[window] = WindowRecord(name, row_start, row_end, table.num_rows, table.num_rows, 0, 0, 0, 0)
    m.num_windows = max(m.num_windows, len(m.windows))
    m.save(shard_dir)


def test_complete_sharded_output_verifies_and_merges_in_input_order(tmp_path: Path, capsys) -> None:
    inp = write_input(tmp_path / "in.parquet", 22)
    fake_job(tmp_path / "out", inp, shards=3)
    r = verify(tmp_path / "out")
    assert r.ok and (r.missing, r.duplicated, r.unknown) == (0, 0, 0)
    assert (r.shard_count, r.shards_found, r.shards_missing) == (3, [0, 1, 2], [])
    assert (r.input_rows, r.output_rows, r.expected_rows, r.in_order) == (22, 22, 22, True)
    dest = tmp_path / "merged.parquet"
    assert main([str(tmp_path / "out"), "--write", str(dest)]) == EXIT_OK
    assert "OK: every input row is covered exactly once" in capsys.readouterr().out
    t = pq.read_table(dest)
    assert t.column("id").to_pylist() == list(range(22))
    assert t.column("generated_text").to_pylist() == [f"gen {i} 0" for i in range(22)]
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    assert "window" not in meta and meta["shard"]["merged"] is True and meta["merged"]["complete"]


def test_single_output_directory(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.parquet", 9)
    fake_job(tmp_path / "out", inp, shards=1, window_rows=5)
    r = verify(tmp_path / "out")
    assert r.ok and r.shard_count == 1 and r.parts == 2


def test_missing_shard_and_unfinished_window_are_reported(tmp_path: Path, capsys) -> None:
    inp = write_input(tmp_path / "in.parquet", 20)
    fake_job(tmp_path / "out", inp, shards=4, window_rows=2, skip_windows={(3, 1)})
    shutil.rmtree(tmp_path / "out" / shard_dir_name(1, 4))
    r = verify(tmp_path / "out", max_examples=3)
    assert not r.ok
    assert r.shards_missing == [1] and r.shards_incomplete == {3: "2/3 windows"}
    # shard 1 = rows 5..9 (5 rows), shard 3 window 1 = rows 17..18, and its window 2 (row 19): committed, but
    # no part holds it before window 1 is done (parts are contiguous)
    assert r.missing == 5 + 2 + 1 and r.duplicated == 0
    assert [(p.id, p.row, p.shard) for p in r.missing_examples] == [(5, 5, 1), (6, 6, 1), (7, 7, 1)]
    assert main([str(tmp_path / "out")]) == EXIT_INCOMPLETE
    out = capsys.readouterr().out
    assert "missing shard(s): 1" in out and "shard 3 unfinished: 2/3 windows" in out
    assert "FAILED: missing 8" in out
    # --write refuses an incomplete merge unless --force
    dest = tmp_path / "m.parquet"
    assert main([str(tmp_path / "out"), "--write", str(dest)]) == EXIT_INCOMPLETE
    assert not dest.exists()
    assert main([str(tmp_path / "out"), "--write", str(dest), "--force"]) == EXIT_INCOMPLETE
    assert pq.read_table(dest).num_rows == 12


def test_duplicated_and_unknown_ids(tmp_path: Path, capsys) -> None:
    inp = write_input(tmp_path / "in.parquet", 12)
    fake_job(tmp_path / "out", inp, shards=2, window_rows=3)
    shard0 = tmp_path / "out" / shard_dir_name(0, 2)
    # rows 2 and 3 written again in an extra part, plus an id the input does not have
    add_part(shard0, part_table([2, 3, 99], 1, 7), 2, 5)
    r = verify(tmp_path / "out")
    assert (r.missing, r.duplicated, r.unknown) == (0, 2, 1)
    assert [(p.id, p.count) for p in r.duplicated_examples] == [(2, 2), (3, 2)]
    assert [p.id for p in r.unknown_examples] == [99]
    assert not r.in_order
    assert main([str(tmp_path / "out"), "--json"]) == EXIT_INCOMPLETE
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False and d["duplicated"] == 2 and d["unknown"] == 1


def test_leftover_part_outside_the_manifest_is_ignored(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.parquet", 8)
    fake_job(tmp_path / "out", inp, shards=2, window_rows=4, skip_windows={(1, 0)})
    shard1 = tmp_path / "out" / shard_dir_name(1, 2)
    pq.write_table(part_table([4, 5, 6, 7], 1, 0), shard1 / "part-000000.parquet")  # not in the manifest
    r = verify(tmp_path / "out")
    assert r.missing == 4 and r.duplicated == 0 and r.parts == 1


def test_id_column_is_read_from_the_input_and_input_can_be_relocated(tmp_path: Path, capsys) -> None:
    inp = write_input(tmp_path / "data", 15, id_column="key", files=3)
    fake_job(tmp_path / "out", inp, shards=2, window_rows=4, id_column="key")
    r = verify(tmp_path / "out")
    assert r.ok and r.id_column == "key" and r.input == inp
    moved = tmp_path / "moved"
    shutil.move(inp, moved)
    assert main([str(tmp_path / "out")]) == EXIT_ERROR
    assert "pass --input" in capsys.readouterr().err
    dest = tmp_path / "m.parquet"
    assert main([str(tmp_path / "out"), "--input", str(moved), "--write", str(dest)]) == EXIT_OK
    assert pq.read_table(dest).column("id").to_pylist() == [f"row-{i:04d}" for i in range(15)]


def test_missing_string_id_examples_name_the_id(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.parquet", 10, id_column="key")
    fake_job(tmp_path / "out", inp, shards=2, window_rows=5, id_column="key", skip_windows={(1, 0)})
    r = verify(tmp_path / "out", max_examples=2)
    assert r.missing == 5
    assert [(p.id, p.row, p.shard) for p in r.missing_examples] == [("row-0005", 5, 1), ("row-0006", 6, 1)]


def test_changed_input_is_refused(tmp_path: Path, capsys) -> None:
    inp = write_input(tmp_path / "in.parquet", 10, id_column="key")
    fake_job(tmp_path / "out", inp, shards=2, id_column="key")
    write_input(tmp_path / "in.parquet", 11, id_column="key")
    assert main([str(tmp_path / "out")]) == EXIT_ERROR
    assert "is not the one the job read" in capsys.readouterr().err


def test_samples_per_row(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.parquet", 6)
    fake_job(tmp_path / "out", inp, shards=2, window_rows=2, n=3)
    r = verify(tmp_path / "out")
    assert r.ok and r.samples_per_row == 3 and r.expected_rows == 18 == r.output_rows
    # one sample of row 4 lost, one sample of row 1 twice
    shard1 = tmp_path / "out" / shard_dir_name(1, 2)
    t = pq.read_table(shard1 / rolled_part_name(0))  # window 0: rows 3, 4
    pq.write_table(t.slice(0, 4), shard1 / rolled_part_name(0))  # drops (4, sample 1) and (4, 2)
    add_part(shard1, part_table([1], 3, 5).slice(1, 1), 1, 2)
    r = verify(tmp_path / "out")
    assert (r.missing, r.duplicated, r.unknown) == (2, 1, 0)
    assert [(p.id, p.sample_index) for p in r.missing_examples] == [(4, 1), (4, 2)]
    assert [(p.id, p.sample_index, p.count) for p in r.duplicated_examples] == [(1, 1, 2)]


def test_errors_exit_2(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "nope")]) == EXIT_ERROR
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == EXIT_ERROR
    assert "holds no batchgen output" in capsys.readouterr().err
    # two jobs of different shard layouts in one output
    inp = write_input(tmp_path / "in.parquet", 8)
    fake_job(tmp_path / "mixed", inp, shards=2)
    fake_job(tmp_path / "other", inp, shards=4)
    shutil.copytree(tmp_path / "other" / shard_dir_name(3, 4), tmp_path / "mixed" / shard_dir_name(3, 4))
    assert main([str(tmp_path / "mixed")]) == EXIT_ERROR
    assert "mixes shard layouts" in capsys.readouterr().err


def test_input_with_repeated_ids(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c", "d"], "key": ["x", "y", "x", "z"]}), path)
    fake_job(tmp_path / "out", str(path), shards=2, window_rows=2, id_column="key")
    r = verify(tmp_path / "out")
    assert r.ok and r.input_duplicate_ids == 1 and r.in_order


@pytest.mark.parametrize("shards", [1, 5])
def test_console_script_entry_point(tmp_path: Path, shards: int) -> None:
    import subprocess
    import sys

    inp = write_input(tmp_path / "in.parquet", 7)
    fake_job(tmp_path / "out", inp, shards=shards, window_rows=3)
    p = subprocess.run(
        [sys.executable, "-m", "batchgen.job.merge_cli", str(tmp_path / "out")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert f"{shards}/{shards} present" in p.stdout
