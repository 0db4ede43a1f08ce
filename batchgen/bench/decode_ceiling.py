"""The MFU ceiling of a decode step at batch ``M``: the model's linear layers alone, no attention, no engine.

``python -m batchgen.bench.decode_ceiling [--rows 16 64 256] [--threads 2]`` times one decode step's GEMMs of
the throughput benchmark's model (per layer qkv, o, gate_up, down, then the LM head; float32) at each batch
size, with each kernel: ``batchgen`` (batchgen's GEMM over 16-column panels, what the loader stores where its C
kernels build), ``onednn`` (weights packed for oneDNN, the loader's choice without them) and ``mkl``
(``F.linear`` over column-major weights, the last fallback); measures the matmul peak at 256 rows beside it
(the best of the kernels) and prints achieved FLOP/s ÷ peak: the most MFU any engine could reach on a decode-only workload
of that many sequences. Also the read bandwidth (a ``sum`` over 256 MiB) and the weight bytes each step
streams: at small batches a step is bound by streaming the weights, not by FLOPs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchgen.bench.throughput import BenchModel
from batchgen.kernels import cpu_linear
from batchgen.models.packed_linear import BATCH_HINT, onednn_available


def _rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of ``fn`` over about ``seconds`` (after three warm-up calls)."""
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def _linear(kernel: str, n: int, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ W.t()`` for a random ``[n, k]`` weight laid out as ``kernel`` runs it."""
    w = torch.randn(n, k)
    if kernel == "batchgen":
        panels = cpu_linear.pack(w)
        return lambda x: cpu_linear.linear(x, panels, None, n)
    if kernel == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    cm = w.t().contiguous().t()
    return lambda x: F.linear(x, cm)


def kernels() -> list[str]:
    """The kernels this machine has: batchgen's GEMM (where its C kernels build), oneDNN, MKL."""
    return [
        *(["batchgen"] if cpu_linear.available() else []),
        *(["onednn"] if onednn_available() else []),
        "mkl",
    ]


def layer_shapes(m: BenchModel) -> list[tuple[int, int]]:
    """``(in, out)`` of one layer's fused linear maps: qkv, o, gate_up, down."""
    h, i = m.hidden_size, m.intermediate_size
    kv = (h // m.num_heads) * m.num_kv_heads
    return [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]


def weights_per_token(m: BenchModel) -> int:
    """Weights a decode step multiplies each token by: every layer's linear maps, then the LM head."""
    return m.num_layers * sum(k * n for k, n in layer_shapes(m)) + m.hidden_size * m.vocab_size


def measure(m: BenchModel, rows: list[int], kernel: str, seconds: float = 1.0) -> list[dict[str, float]]:
    """Per batch size: step time, achieved and peak FLOP/s, ceiling (achieved ÷ peak) for one kernel."""
    h, i = m.hidden_size, m.intermediate_size
    shapes = layer_shapes(m)
    layers = [[_linear(kernel, n, k) for k, n in shapes] for _ in range(m.num_layers)]
    lm_head = _linear(kernel, m.vocab_size, h)
    flops_per_token = 2 * weights_per_token(m)
    a = torch.randn(256, h)
    peak_fns = [_linear(k, 2 * i, h) for k in kernels()]
    out = []
    for batch in rows:
        x, xi = torch.randn(batch, h), torch.randn(batch, i)

        def step(x: torch.Tensor = x, xi: torch.Tensor = xi) -> None:
            for weights in layers:
                for (k, _), linear in zip(shapes, weights):
                    linear(xi if k == i else x)
            lm_head(x)

        steps_per_s = _rate(step, seconds)
        peak = 2 * 256 * h * 2 * i * max(_rate(lambda f=f: f(a), seconds) for f in peak_fns)
        achieved = flops_per_token * batch * steps_per_s
        out.append({"rows": batch, "step_ms": 1e3 / steps_per_s, "flops": achieved, "peak": peak})
    return out


def read_bandwidth(seconds: float = 1.0) -> float:
    """Bytes per second of a ``sum`` over 256 MiB of float32 (larger than any cache)."""
    big = torch.randn(64 << 20)
    return big.numel() * 4 * _rate(big.sum, seconds)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m batchgen.bench.decode_ceiling", description=__doc__.split("\n")[0]
    )
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256], help="decode batch sizes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    m = BenchModel()
    for kernel in kernels():
        for r in measure(m, args.rows, kernel, args.seconds):
            print(
                f"{kernel:6s} M={r['rows']:4d}: linear layers {r['step_ms']:.2f} ms/step, {r['flops'] / 1e9:.0f} GFLOP/s, "
                f"peak {r['peak'] / 1e9:.0f} GFLOP/s -> MFU ceiling {100 * r['flops'] / r['peak']:.0f}%"
            )
    weight_mb = 4 * weights_per_token(m) / 1e6  # float32
    bw = read_bandwidth(args.seconds)
    print(
        f"read bandwidth {bw / 1e9:.1f} GB/s; one decode step streams {weight_mb:.0f} MB of weights "
        f"(>= {weight_mb / (bw / 1e6) * 1e3:.1f} ms whatever the batch)"
    )


if __name__ == "__main__":
    main()
