"""What a job does before its first token does not grow with the dataset: counted, not timed. The same job on
one file of 2,048 rows and on 200 files of 2,048 rows each (409,600 rows, 6,400 windows), fresh and resumed
after three committed windows: the row groups decoded, the windows read from the input and the window specs
built before the first sampled token stay within the same small bounds, and each file's footer is read
exactly once (planning is O(files): row counts and schemas come from the footers)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config

import batchgen.data.reader as reader
from batchgen.data.output_dir import OutputDir
from batchgen.job.run import run_job
from batchgen.runtime import startup_trace

ROWS_PER_FILE = 2048


class _Reached(BaseException):
    """Stops the run in the test (not an error any layer of the job handles)."""


def _input(root: Path, files: int) -> Path:
    root.mkdir()
    t = pa.table({"prompt": [f"row {i}: tell me about {i % 13}" for i in range(ROWS_PER_FILE)]})
    pq.write_table(t, root / "f0000.parquet", row_group_size=1024)
    for i in range(1, files):
        shutil.copyfile(root / "f0000.parquet", root / f"f{i:04d}.parquet")
    return root


def _count_work(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counters of the reader's work, and a stop at the first sampled token (the counts then)."""
    work: Counter = Counter()
    read_footer, safe_batches = reader.read_footer, reader._safe_batches
    spec_cls, window_cls = reader.WindowSpec, reader.Window

    def _read_footer(*a, **k):
        work["footers"] += 1
        return read_footer(*a, **k)

    def _safe_batches(*a, **k):
        work["row_groups"] += 1
        return safe_batches(*a, **k)

    class Spec(spec_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k) -> None:
            work["window_specs"] += 1
            super().__init__(*a, **k)

    class Win(window_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k) -> None:
            work["windows_read"] += 1
            super().__init__(*a, **k)

    def mark(phase: str) -> None:
        if phase == "first_token":
            work["at_first_token"] = 1
            raise _Reached

    monkeypatch.setattr(reader, "read_footer", _read_footer)
    monkeypatch.setattr(reader, "_safe_batches", _safe_batches)
    monkeypatch.setattr(reader, "WindowSpec", Spec)
    monkeypatch.setattr(reader, "Window", Win)
    monkeypatch.setattr(startup_trace, "enabled", True)
    monkeypatch.setattr(startup_trace, "mark", mark)
    return work


def _until_first_token(ckpt: str, inp: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    cfg = job_config(
        ckpt, inp, out, data={"window_rows": 64}, engine={"max_num_seqs": 4}, sampling={"max_tokens": 1}
    )
    with monkeypatch.context() as m:
        work = _count_work(m)
        with pytest.raises(_Reached):
            run_job(cfg, handle_signals=False, print_summary=False)
    assert work.pop("at_first_token") == 1
    return dict(work)


def _commit_three_windows(ckpt: str, inp: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commit = OutputDir.commit

    def _commit(self, *a, **k):
        commit(self, *a, **k)
        if len(self.manifest.windows) == 3:
            raise _Reached

    cfg = job_config(
        ckpt, inp, out, data={"window_rows": 64}, engine={"max_num_seqs": 4}, sampling={"max_tokens": 1}
    )
    with monkeypatch.context() as m:
        m.setattr(OutputDir, "commit", _commit)
        with pytest.raises(_Reached):
            run_job(cfg, handle_signals=False, print_summary=False)


def test_work_before_the_first_token_does_not_grow_with_the_dataset(
    llama_ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = {}
    for files in (1, 200):
        inp = _input(tmp_path / f"in{files}", files)
        fresh = _until_first_token(llama_ckpt, inp, tmp_path / f"fresh{files}", monkeypatch)
        _commit_three_windows(llama_ckpt, inp, tmp_path / f"resumed{files}", monkeypatch)
        resumed = _until_first_token(llama_ckpt, inp, tmp_path / f"resumed{files}", monkeypatch)
        assert fresh.pop("footers") == resumed.pop("footers") == files  # one read of each footer
        seen[files] = (fresh, resumed)
    for fresh, resumed in seen.values():  # the same bounds at 2,048 rows and at 409,600 (6,400 windows)
        # the first window, and the next one if the read-ahead got to it (a thread: 1 or 2)
        assert fresh.get("row_groups", 0) <= 1 and fresh.get("windows_read", 0) <= 2, seen
        assert fresh.get("window_specs", 0) <= 3, seen
        # + the three kept windows' input, read back to check it did not change
        assert resumed.get("row_groups", 0) <= 2 and resumed.get("windows_read", 0) <= 5, seen
        assert resumed.get("window_specs", 0) <= 9, seen


def test_the_resume_check_of_kept_input_decodes_a_bounded_number_of_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8,192 windows kept over 8 row groups of 16,384 rows: the windows whose input a resume re-reads are at
    most VERIFY_WINDOWS, and reading them decodes about one row group plus one batch per other row group, not
    the rows before each sampled window in its row group (the whole input, for windows spread evenly)."""
    from types import SimpleNamespace

    from batchgen.job.resume import VERIFY_WINDOWS, _sample

    rows, rg = 131_072, 16_384
    pq.write_table(
        pa.table({"prompt": [f"r{i}" for i in range(rows)]}), tmp_path / "in.parquet", row_group_size=rg
    )
    inp = reader.open_input(str(tmp_path / "in.parquet"))
    plan = SimpleNamespace(
        input=inp, windows=reader.plan_windows(0, rows, 16), row_start=0, row_end=rows,
        cfg=SimpleNamespace(data=SimpleNamespace(window_rows=16)),
    )  # fmt: skip
    kept = list(range(len(plan.windows)))
    picked = _sample(plan, kept, {700})  # type: ignore[arg-type]
    assert len(picked) <= VERIFY_WINDOWS + 1 and 0 in picked and 700 in picked  # + a checkpointed window
    assert {w * 16 // rg for w in picked} == set(range(8))  # every row group is looked at
    decoded = Counter()
    safe_batches = reader._safe_batches

    def _safe(*a, **k):
        for batch, err in safe_batches(*a, **k):
            decoded["rows"] += batch.num_rows
            yield batch, err

    monkeypatch.setattr(reader, "_safe_batches", _safe)
    got = [w.index for w in reader.iter_windows(inp, (plan.windows[w] for w in picked), ["prompt"])]
    assert got == picked
    assert decoded["rows"] <= rg + 8 * reader.READ_BATCH_ROWS, decoded  # not the 131,072 rows
