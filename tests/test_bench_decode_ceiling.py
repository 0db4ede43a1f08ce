"""The decode-ceiling benchmark runs and reports sane figures (not timed: speed lives in BENCHMARKS.md)."""

from __future__ import annotations

from batchgen.bench import decode_ceiling
from batchgen.bench.throughput import BenchModel


def test_measure_reports_every_batch_size() -> None:
    small = BenchModel(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256
    )
    for kernel in decode_ceiling.kernels():
        rows = decode_ceiling.measure(small, [2, 8], kernel, seconds=0.01)
        assert [r["rows"] for r in rows] == [2, 8]
        assert all(r["step_ms"] > 0 and r["flops"] > 0 and r["peak"] > 0 for r in rows)


def test_main_prints_a_line_per_batch_and_the_bandwidth(capsys) -> None:
    decode_ceiling.main(["--rows", "4", "--threads", "1", "--seconds", "0.01"])
    out = capsys.readouterr().out.splitlines()
    kernels = decode_ceiling.kernels()
    assert len(out) == len(kernels) + 1
    for kernel, line in zip(kernels, out):
        assert line.startswith(f"{kernel:6s} M=   4:") and "MFU ceiling" in line
    assert out[-1].startswith("read bandwidth") and "MB of weights" in out[-1]


def test_linear_kernels_compute_the_same_product() -> None:
    import torch

    torch.manual_seed(0)
    x = torch.randn(5, 16)
    outs = []
    for kernel in decode_ceiling.kernels():
        torch.manual_seed(1)
        outs.append(decode_ceiling._linear(kernel, 8, 16)(x))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)
