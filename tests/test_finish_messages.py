"""The end-of-run hint names only readers that are installed (pyarrow always: batchgen depends on it)."""

from __future__ import annotations

import importlib.util

import pytest

from batchgen.job.finish import readers_of


def test_hint_names_only_installed_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pandas" else real(name, *a)
    )
    ways = readers_of("out")
    assert ways[:2] == ["batchgen show out", "pyarrow.parquet.read_table('out')"]
    assert not any("pandas" in w for w in ways)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "pandas" else None)
    assert "pandas.read_parquet('out')" in readers_of("out")
