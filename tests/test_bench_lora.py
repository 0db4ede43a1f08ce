"""bench.lora runs end to end on a tiny model: the three systems produce the same rows' tokens."""

from __future__ import annotations

import pytest

from batchgen.bench import lora

pytest.importorskip("peft", reason="bench.lora merges adapters with PEFT: pip install peft")


def test_bench_lora_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    lora.main(
        ["--rows", "4", "--adapters", "2", "--ranks", "8,16", "--prompt-len", "5", "--max-tokens", "3", "--hidden", "64",
         "--layers", "1", "--repeats", "1", "--workdir", str(tmp_path / "w"), "--json", str(out)]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert "mixed" in text and "separate" in text and out.exists()
    import json

    r = json.loads(out.read_text())
    assert r["ranks"] == [8, 16] and r["generated_tokens"] == 12
    assert r["rows_same_as_merged"] >= 3  # merged weights round differently; a near tie may flip one row
    assert 0 < r["separate_loading_s"] < r["separate_s"] and r["merge_s"] > 0
