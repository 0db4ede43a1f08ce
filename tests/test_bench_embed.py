"""The embedding benchmark: its compute floor (FLOP counting, the per-kernel GEMM rates it divides by) and one
end-to-end run on a few rows (nothing timed is asserted: speed lives in BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest

from batchgen.bench import embed
from batchgen.kernels import cpu_linear

SIZES = {"hidden_size": 8, "intermediate_size": 32, "num_hidden_layers": 2}


def test_encoder_flops_counts_projections_and_attention_per_sequence() -> None:
    # per token per layer: q, k, v, o (4 * 8 * 8) and up/down (2 * 8 * 32) weights, 2 FLOPs each = 1,536
    # attention per sequence of n tokens: 4 * n * n * 8 FLOPs per layer
    assert embed.encoder_flops(SIZES, [3]) == 2 * (1536 * 3 + 4 * 9 * 8)
    assert embed.encoder_flops(SIZES, [1, 2]) == 2 * (1536 * 3 + 4 * (1 + 4) * 8)
    # padding is never counted: two sequences of 1 and 3 cost less than two of 3
    assert embed.encoder_flops(SIZES, [1, 3]) < embed.encoder_flops(SIZES, [3, 3])


def test_gemm_rates_are_positive_per_kernel() -> None:
    from batchgen.kernels import cpu_linear
    from batchgen.models.packed_linear import onednn_available

    rates = embed.gemm_rates(SIZES, rows=(16,), seconds=0.01)
    want = {"matmul"} | ({"onednn"} if onednn_available() else set())
    assert set(rates) == want | ({"batchgen"} if cpu_linear.available() else set())
    assert all(r > 0 for r in rates.values())


def test_floor_is_flops_over_peak_beside_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        embed, "gemm_rates", lambda sizes: {"matmul": 1e9, "onednn": 0.5e9, "batchgen": 0.8e9}
    )
    results = [
        {"system": "batchgen", "wall_s": 2.0},
        {"system": "sentence-transformers", "wall_s": 3.0},
        {"system": "sentence-transformers", "wall_s": 4.5},
    ]
    f = embed.compute_floor(results, [10, 20])
    assert f["floor_s"] == pytest.approx(embed.encoder_flops(embed._BERT, [10, 20]) / 1e9)
    assert f["st_best_s"] == 3.0 and f["st_best_div_1_5_s"] == pytest.approx(2.0)
    line = embed._floor_line(f)
    assert (
        "float32 compute floor" in line
        and "2.00 s" in line
        and "MKL 1, oneDNN packed 0, batchgen 1 GFLOP/s" in line
    )


def test_the_benchmark_runs_end_to_end_on_a_few_rows(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every system of the encoder table on 20 rows (sentence-transformers where installed), batchgen's row on
    MKL's GEMM included where its own GEMM runs, and the decoder's prefix cache on and off; the JSON holds what
    the tables print. The floor's GEMM rates are measured on small shapes for a moment (the benchmark's own
    take 0.3 s per kernel and shape, up to 4,096 rows: seconds of timing nothing here asserts)."""
    real = embed.gemm_rates
    monkeypatch.setattr(embed, "gemm_rates", lambda sizes: real(sizes, rows=(64,), seconds=0.01))
    out = tmp_path / "embed.json"
    embed.main(["--rows", "20", "--decoder-rows", "8", "--st-batch-sizes", "16", "--json", str(out)])
    res = json.loads(out.read_text())
    settings = [r["setting"] for r in res["encoder"]]
    assert settings[0] == "LLM.embed" and "transformers" in {r["system"] for r in res["encoder"]}
    if cpu_linear.available():
        assert "LLM.embed, linear layers on MKL's GEMM (weights as loaded)" in settings
    assert all(r["cos"] >= 0.9999 for r in res["encoder"])
    assert res["encoder_floor"]["floor_s"] > 0 and res["encoder_floor"]["matmul_flops_per_s"] > 0
    assert [r["setting"] for r in res["decoder"]] == ["prefix cache on", "prefix cache off"]
    assert res["decoder"][0]["cached_fraction"] > 0.5 and res["decoder"][1]["cached_fraction"] == 0
