"""The kernel benchmark's CPU dry run (grid and byte counts) and its report formatting; the CUDA run itself is
exercised by jobs/gpu/check.sh."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from batchgen.bench import kernels as bench


def test_decode_grid_covers_batch_and_context_range_within_memory_cap():
    points = bench.decode_grid()
    assert {p.batch for p in points} == set(bench.DECODE_BATCHES)
    assert min(p.context for p in points) == 128 and max(p.context for p in points) == 32768
    assert all(p.kv_bytes <= bench.MAX_KV_BYTES for p in points)
    p = next(p for p in points if p.batch == 8 and p.context == 1024)
    # K and V: batch * context * Hkv * D * 2 bytes (bf16), twice; q + out: batch * Hq * D * 2 bytes, twice
    assert p.kv_bytes == 2 * 8 * 1024 * 8 * 128 * 2
    assert p.io_bytes == 2 * 8 * 32 * 128 * 2
    assert p.total_bytes == p.kv_bytes + p.io_bytes


def test_prefill_flops_count_causal_pairs_and_prefix():
    points = {(p.q_len, p.context, p.num_seqs): p for p in bench.prefill_grid()}
    p = points[(512, 0, 1)]
    assert p.flops == 4 * 32 * 128 * (512 * 513 // 2)
    p = points[(2048, 6144, 1)]
    assert p.flops == 4 * 32 * 128 * (2048 * 6144 + 2048 * 2049 // 2)


def test_dry_run_cli_needs_no_cuda():
    result = subprocess.run(
        [sys.executable, "-m", "batchgen.bench.kernels", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "decode: Hq=32 Hkv=8 D=128" in out and "prefill:" in out
    # the row for batch 8 x 1024 tokens: 33.6 MB of K/V
    assert any(line.split()[:3] == ["8", "1024", "33.6"] for line in out.splitlines())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_full_run_without_cuda_fails_clearly(capsys):
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_report_tables_format_bandwidth_and_fractions():
    p = bench.DecodePoint(batch=1, context=1024, kv_bytes=4_000_000, io_bytes=0)
    p.times_us = {"triton": 2.0, "sdpa": 4.0}
    table = bench.format_decode_table([p], peak=4.0e12, copy_bw=2.0e12)
    row = table.splitlines()[-1]
    # 4 MB in 2 µs = 2000 GB/s = 50 % of a 4 TB/s peak, 100 % of a 2 TB/s copy
    assert "2.0 / 2000 / 50% / 100%" in row and "4.0 / 1000 / 25% / 50%" in row
    assert "flash-attn" not in table  # columns only for measured methods
    q = bench.PrefillPoint(q_len=512, context=0, num_seqs=1, flops=1e12)
    q.times_us = {"triton": 1e6}
    assert "1000000.0 / 1" in bench.format_prefill_table([q])
    assert bench._peak_for("NVIDIA H200") == 4.8e12 and bench._peak_for("Some GPU") is None


def test_cpu_mode_runs_on_small_shapes(monkeypatch):
    monkeypatch.setattr(bench, "CPU_DECODE_BATCHES", (2,))
    monkeypatch.setattr(bench, "CPU_PREFILL_CASES", ((4, 0, 1), (3, 5, 2)))
    monkeypatch.setattr(bench, "CPU_LAYERS", 1)
    lines = bench.run_cpu(dtypes=(torch.float32,), repeats=1)
    assert len(lines) == 1 + 1 + 2
    assert lines[1].startswith("decode") and "ms CPU" in lines[1]


def test_cuda_code_path_smoke_on_cpu(monkeypatch, tmp_path):
    """The measuring code itself, run once per method on tiny CPU shapes (Triton kernels interpreted)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(bench, "_bench", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "DECODE_BATCHES", (2,))
    monkeypatch.setattr(bench, "DECODE_CONTEXTS", (40,))
    monkeypatch.setattr(bench, "PREFILL_CASES", ((16, 0, 1), (8, 20, 2)))
    monkeypatch.setattr(bench, "NUM_Q_HEADS", 4)
    monkeypatch.setattr(bench, "NUM_KV_HEADS", 2)
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    logs: list[str] = []
    decode = bench.run_decode(torch.device("cpu"), logs.append)
    prefill = bench.run_prefill(torch.device("cpu"), logs.append)
    assert set(decode[0].times_us) == {"triton", "triton-1pass", "triton-splitk", "torch-ref", "sdpa"}
    assert decode[0].max_abs_diff < 2e-2  # bf16
    assert set(prefill[0].times_us) == {"triton", "sdpa"} and set(prefill[1].times_us) == {"triton"}
    assert len(logs) == 3 and all("stopped" not in line for line in logs)
    assert "| 2 | 40 |" in bench.format_decode_table(decode, 4.8e12, 4.3e12)
    path = tmp_path / "bench.json"
    bench._write_json(path, "cpu", None, 1e9, decode, prefill)
    assert '"batch": 2' in path.read_text()


def test_cpu_cascade_mode_times_every_path(monkeypatch):
    from batchgen.kernels import cpu_kernel

    if cpu_kernel.compiler() is None:
        pytest.skip("no C compiler: the CPU kernel cannot be built")
    monkeypatch.setattr(bench, "CPU_CASCADE_CASES", ((8, 2, 3, 1),))
    keep = cpu_kernel.CASCADE_MIN_GROUP_BLOCKS
    lines = bench.run_cpu_cascade(repeats=1)
    assert cpu_kernel.CASCADE_MIN_GROUP_BLOCKS == keep  # restored after the forced cascade
    assert "cascade+kernel" in lines[1] and len(lines) == 3
    assert len(lines[2].split()) == 11 and all(float(x) > 0 for x in lines[2].split()[-4:])


def test_cpu_prefill_mode_compares_the_kernel_with_the_torch_path(monkeypatch):
    import os

    from batchgen.kernels import cpu_kernel

    if cpu_kernel.compiler() is None:
        pytest.skip("no C compiler: the CPU kernel cannot be built")
    monkeypatch.setattr(bench, "CPU_PREFILL_CASES", (("2 prompts", [20, 9], None), ("chunk", [40], [8])))
    lines = bench.run_cpu_prefill(repeats=1)
    assert cpu_kernel.ENV_SWITCH not in os.environ  # restored
    assert "C kernel" in lines[1] and len(lines) == 4
    for line in lines[2:]:
        cells = line.split()
        assert float(cells[-1]) < 1e-5  # the two paths agree
        assert all(float(x.rstrip("x")) > 0 for x in cells[-5:-1])
