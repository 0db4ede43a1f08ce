"""Issue 12, in process: a bad row is an error row, a failure says so, finished rows are never lost.

Bad data (invalid UTF-8, a corrupt data page, files with incompatible types), configurations that make every
row fail (refused before the model loads), the error-fraction limit, retrying error rows caused by the run's
settings, a failed start that must not block the corrected command, checkpoints of finished rows on a stop,
input edits that keep the file size and footer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import (
    job_config,
    part_contents,
    read_parts,
    signal_after,
    write_invalid_utf8,
)

from batchgen.data.reader import open_input
from batchgen.job.run import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_TOO_MANY_ERRORS, run_job

LONG = "a much longer prompt with plenty of words in it so that it needs more than one KV block "


def _run(cfg, **kw):
    return run_job(cfg, handle_signals=kw.pop("handle_signals", False), print_summary=False, **kw)


def _rows(n: int, long_every: int = 0) -> list[str]:
    return [(LONG if long_every and i % long_every == 0 else "short ") + f"row {i}" for i in range(n)]


def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the job tries to load the model."""

    def boom(plan):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("batchgen.job.run._start_engine", boom)


# ------------------------------------------------------------------------------------------------ bad data
def test_undecodable_values_become_error_rows_and_the_job_goes_on(llama_ckpt: str, tmp_path: Path) -> None:
    """Invalid UTF-8 in the prompt, the id, a kept column or a chat message: one error row each, naming the
    byte; the output stays valid UTF-8 (U+FFFD for the bad bytes) so every reader can read it, and
    batchgen-merge still matches every id."""
    from batchgen.job.merge import verify

    inp = tmp_path / "in.parquet"
    table = pa.table(
        {
            "uid": write_invalid_utf8([b"r0", b"r1", b"r\xc3(2", b"r3", b"r4"]),
            "prompt": write_invalid_utf8([b"hello there", b"bad \xff\xfe row", b"fine", b"also fine", b"ok"]),
            "note": write_invalid_utf8([b"a", b"b", b"c", b"\x80d", b"e"]),
        }
    )
    pq.write_table(table, inp)
    cfg = job_config(llama_ckpt, inp, tmp_path / "out", data={"id_column": "uid", "keep_columns": ["note"]})
    cfg.run.max_error_fraction = 0.6
    res = _run(cfg)
    assert res.exit_code == EXIT_OK, res.message
    out = read_parts(tmp_path / "out")
    assert out.column("error").to_pylist() == [
        None,
        "prompt is not valid UTF-8 at byte 4",
        "id column 'uid' value is not valid UTF-8 at byte 1",
        "column 'note' is not valid UTF-8 at byte 0",
        None,
    ]
    assert out.column("status").to_pylist() == ["ok", "error", "error", "error", "ok"]
    assert out.column("id").to_pylist() == ["r0", "r1", "r\ufffd(2", "r3", "r4"]  # readable, still aligned
    assert out.column("note").to_pylist() == ["a", "b", "c", "\ufffdd", "e"]
    assert verify(tmp_path / "out").ok

    msg_t = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    contents = write_invalid_utf8([b"Name a colour.", b"caf\xe9 au lait"])
    messages = pa.ListArray.from_arrays(
        pa.array([0, 1, 2], type=pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user", "user"]), contents], names=["role", "content"]),
    ).cast(msg_t)
    pq.write_table(pa.table({"messages": messages}), tmp_path / "chat.parquet")
    cfg = job_config(
        llama_ckpt, tmp_path / "chat.parquet", tmp_path / "out2", data={"messages_column": "messages"}
    )
    cfg.run.max_error_fraction = 0.5
    assert _run(cfg).exit_code == EXIT_OK
    assert read_parts(tmp_path / "out2").column("error").to_pylist() == [
        None,
        "messages is not valid UTF-8 at byte 3",
    ]


def _corrupt_row_group(path: Path, row_group: int) -> bytes:
    """Overwrite the first data page header of `row_group` (the footer stays intact); returns the original."""
    original = path.read_bytes()
    off = pq.read_metadata(path).row_group(row_group).column(0).data_page_offset
    b = bytearray(original)
    b[off : off + 24] = b"\xff" * 24
    path.write_bytes(bytes(b))
    return original


def test_corrupt_data_page_marks_exactly_its_rows_and_a_retry_reads_them_once_repaired(
    llama_ckpt: str, tmp_path: Path
) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": _rows(40)}), inp, row_group_size=10, compression="snappy")
    ref = tmp_path / "ref"
    assert _run(job_config(llama_ckpt, inp, ref)).exit_code == EXIT_OK
    original = _corrupt_row_group(inp, 2)

    out = tmp_path / "out"
    cfg = job_config(llama_ckpt, inp, out)
    cfg.run.max_error_fraction = 0.3
    res = _run(cfg)
    assert res.exit_code == EXIT_OK, res.message
    t = read_parts(out)
    assert t.column("id").to_pylist() == list(range(40))  # nothing silently missing
    status = t.column("status").to_pylist()
    assert [i for i, s in enumerate(status) if s == "error"] == list(range(20, 30))  # exactly row group 2
    err = t.column("error").to_pylist()[20]
    assert err.startswith("input unreadable: 'in.parquet' row group 2 (input rows 20..30): "), err

    # the same file repaired (same bytes as before: same footer): the rows are retried with retry_errors
    inp.write_bytes(original)
    cfg.data.retry_errors = True
    res = _run(cfg)
    assert res.exit_code == EXIT_OK and res.report["run"]["rows"] == 10, res.message
    assert part_contents(out) == part_contents(ref)


def test_files_with_incompatible_column_types_are_refused_while_planning(
    llama_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_engine(monkeypatch)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": ["a b c", "d e f"], "n": [1, 2]}), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"prompt": ["g h i"], "n": ["x"]}), tmp_path / "in" / "b.parquet")
    res = _run(job_config(llama_ckpt, tmp_path / "in", tmp_path / "out", data={"keep_columns": ["n"]}))
    assert res.exit_code == EXIT_CONFIG
    assert (
        "column 'n' has incompatible types in the input files: int64 in 'a.parquet', string in 'b.parquet'"
        in (res.message)
    )
    assert not (tmp_path / "out").exists()
    # types that unify (int32 + int64, dictionary + plain strings) are read as one type
    pq.write_table(
        pa.table({"prompt": ["g h i"], "n": pa.array([3], pa.int32())}), tmp_path / "in" / "b.parquet"
    )
    inp = open_input(str(tmp_path / "in"))
    assert inp.read_schema(["prompt", "n"]).field("n").type == pa.int64()


# ------------------------------------------------------------------------------- failure looks like failure
def _chat_ckpt(src: str, dst: Path, template: str) -> str:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    return str(dst)


@pytest.mark.parametrize("case", ["int_prompts", "num_blocks_1", "max_model_len", "template_raises"])
def test_a_configuration_that_makes_every_row_fail_is_refused_before_the_model_loads(
    llama_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    _no_engine(monkeypatch)
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": _rows(12, long_every=1)}), inp)
    ckpt, data, engine = llama_ckpt, {}, {}
    if case == "int_prompts":
        pq.write_table(pa.table({"prompt": list(range(12))}), inp)
        expect = "data.prompt_column: column 'prompt' has type int64, not string"
    elif case == "num_blocks_1":
        engine = {"num_blocks": 1}
        expect = "KV blocks but engine.num_blocks=1"
    elif case == "max_model_len":
        engine = {"max_model_len": 8}
        expect = "but engine.max_model_len is 8"
    else:
        ckpt = _chat_ckpt(llama_ckpt, tmp_path / "ckpt", "{{ raise_exception('no chat today') }}")
        pq.write_table(
            pa.table({"messages": [[{"role": "user", "content": f"hi {i}"}] for i in range(12)]}), inp
        )
        data = {"messages_column": "messages"}
        expect = "chat template failed: TemplateError: no chat today"
    res = _run(job_config(ckpt, inp, tmp_path / "out", data=data, engine=engine))
    assert res.exit_code == EXIT_CONFIG and expect in res.message, res.message
    assert "\n" not in res.message and not list((tmp_path / "out").glob("part-*"))
    if case != "int_prompts":
        assert (
            "every row fails before generation" in res.message and "run.max_error_fraction=1" in res.message
        )


def test_rows_failing_in_the_engine_stop_the_job_early_and_a_fix_takes_over(
    llama_ckpt: str, tmp_path: Path
) -> None:
    """A KV pool of one block (from kv_cache_memory: unknown before the engine starts): every row fails in the
    engine; the job stops after the first rows with exit 2 and writes nothing, so the corrected command (a
    bigger pool; another max_tokens) simply runs."""
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": _rows(80, long_every=1)}), inp)
    out = tmp_path / "out"
    cfg = job_config(llama_ckpt, inp, out, engine={"num_blocks": None, "kv_cache_memory": "12KiB"})
    res = _run(cfg)
    assert res.exit_code == EXIT_CONFIG, res.message
    assert (
        "every row fails in the engine: all 64 of the first rows did" in res.message
        and "KV blocks" in res.message
    )
    assert not list(out.glob("part-*")) and not list(out.glob("_checkpoint/*"))
    cfg = job_config(llama_ckpt, inp, out, sampling={"max_tokens": 4})
    res = _run(cfg)
    assert res.exit_code == EXIT_OK and read_parts(out).num_rows == 80, res.message


def test_error_rows_beyond_the_limit_fail_the_job_and_retry_errors_recomputes_them(
    llama_ckpt: str, tmp_path: Path
) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": _rows(24, long_every=3)}), inp)
    ref = tmp_path / "ref"
    assert _run(job_config(llama_ckpt, inp, ref)).exit_code == EXIT_OK
    out = tmp_path / "out"
    small = job_config(llama_ckpt, inp, out, engine={"num_blocks": 1})  # long rows do not fit: 8 of 24 fail
    res = _run(small)
    assert res.exit_code == EXIT_TOO_MANY_ERRORS and res.status == "failed", res.message
    assert "8 of 24 rows (33.3%) are error rows, more than run.max_error_fraction=0.1" in res.message
    assert "8 may be retried" in res.message and "data.retry_errors=true" in res.message
    report = json.loads((out / "_report.json").read_text())
    assert report["status"] == "failed" and report["rows"]["retryable"] == 8

    # a bigger pool alone: the output is complete, the errors are final unless retried
    res = _run(job_config(llama_ckpt, inp, out))
    assert res.exit_code == EXIT_TOO_MANY_ERRORS and "nothing to do" in res.message
    before = {p.name: p.stat().st_ino for p in out.glob("part-*.parquet")}
    res = _run(job_config(llama_ckpt, inp, out, data={"retry_errors": True}))
    assert res.exit_code == EXIT_OK and res.report["run"]["rows"] == 8, res.message
    assert part_contents(out) == part_contents(ref)
    after = {p.name: p.stat().st_ino for p in out.glob("part-*.parquet")}
    assert all(after[k] != before[k] for k in before)  # every window had a long row: each part rewritten
    m = json.loads((out / "_manifest.json").read_text())
    assert all(not w["retry_rows"] for w in m["windows"].values())


def test_max_model_len_may_change_only_to_retry_errors(llama_ckpt: str, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": _rows(16, long_every=2)}), inp)
    out = tmp_path / "out"
    cfg = job_config(llama_ckpt, inp, out, engine={"max_model_len": 16})
    cfg.run.max_error_fraction = 1.0
    assert _run(cfg).exit_code == EXIT_OK
    assert read_parts(out).column("status").to_pylist().count("error") == 8
    refused = _run(job_config(llama_ckpt, inp, out))
    assert refused.exit_code == EXIT_CONFIG and "engine.max_model_len: 16 -> None" in refused.message
    assert "add data.retry_errors=true" in refused.message
    res = _run(job_config(llama_ckpt, inp, out, data={"retry_errors": True}))
    assert res.exit_code == EXIT_OK and set(read_parts(out).column("status").to_pylist()) == {"ok"}


def test_a_fixed_chat_template_is_retried(llama_ckpt: str, tmp_path: Path) -> None:
    good = (Path(llama_ckpt) / "chat_template.jinja").read_text()
    broken = "{% if 'boom' in messages[0]['content'] %}{{ raise_exception('boom') }}{% endif %}" + good
    ckpt = _chat_ckpt(llama_ckpt, tmp_path / "ckpt", broken)
    inp = tmp_path / "chat.parquet"
    pq.write_table(
        pa.table(
            {
                "messages": [
                    [{"role": "user", "content": ("boom " if i % 4 == 0 else "") + f"hi {i}"}]
                    for i in range(8)
                ]
            }
        ),
        inp,
    )
    out = tmp_path / "out"
    cfg = job_config(ckpt, inp, out, data={"messages_column": "messages"})
    cfg.run.max_error_fraction = 0.5
    assert _run(cfg).exit_code == EXIT_OK
    assert read_parts(out).column("error").to_pylist()[0] == "chat template failed: TemplateError: boom"
    (Path(ckpt) / "chat_template.jinja").write_text(good)
    refused = _run(cfg)
    assert refused.exit_code == EXIT_CONFIG and "model.chat_template" in refused.message
    assert "files changed: chat_template.jinja" in refused.message
    cfg.data.retry_errors = True
    res = _run(cfg)
    assert res.exit_code == EXIT_OK and res.report["run"]["rows"] == 2
    assert set(read_parts(out).column("status").to_pylist()) == {"ok"}


def test_a_failed_start_does_not_block_the_corrected_command(
    llama_ckpt: str, qwen2_ckpt: str, tmp_path: Path
) -> None:
    """A model that does not load: exit 2, one line; the output holds nothing, so another model takes it over."""
    broken = tmp_path / "broken"
    shutil.copytree(llama_ckpt, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": _rows(8)}), inp)
    out = tmp_path / "out"
    res = _run(job_config(str(broken), inp, out))
    assert res.exit_code == EXIT_CONFIG and res.message.startswith(
        "cannot start the engine for model.path="
    ), res.message
    assert "\n" not in res.message
    res = _run(job_config(qwen2_ckpt, inp, out))
    assert res.exit_code == EXIT_OK, res.message
    # unsupported architecture: refused while planning, before anything is written
    odd = tmp_path / "odd"
    shutil.copytree(llama_ckpt, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["FancyNewForCausalLM"], "fancy"
    (odd / "config.json").write_text(json.dumps(cfg))
    res = _run(job_config(str(odd), inp, tmp_path / "out2"))
    assert (
        res.exit_code == EXIT_CONFIG
        and "FancyNewForCausalLM" in res.message
        and not (tmp_path / "out2").exists()
    )


# ---------------------------------------------------------------------------------- finished rows are kept
@pytest.mark.parametrize("window_rows", [24, 8])
def test_a_stop_saves_every_finished_row_whatever_window_it_belongs_to(
    llama_ckpt: str, tmp_path: Path, window_rows: int
) -> None:
    from batchgen.engine.core.llm_engine import LLMEngine

    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt {i} " + "word " * (i % 7) for i in range(24)]}), inp)

    def cfg_for(out: Path):
        return job_config(llama_ckpt, inp, out, data={"window_rows": window_rows}, engine={"max_num_seqs": 4},
                          sampling={"max_tokens": 8})  # fmt: skip

    ref = tmp_path / "ref"
    assert _run(cfg_for(ref)).exit_code == EXIT_OK
    out = tmp_path / "out"
    cfg = cfg_for(out)
    res = _run(cfg, engine=signal_after(LLMEngine(llama_ckpt, cfg.engine), at=40), handle_signals=True)
    assert res.exit_code == EXIT_INTERRUPTED, res.message
    m = json.loads((out / "_manifest.json").read_text())
    saved = m["rows_done"]
    assert saved >= 12, m  # ~70% of the rows had finished: they are on disk, not lost
    assert m["partial"] and all(
        (out / "_checkpoint" / f).is_file() for p in m["partial"].values() for f in p["files"]
    )
    # dataset readers see only complete parts, never a checkpointed row nor a window not yet in a part
    parts = [(p["first"], p["last"]) for p in m.get("parts", [])]  # the state as of the last compaction
    in_parts = sum(m["windows"][str(w)]["num_output_rows"] for a, b in parts for w in range(a, b + 1))
    assert pq.read_table(out).num_rows == in_parts
    res = _run(cfg)
    assert res.exit_code == EXIT_OK and res.report["run"]["rows"] == 24 - saved, res.message
    assert part_contents(out) == part_contents(ref)
    assert not (out / "_checkpoint").exists()


# ------------------------------------------------------------------------------------ resume checks input
def test_a_same_size_edit_of_a_finished_window_is_detected(llama_ckpt: str, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    rows = [f"prompt number {i:02d} about apples" for i in range(16)]
    pq.write_table(pa.table({"prompt": rows}), inp, compression="none", write_statistics=False)
    out = tmp_path / "out"
    cfg = job_config(llama_ckpt, inp, out, data={"window_rows": 4})
    from batchgen.job.signals import StopSignal

    class StopAfterTwoWindows(StopSignal):
        @property
        def requested(self) -> bool:
            from batchgen.data.manifest import Manifest

            try:
                m = Manifest.load(out)  # the manifest with the commit log applied
            except (OSError, ValueError):
                return False
            return m is not None and len(m.windows) >= 2

        @requested.setter
        def requested(self, value: bool) -> None:
            pass

    res = _run(cfg, stop=StopAfterTwoWindows())
    assert res.exit_code == EXIT_INTERRUPTED, res.message
    before = open_input(str(inp)).fingerprint
    data = inp.read_bytes()
    assert data.count(b"number 01 about apples") == 1
    inp.write_bytes(
        data.replace(b"number 01 about apples", b"number 01 about grapes")
    )  # same size, same footer
    assert open_input(str(inp)).fingerprint == before
    res = _run(cfg)
    assert res.exit_code == EXIT_CONFIG, res.message
    assert "the input changed since window 0 (input rows 0..4 in 'in.parquet') was processed" in res.message


def test_many_bad_rows_ahead_of_good_ones_do_not_stop_the_job(llama_ckpt: str, tmp_path: Path) -> None:
    """70 null prompts, then 30 good ones, in one window: not an impossible configuration (the good rows run);
    the job completes and fails only on the error fraction."""
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [None] * 70 + _rows(30)}), inp)
    res = _run(job_config(llama_ckpt, inp, tmp_path / "out", data={"window_rows": 100}))
    assert res.exit_code == EXIT_TOO_MANY_ERRORS, res.message
    assert read_parts(tmp_path / "out").column("status").to_pylist() == ["error"] * 70 + ["ok"] * 30
