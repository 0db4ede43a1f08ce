"""Smoke test of the overhead benchmark (``python -m batchgen.bench.overhead``) at a tiny size: every phase it
times is really called by the engine (so a renamed engine method shows up here), the phases add up to the
step, and the table prints. No timing is asserted."""

from __future__ import annotations

import pytest

from batchgen.bench import overhead


@pytest.mark.parametrize("mix", list(overhead.MIXES))
def test_every_phase_is_timed(mix):
    result, calls = overhead.measure(overhead.MIXES[mix], n=8, steps=4, warmup=3)
    timed = set(overhead.PHASES) - {"other"}
    if mix == "decode":  # 16+ output tokens: nothing may finish in 7 steps, so nothing to detokenize
        timed.discard("detokenize")
    assert timed <= set(calls), calls
    assert result.steps == 4 and result.scheduled_seqs > 0 and result.batched_tokens >= result.scheduled_seqs
    assert all(v >= 0 for k, v in result.phase_ms.items() if k != "other")
    assert result.phase_ms["other"] >= -1e-6  # the phases are nested inside the step
    assert sum(result.phase_ms.values()) == pytest.approx(result.step_ms)
    if mix == "prefill":
        assert result.prefill_token_share > 0.5


def test_overhead_cli_table(tmp_path, capsys):
    results = overhead.main(
        [
            "--seqs",
            "4",
            "--mixes",
            "prefill",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
            str(tmp_path / "o.json"),
        ]
    )
    out = capsys.readouterr().out
    assert "| mix | max seqs |" in out and "| prefill | 4 |" in out
    assert len(results) == 1 and (tmp_path / "o.json").is_file()


def test_sampling_mix_times_every_phase():
    result, calls = overhead.measure(overhead.MIXES["decode"], n=8, steps=4, warmup=3, temperature=0.8)
    assert calls.get("sample rows") and calls.get("sampler") and result.steps == 4
