"""Streaming reader: file resolution and order, global row index, shards, windows, bounded memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.data.reader import (
    InputError,
    iter_windows,
    open_input,
    plan_windows,
    resolve_files,
    shard_range,
)


def _write(path: Path, start: int, n: int, row_group_size: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = pa.table(
        {
            "k": pa.array(range(start, start + n), pa.int64()),
            "prompt": [f"p{i}" for i in range(start, start + n)],
        }
    )
    pq.write_table(t, path, row_group_size=row_group_size)


@pytest.fixture
def multi(tmp_path: Path) -> Path:
    """A directory of files whose sorted order is b/…, c.parquet, d/… with odd row groups and an empty file."""
    root = tmp_path / "in"
    _write(root / "b" / "x.parquet", 0, 37, row_group_size=10)
    _write(root / "b" / "y.parquet", 37, 0)
    _write(root / "c.parquet", 37, 5)
    _write(root / "d" / "z.parquet", 42, 61, row_group_size=7)
    (root / "notes.txt").write_text("ignored")
    (root / ".hidden").mkdir()
    _write(root / ".hidden" / "skip.parquet", 1000, 3)
    return root


def test_resolve_file_dir_glob(multi: Path) -> None:
    files, _ = resolve_files(str(multi))
    assert [os.path.relpath(f, multi) for f in files] == [
        "b/x.parquet",
        "b/y.parquet",
        "c.parquet",
        "d/z.parquet",
    ]
    files, _ = resolve_files(str(multi / "**" / "*.parquet"))
    assert [os.path.relpath(f, multi) for f in files] == [
        "b/x.parquet",
        "b/y.parquet",
        "c.parquet",
        "d/z.parquet",
    ]
    files, _ = resolve_files(str(multi / "c.parquet"))
    assert len(files) == 1
    with pytest.raises(InputError, match="does not exist"):
        resolve_files(str(multi / "nope.parquet"))
    with pytest.raises(InputError, match="no file matches"):
        resolve_files(str(multi / "*.csv"))
    (multi / "empty").mkdir()
    with pytest.raises(InputError, match="no \\*.parquet"):
        resolve_files(str(multi / "empty"))


def test_not_parquet_is_an_input_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.parquet"
    p.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match="not a Parquet file"):
        open_input(str(p))


def test_global_row_index_follows_sorted_file_order(multi: Path) -> None:
    inp = open_input(str(multi))
    assert inp.num_rows == 103
    assert [f.row_start for f in inp.files] == [0, 37, 37, 42]
    wins = plan_windows(0, inp.num_rows, 16)
    ks = []
    for w in iter_windows(inp, wins, ["k"], batch_rows=4):
        assert w.table.num_rows == w.spec.num_rows
        ks += w.table.column("k").to_pylist()
    assert ks == list(range(103))  # k was written equal to the global row index


@pytest.mark.parametrize("count", [1, 2, 3, 7, 103, 150])
def test_shards_cover_every_row_exactly_once(multi: Path, count: int) -> None:
    inp = open_input(str(multi))
    seen: list[int] = []
    for i in range(count):
        s, e = shard_range(inp.num_rows, i, count)
        for w in iter_windows(inp, plan_windows(s, e, 5), ["k"]):
            seen += w.table.column("k").to_pylist()
    assert sorted(seen) == list(range(inp.num_rows))
    assert len(seen) == len(set(seen))


def test_windows_skip_finished_ones(multi: Path) -> None:
    inp = open_input(str(multi))
    wins = plan_windows(10, 90, 9)
    assert wins[0].row_start == 10 and wins[-1].row_end == 90 and wins[-1].num_rows == 80 % 9
    todo = [w for w in wins if w.index % 3 == 1]
    got = {w.index: w.table.column("k").to_pylist() for w in iter_windows(inp, todo, ["k", "prompt"])}
    assert set(got) == {w.index for w in todo}
    for w in todo:
        assert got[w.index] == list(range(w.row_start, w.row_end))


def test_fingerprint_is_stable_and_content_sensitive(tmp_path: Path) -> None:
    _write(tmp_path / "a" / "x.parquet", 0, 20)
    fp = open_input(str(tmp_path / "a")).fingerprint
    assert open_input(str(tmp_path / "a")).fingerprint == fp
    # the same data copied elsewhere (new mtime, new root) keeps the fingerprint
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.parquet").write_bytes((tmp_path / "a" / "x.parquet").read_bytes())
    assert open_input(str(tmp_path / "b")).fingerprint == fp
    _write(tmp_path / "a" / "x.parquet", 1, 20)  # same size and row count, other content
    assert open_input(str(tmp_path / "a")).fingerprint != fp


def test_missing_column_fails_at_read(multi: Path) -> None:
    inp = open_input(str(multi))
    assert inp.has_column("prompt") and not inp.has_column("nope")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc for peak RSS")
def test_memory_stays_bounded_by_the_window(tmp_path: Path) -> None:
    """200k rows of ~2 KB prompts (~400 MB decoded) read in 1000-row windows: peak RSS grows far less."""
    data = tmp_path / "big"
    data.mkdir()
    script = textwrap.dedent(
        f"""
        import pyarrow as pa, pyarrow.parquet as pq
        base = "lorem ipsum dolor sit amet " * 80
        for f in range(2):
            with pq.ParquetWriter("{data}/part-%d.parquet" % f, pa.schema([("prompt", pa.string())]),
                                  compression="zstd") as w:
                for c in range(10):
                    start = (f * 10 + c) * 10000
                    w.write_table(pa.table({{"prompt": [f"{{i}} {{base}}" for i in range(start, start + 10000)]}}))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    reader = textwrap.dedent(
        f"""
        import re
        from batchgen.data.reader import open_input, plan_windows, iter_windows
        inp = open_input("{data}")
        assert inp.num_rows == 200_000, inp.num_rows
        base = int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
        total = 0
        for w in iter_windows(inp, plan_windows(0, inp.num_rows, 1000), ["prompt"]):
            total += sum(len(s) for s in w.table.column("prompt").to_pylist())
        # VmHWM: this process's peak RSS (ru_maxrss would include the forking parent's)
        peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
        print(total, peak - base)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", reader], check=True, capture_output=True, text=True, cwd=tmp_path
    ).stdout
    total, growth = map(int, out.split())
    assert total > 400_000_000
    assert growth < 80 * 2**20, (
        f"peak RSS grew by {growth / 2**20:.0f} MiB while reading {total / 2**20:.0f} MiB"
    )


def test_a_corrupt_row_group_reads_as_null_rows_naming_file_and_row_group(tmp_path: Path) -> None:
    p = tmp_path / "in.parquet"
    _write(p, 0, 30, row_group_size=10)
    off = pq.read_metadata(p).row_group(1).column(1).data_page_offset
    b = bytearray(p.read_bytes())
    b[off : off + 24] = b"\xff" * 24
    p.write_bytes(bytes(b))
    inp = open_input(str(p))
    wins = list(iter_windows(inp, plan_windows(0, 30, 8), ["k", "prompt"]))
    assert [w.table.num_rows for w in wins] == [8, 8, 8, 6]  # no row goes missing
    prompts = [x for w in wins for x in w.table.column("prompt").to_pylist()]
    assert prompts[:10] == [f"p{i}" for i in range(10)] and prompts[20:] == [f"p{i}" for i in range(20, 30)]
    assert prompts[10:20] == [None] * 10
    spans = [(w.index, s, e) for w in wins for s, e, _ in w.unreadable]
    assert spans == [(1, 2, 8), (2, 0, 4)]  # window-relative positions of input rows 10..20
    msg = wins[1].unreadable[0][2]
    assert msg.startswith("input unreadable: 'in.parquet' row group 1 (input rows 10..20): "), msg


def test_read_schema_unifies_types_or_names_the_files(tmp_path: Path) -> None:
    root = tmp_path / "in"
    root.mkdir()
    pq.write_table(pa.table({"prompt": pa.array(["a"]).dictionary_encode(), "n": pa.array([1], pa.int32())}),
                   root / "a.parquet")  # fmt: skip
    pq.write_table(pa.table({"prompt": ["b"], "n": pa.array([2], pa.int64())}), root / "b.parquet")
    inp = open_input(str(root))
    schema = inp.read_schema(["prompt", "n"])
    assert schema.field("prompt").type == pa.string() and schema.field("n").type == pa.int64()
    w = next(iter_windows(inp, plan_windows(0, 2, 2), ["prompt", "n"]))
    assert w.table.schema == schema and w.table.column("prompt").to_pylist() == ["a", "b"]
    pq.write_table(pa.table({"prompt": ["c"], "n": ["three"]}), root / "c.parquet")
    with pytest.raises(
        InputError, match=r"column 'n' has incompatible types .* int32 in 'a.parquet', string in 'c.parquet'"
    ):
        open_input(str(root)).read_schema(["prompt", "n"])


def test_window_hash_depends_on_content_only(tmp_path: Path) -> None:
    from batchgen.data.values import window_sha256

    t = pa.table({"prompt": ["x", None, "z"], "ts": pa.array([0, 2**62, None], pa.timestamp("us"))})
    same = pa.Table.from_batches(t.to_batches(max_chunksize=1))
    assert window_sha256(t) == window_sha256(same)  # chunking does not matter; out-of-range values hash
    edited = pa.table({"prompt": ["x", None, "y"], "ts": t.column("ts")})
    assert window_sha256(edited) != window_sha256(t)


def test_pages_written_with_a_checksum_are_verified(tmp_path: Path) -> None:
    """A flipped byte in the data of a page with a CRC: the row group is unreadable, not silently wrong."""
    p = tmp_path / "in.parquet"
    t = pa.table({"prompt": [f"prompt number {i:03d}" for i in range(20)]})
    pq.write_table(
        t, p, row_group_size=10, compression="none", write_page_checksum=True, use_dictionary=False
    )
    data = bytearray(p.read_bytes())
    i = data.index(b"prompt number 014")
    data[i + 7] ^= 0x01
    p.write_bytes(bytes(data))
    w = next(iter_windows(open_input(str(p)), plan_windows(0, 20, 20), ["prompt"]))
    assert [(s, e) for s, e, _ in w.unreadable] == [(10, 20)]
    assert w.table.column("prompt").to_pylist()[:10] == [f"prompt number {i:03d}" for i in range(10)]


def test_opening_the_input_pays_pyarrows_first_conversion(multi: Path) -> None:
    """pyarrow imports pandas on its first conversion of Python objects (0.1-0.2 s): opening the input does it,
    in the job's start-up, so the first window's commit (inside the job's wall time) does not."""
    import subprocess
    import sys

    code = (
        "import sys; from batchgen.data.reader import open_input; "
        f"open_input({str(multi)!r}); print('pandas' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    pytest.importorskip("pandas", reason="pandas is not installed: pyarrow has nothing to import")
    assert out.strip() == "True"
