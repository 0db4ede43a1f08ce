"""The decode-ceiling benchmark runs and reports sane figures (not timed: speed lives in BENCHMARKS.md)."""

from __future__ import annotations

from batchgen.bench import decode_ceiling
from batchgen.bench.throughput import BenchModel


def test_measure_reports_every_batch_size() -> None:
    small = BenchModel(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256
    )
    rows = decode_ceiling.measure(small, [2, 8], seconds=0.01)
    assert [r["rows"] for r in rows] == [2, 8]
    assert all(r["step_ms"] > 0 and r["flops"] > 0 and r["peak"] > 0 for r in rows)


def test_main_prints_a_line_per_batch_and_the_bandwidth(capsys) -> None:
    decode_ceiling.main(["--rows", "4", "--threads", "1", "--seconds", "0.01"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("M=   4:") and "MFU ceiling" in out[0]
    assert out[1].startswith("read bandwidth") and "MB of weights" in out[1]
