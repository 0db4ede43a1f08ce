"""The embedding benchmark's compute floor: FLOP counting and the GEMM peak it divides by (not timed: speed lives
in BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from batchgen.bench import embed

SIZES = {"hidden_size": 8, "intermediate_size": 32, "num_hidden_layers": 2}


def test_encoder_flops_counts_projections_and_attention_per_sequence() -> None:
    # per token per layer: q, k, v, o (4 * 8 * 8) and up/down (2 * 8 * 32) weights, 2 FLOPs each = 1,536
    # attention per sequence of n tokens: 4 * n * n * 8 FLOPs per layer
    assert embed.encoder_flops(SIZES, [3]) == 2 * (1536 * 3 + 4 * 9 * 8)
    assert embed.encoder_flops(SIZES, [1, 2]) == 2 * (1536 * 3 + 4 * (1 + 4) * 8)
    # padding is never counted: two sequences of 1 and 3 cost less than two of 3
    assert embed.encoder_flops(SIZES, [1, 3]) < embed.encoder_flops(SIZES, [3, 3])


def test_gemm_peak_is_a_positive_rate() -> None:
    assert embed.gemm_peak(SIZES, rows=(16,), seconds=0.01) > 0


def test_floor_is_flops_over_peak_beside_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embed, "gemm_peak", lambda sizes: 1e9)
    results = [
        {"system": "batchgen", "wall_s": 2.0},
        {"system": "sentence-transformers", "wall_s": 3.0},
        {"system": "sentence-transformers", "wall_s": 4.5},
    ]
    f = embed.compute_floor(results, [10, 20])
    assert f["floor_s"] == pytest.approx(embed.encoder_flops(embed._BERT, [10, 20]) / 1e9)
    assert f["st_best_s"] == 3.0 and f["st_best_div_1_5_s"] == pytest.approx(2.0)
    line = embed._floor_line(f)
    assert "float32 compute floor" in line and "2.00 s" in line
