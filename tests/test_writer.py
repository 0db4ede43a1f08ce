"""Output parts and directory: schema, rows per sample, atomic commits, resume checks, overwrite, lock."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.data.layout import PIECE_RE, TEMP_PREFIX, is_own_file, part_name, rolled_part_name
from batchgen.data.manifest import Manifest, WindowRecord, diff_config
from batchgen.data.output_dir import OutputDir
from batchgen.data.parts import PartLayout, build_part
from batchgen.data.prompts import PromptRow
from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
from batchgen.errors import ConfigError
from batchgen.runtime.atomic import atomic_write


def _manifest(
    fp: str = "f1", input_fp: str = "i1", num_windows: int = 3, cfg: dict | None = None
) -> Manifest:
    return Manifest(
        fingerprint=fp,
        config=cfg or {"sampling": {"temperature": 1.0}},
        input={"fingerprint": input_fp, "num_files": 1, "num_rows": 30},
        shard={"index": 0, "count": 1, "row_start": 0, "row_end": 30},
        window_rows=10,
        num_windows=num_windows,
        batchgen_version="0.1.0",
    )


def _rec(w: int) -> WindowRecord:
    return WindowRecord("", w * 10, w * 10 + 10, 10, 10, 0, 0, 0, 0)


def _table() -> pa.Table:
    return pa.table({"x": [1, 2]})


def test_build_part_rows_in_input_order_with_samples_and_errors() -> None:
    rows = [PromptRow(0, 10, "a"), PromptRow(1, 11, "b"), PromptRow(2, 12, "c")]
    rows[0].token_ids, rows[2].token_ids = [1, 2, 3], [4]
    rows[1].error, rows[1].num_prompt_tokens = "prompt is null", None
    results = [
        RequestOutput(10, [1, 2, 3], [CompletionOutput(1, "y", [7], "stop"), CompletionOutput(0, "x", [5, 6], "length")], 2),
        None,
        RequestOutput(12, [4], [CompletionOutput(0, "", [], "error"), CompletionOutput(1, "", [], "error")], 0, "too long"),
    ]  # fmt: skip
    kept = pa.table({"cat": ["p", "q", "r"]})
    layout = PartLayout(
        pa.string(), [pa.field("cat", pa.string())], n=2, logprobs=False, metadata={"model": "m"}
    )
    table, st = build_part(layout, rows, results, kept, {"index": 1})
    assert table.column_names == [
        "id", "sample_index", "cat", "generated_text", "token_ids", "num_prompt_tokens", "num_generated_tokens",
        "num_cached_tokens", "finish_reason", "status", "error",
    ]  # fmt: skip
    d = table.to_pydict()
    assert d["id"] == ["a", "a", "b", "b", "c", "c"]
    assert d["sample_index"] == [0, 1, 0, 1, 0, 1]
    assert d["cat"] == ["p", "p", "q", "q", "r", "r"]
    assert d["generated_text"] == ["x", "y", None, None, None, None]
    assert d["token_ids"] == [[5, 6], [7], None, None, None, None]
    assert d["num_generated_tokens"] == [2, 1, 0, 0, 0, 0]
    assert d["num_cached_tokens"] == [2, 2, 0, 0, 0, 0]
    assert d["num_prompt_tokens"] == [3, 3, None, None, 1, 1]
    assert d["status"] == ["ok", "ok", "error", "error", "error", "error"]
    assert d["error"] == [None, None, "prompt is null", "prompt is null", "too long", "too long"]
    assert d["finish_reason"] == ["length", "stop", "error", "error", "error", "error"]
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())
    meta = json.loads(table.schema.metadata[b"batchgen"])
    # row 2 failed in the engine (retryable with data.retry_errors), row 1 in its data (not retryable)
    assert meta == {"model": "m", "window": {"index": 1, "retry_rows": [2]}}
    assert (st.rows_ok, st.rows_error, st.num_output_rows, st.generated_tokens) == (1, 2, 6, 3)
    assert st.retry_rows == [2]


def test_build_part_logprobs_and_no_sample_index_for_n1() -> None:
    rows = [PromptRow(0, 0, 0)]
    rows[0].token_ids = [1]
    res = [
        RequestOutput(
            0, [1], [CompletionOutput(0, "t", [5, 6], "length", [{5: -0.1, 9: -2.0}, {6: -0.5}])], 0
        )
    ]
    layout = PartLayout(pa.int64(), [], n=1, logprobs=True, metadata={})
    table, _ = build_part(layout, rows, res, None, {})
    assert "sample_index" not in table.column_names
    assert table.column("logprobs").to_pylist()[0][0] == [(5, pytest.approx(-0.1)), (9, -2.0)]


def test_commit_is_atomic_and_resume_cleans_leftovers(tmp_path: Path) -> None:
    out = OutputDir(tmp_path / "out")
    m = out.open(_manifest())
    out.commit(0, _table(), _rec(0))
    assert m.windows[0].part == part_name(0)
    out.close()
    # leftovers of a killed run: a temp file and a part the manifest never recorded
    (out.path / ".tmp-part-000001.parquet.abc").write_bytes(b"partial")
    pq.write_table(_table(), out.path / part_name(2))
    pq.write_table(_table(), out.path / rolled_part_name(0))  # a part no record names
    (out.path / "user-notes.txt").write_text("keep me")
    m2 = OutputDir(tmp_path / "out").open(_manifest())
    assert set(m2.windows) == {0}
    names = sorted(p.name for p in out.path.iterdir())
    assert names == [
        ".batchgen.lock",
        "_commits",
        "_layout.json",
        "_manifest.json",
        "_windows",
        "user-notes.txt",
    ]
    assert [p.name for p in (out.path / "_windows").iterdir()] == [Path(part_name(0)).name]
    assert Manifest.load(out.path).windows[0].row_end == 10


def test_different_config_is_refused_with_the_difference(tmp_path: Path) -> None:
    with OutputDir(tmp_path) as out:
        out.open(_manifest(cfg={"sampling": {"temperature": 1.0}}))
        out.commit(0, _table(), _rec(0))
    with pytest.raises(ConfigError, match=r"sampling.temperature: 1.0 -> 0.5(.|\n)*data.overwrite=true"):
        OutputDir(tmp_path).open(_manifest(fp="f2", cfg={"sampling": {"temperature": 0.5}}))
    with pytest.raises(ConfigError, match="different input data"):
        OutputDir(tmp_path).open(_manifest(input_fp="i2"))
    # overwrite discards batchgen's files (only those) and starts afresh
    (tmp_path / "mine.txt").write_text("x")
    with OutputDir(tmp_path) as out:
        m = out.open(_manifest(fp="f2", cfg={"sampling": {"temperature": 0.5}}), overwrite=True)
        assert m.windows == {} and m.fingerprint == "f2"
    assert (tmp_path / "mine.txt").exists() and not (tmp_path / part_name(0)).exists()


def test_shard_layout_conflict(tmp_path: Path) -> None:
    with OutputDir(tmp_path, 0, 1) as out:
        out.open(_manifest())
        out.commit(0, _table(), _rec(0))
    with pytest.raises(ConfigError, match="another shard layout"):
        OutputDir(tmp_path, 1, 2).open(_manifest())
    with OutputDir(tmp_path, 1, 2) as out:
        out.open(_manifest(), overwrite=True)
        assert out.path == tmp_path / "shard-00001-of-00002"
    assert not (tmp_path / "_manifest.json").exists()


def test_second_writer_is_locked_out(tmp_path: Path) -> None:
    a = OutputDir(tmp_path)
    a.open(_manifest())
    with pytest.raises(ConfigError, match="another batchgen process"):
        OutputDir(tmp_path).open(_manifest())
    a.close()
    OutputDir(tmp_path).open(_manifest()).save(tmp_path)


def test_diff_config() -> None:
    assert diff_config({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 4}) == [
        "a.c: 2 -> 3",
        "d: (absent) -> 4",
    ]


def test_manifest_roundtrip(tmp_path: Path) -> None:
    m = _manifest()
    m.windows[2] = _rec(2)
    m.save(tmp_path)
    back = Manifest.load(tmp_path)
    assert back == m and not back.complete
    assert json.loads((tmp_path / "_manifest.json").read_text())["rows_done"] == 10


def test_a_manifest_of_another_format_is_refused_as_unreadable(tmp_path: Path) -> None:
    with OutputDir(tmp_path) as out:
        out.open(_manifest())
        out.commit(0, _table(), _rec(0))
    d = json.loads((tmp_path / "_manifest.json").read_text())
    d["format"] = "batchgen-manifest/1"
    (tmp_path / "_manifest.json").write_text(json.dumps(d))
    with pytest.raises(
        ConfigError, match=r"_manifest.json is unreadable .*batchgen-manifest/1.*data.overwrite=true"
    ):
        OutputDir(tmp_path).open(_manifest())
    assert (tmp_path / part_name(0)).exists()  # nothing removed


def test_layout_names_what_batchgen_owns(tmp_path: Path) -> None:
    # atomic_write's temporary files are what the output directory cleans up after a killed run
    with atomic_write(tmp_path / rolled_part_name(3)) as tmp:
        assert tmp.name.startswith(TEMP_PREFIX) and is_own_file(tmp.name)
    assert is_own_file(rolled_part_name(3)) and PIECE_RE.match(Path(part_name(3)).name)
    assert is_own_file("_manifest.json") and is_own_file("_report.json")
    assert not is_own_file("manifest.json") and not is_own_file("report.json")
    assert not is_own_file("part-3.parquet") and not is_own_file("notes.txt") and not is_own_file("_logs")


def _piece(positions: list[int], status: str = "ok") -> pa.Table:
    layout = PartLayout(pa.int64(), [], n=1, logprobs=False, metadata={})
    rows = [PromptRow(p, p, p) for p in positions]
    for r in rows:
        r.token_ids = [1]
    res = [RequestOutput(p, [1], [CompletionOutput(0, "t", [5], "stop")], 0) for p in positions]
    from batchgen.data.parts import build_rows

    full_rows = [PromptRow(i, i, i) for i in range(max(positions) + 1)]
    full_res: list = [None] * len(full_rows)
    for r, o in zip(rows, res):
        full_rows[r.position], full_res[r.position] = r, o
    return build_rows(layout, full_rows, full_res, None, only=positions)


def test_checkpoints_are_listed_folded_in_and_leftovers_removed(tmp_path: Path) -> None:
    from batchgen.data.parts import assemble_part

    layout = PartLayout(pa.int64(), [], n=1, logprobs=False, metadata={})
    out = OutputDir(tmp_path)
    m = out.open(_manifest())
    out.write_checkpoint(1, _piece([0, 3]), rows=2, rows_ok=2, input_sha256="h")
    out.write_checkpoint(1, _piece([5]), rows=1, rows_ok=1, input_sha256="h")
    assert m.partial[1].files == ["part-000001.000000.arrow", "part-000001.000001.arrow"]
    assert m.rows_done == 3 and m.committed_anything and not m.windows
    out.close()
    # a checkpoint file the manifest never listed (killed between the two renames) goes on the next open
    (tmp_path / "_checkpoint" / "part-000001.000002.arrow").write_bytes(b"half")
    out = OutputDir(tmp_path)
    m = out.open(_manifest())
    assert sorted(p.name for p in (tmp_path / "_checkpoint").iterdir()) == m.partial[1].files
    pieces = out.checkpoint_pieces(1)
    assert sorted(x for p in pieces for x in p.column("_position").to_pylist()) == [0, 3, 5]
    rest = _piece([1, 2, 4, 6, 7, 8, 9])
    table, st = assemble_part(layout, [*pieces, rest], 10, {"index": 1})
    assert table.column("id").to_pylist() == list(range(10)) and "_position" not in table.column_names
    out.commit(1, table, WindowRecord("", 10, 20, 10, st.rows_ok, 0, 0, 0, 0))
    assert not m.partial and not (tmp_path / "_checkpoint").exists()
    with pytest.raises(RuntimeError, match="do not cover each of its 10 rows exactly once"):
        assemble_part(layout, [*pieces, rest, _piece([9])], 10, {"index": 1})


def test_an_output_without_a_successful_row_is_taken_over(tmp_path: Path) -> None:
    with OutputDir(tmp_path) as out:
        out.open(_manifest(cfg={"sampling": {"temperature": 1.0}}))
        rec = _rec(0)
        rec.rows_ok, rec.rows_error = 0, 10
        out.commit(0, _table(), rec)
    (tmp_path / "notes.txt").write_text("mine")
    with OutputDir(tmp_path) as out:
        m = out.open(_manifest(fp="f2", cfg={"sampling": {"temperature": 0.5}}))
        assert out.took_over and m.fingerprint == "f2" and not m.windows
    assert not (tmp_path / part_name(0)).exists() and (tmp_path / "notes.txt").exists()
