"""The job's small parts on their own (no engine): the first-success gate, the row tally, build_dir_once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from batchgen.errors import ConfigError
from batchgen.job.early_failure import EARLY_ROWS, FirstSuccessGate
from batchgen.job.tally import RowTally, error_key
from batchgen.runtime.atomic import build_dir_once


def _output(error: str | None = None, reason: str = "length", text: str = "hi") -> SimpleNamespace:
    return SimpleNamespace(
        error=error, outputs=[SimpleNamespace(finish_reason=reason, text=text)], prompt_token_ids=[1, 2]
    )


def test_gate_holds_windows_until_a_row_succeeds() -> None:
    committed: list[str] = []
    tally = RowTally()
    gate = FirstSuccessGate(True, committed.append, tally)
    gate.window_finished("w0")  # type: ignore[arg-type]
    assert committed == [] and gate.held == ["w0"]
    assert tally.engine_output(_output())  # type: ignore[arg-type]
    gate.open()
    gate.window_finished("w1")  # type: ignore[arg-type]
    assert committed == ["w0", "w1"] and not gate.closed and gate.held == []


def test_gate_stops_the_job_when_the_first_rows_all_fail_in_the_engine() -> None:
    tally = RowTally()
    gate = FirstSuccessGate(True, lambda w: pytest.fail("nothing may be committed"), tally)
    for i in range(EARLY_ROWS - 1):
        assert not tally.engine_output(_output(error=f"prompt {i} too long"))  # type: ignore[arg-type]
    gate.window_finished("w0")  # type: ignore[arg-type]  # below EARLY_ROWS: held, no verdict yet
    tally.engine_output(_output(reason="error"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"all {EARLY_ROWS} of the first rows did"):
        gate.check()
    assert gate.held == []
    assert tally.errors[error_key("prompt 1 too long")] == EARLY_ROWS - 1
    assert tally.errors["generation failed"] == 1 and tally.engine_ok == 0


def test_gate_final_check_needs_only_one_failed_row() -> None:
    tally = RowTally()
    gate = FirstSuccessGate(True, lambda w: None, tally)
    gate.check(final=True)  # nothing finished in the engine: no verdict
    tally.engine_output(_output(error="boom"))  # type: ignore[arg-type]
    gate.check()
    with pytest.raises(ConfigError, match="every row fails in the engine"):
        gate.check(final=True)


def test_build_dir_once_builds_once_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    calls: list[Path] = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "config.json").write_text("{}")

    target = tmp_path / "cache" / "ckpt"
    assert build_dir_once(target, "config.json", build) == str(target)
    assert build_dir_once(target, "config.json", build) == str(target)
    assert len(calls) == 1 and (target / "config.json").is_file()

    def broken(tmp: Path) -> None:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        build_dir_once(tmp_path / "cache" / "other", "config.json", broken)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["ckpt"]
