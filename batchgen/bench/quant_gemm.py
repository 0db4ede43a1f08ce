"""Weight-only GEMM benchmark: ``python -m batchgen.bench.quant_gemm [--device cuda|cpu] [--json PATH]``.

Times the Triton weight-only GEMMs (:mod:`batchgen.kernels.quant_linear_triton`) against ``torch.matmul`` by the
same weight dequantized to the activations' dtype (what a model that dequantizes up front would run), on the
projections of a Llama-3-8B layer (``[N, K]``: q/k/v 6144 x 4096, o 4096 x 4096, gate/up 28672 x 4096, down
4096 x 14336), at M = 1..1024 rows (decode batches to prefill chunks), bfloat16 activations:

* ``int4-g128``  int4 values packed in int32 words, a float32 scale per 128 inputs (GPTQ / AWQ / W4A16),
* ``int8-g128``  int8 likewise (W8A16, GGUF Q8_0-like),
* ``fp8-ch``     fp8 e4m3 bytes with a scale per output row (compressed-tensors FP8 weight-only),
* ``dense``      ``torch.matmul`` by the bfloat16 weight.

``--sweep`` also times a set of candidate tile configurations (:class:`~batchgen.kernels.quant_linear_triton.Tiles`)
for int4 and fp8 on two of the shapes at decode and prefill sizes, against the configuration the kernels pick
(:func:`~batchgen.kernels.quant_linear_triton.gpu_tiles`; above 16 rows that is the weight dequantized into a
bfloat16 buffer and multiplied by ``torch.matmul``), so that the picks can be checked on each GPU.

Each row reports, per kernel, the median time on the device alone (calls replayed from a CUDA graph, as the
engine replays its decode steps, on copies of the weights spanning more than the L2 cache, so every call reads
its weights from memory), the weight bytes read per second at that time (a decode GEMM is bound by them: int4
reads a quarter of bfloat16's bytes), the median time of a call from Python (``triton.testing.do_bench``: the
host's launch included), and the largest difference from the float32 product by the dequantized weight
(relative to that product's largest value; bfloat16 inputs round the weight tile to bfloat16). The sweep ranks
the candidates by their time on the device. ``--device cpu`` runs the kernels in Triton's interpreter on small
shapes, to check the script itself (its times say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from batchgen.kernels.quant_linear_triton import Tiles, fp8_linear_triton, gpu_tiles, int_linear_triton
from batchgen.models.quant.group_linear import pack_along_inputs

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 4, 16, 64, 256, 1024)
CPU_SHAPES = {"small": (96, 256)}
CPU_ROWS = (1, 17)
GROUP = 128


@dataclass
class Point:
    shape: str
    n: int
    k: int
    m: int
    times_us: dict[str, float] = field(default_factory=dict)
    """Median µs of a call from Python, the host's launch included."""
    kernel_us: dict[str, float] = field(default_factory=dict)
    """Median µs on the device alone (calls replayed from a CUDA graph, weights read from memory)."""
    weight_bytes: dict[str, int] = field(default_factory=dict)
    max_rel_diff: dict[str, float] = field(default_factory=dict)
    """Largest difference from the float32 product by the dequantized weight, over that product's largest value."""


def _time(fn, device: torch.device) -> float:
    """Median µs of ``fn`` called from Python (the host's launch included)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1e3
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(runs)


def _nbytes(args: tuple) -> int:
    """Bytes of the tensors among ``args``."""
    return sum(t.numel() * t.element_size() for t in args if torch.is_tensor(t))


def _kernel(kind: str):
    """The Triton function that multiplies by the weight of ``kind`` (``int4-g128``, ``int8-g128``, ``fp8-ch``)."""
    return fp8_linear_triton if kind == "fp8-ch" else int_linear_triton


L2_SPAN = 256 << 20
"""Bytes of weight copies a graph cycles through: more than any GPU's L2 cache, so every call reads from memory."""


def _graph_time(call, args: tuple, device: torch.device) -> float:
    """Median µs per ``call(*args)`` on the device alone: calls on copies of the tensors in `args` (spanning
    :data:`L2_SPAN` bytes, so no call finds its weights in the L2 cache) captured in one CUDA graph and replayed,
    as the engine replays its decode steps. On the CPU: :func:`_time` of one call."""
    if device.type != "cuda":
        return _time(lambda: call(*args), device)
    copies = [args] + [
        tuple(t.clone() if torch.is_tensor(t) else t for t in args)
        for _ in range(min(15, L2_SPAN // _nbytes(args)))
    ]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for a in copies:
            call(*a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in copies:
            call(*a)
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(copies))
    del graph
    return statistics.median(times)


def _weights(n: int, k: int, device: torch.device) -> dict[str, tuple]:
    """Each kernel's packed weight and its dequantized float32 weight."""
    g = torch.Generator().manual_seed(n + k)
    out = {}
    for bits in (4, 8):
        u = torch.randint(0, 1 << bits, (n, k), generator=g)
        s = torch.rand(n, k // GROUP, generator=g) * 0.01 + 0.001
        dense = (u - (1 << (bits - 1))).float() * s.repeat_interleave(GROUP, 1)
        packed = pack_along_inputs(u, bits)
        out[f"int{bits}-g128"] = ((packed.to(device), bits, s.to(device), GROUP), dense.to(device))
    q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    q[(q & 127) == 127] = 0
    s = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    dense = q.view(torch.float8_e4m3fn).float() * s
    out["fp8-ch"] = ((q.to(device), s.to(device), k), dense.to(device))
    return out


def run(
    device: torch.device, shapes: dict[str, tuple[int, int]], rows: tuple[int, ...], log=print
) -> list[Point]:
    points = []
    for name, (n, k) in shapes.items():
        weights = _weights(n, k, device)
        dense = weights["int4-g128"][1].to(torch.bfloat16)
        calls = {"dense": (lambda x, w: x @ w.t(), (dense,))}
        for kind, (args, _) in weights.items():
            calls[kind] = (_kernel(kind), args)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, torch.bfloat16)
            p = Point(name, n, k, m)
            for kind, (call, args) in calls.items():
                if kind != "dense":
                    want = x.float() @ weights[kind][1].t()
                    p.max_rel_diff[kind] = float(
                        (call(x, *args).float() - want).abs().max() / want.abs().max()
                    )
                p.times_us[kind] = _time(lambda c=call, a=(x, *args): c(*a), device)
                p.kernel_us[kind] = _graph_time(call, (x, *args), device)
                p.weight_bytes[kind] = _nbytes(args)
            log(format_row(p))
            points.append(p)
    return points


SWEEP_SHAPES = ("qkv", "down")
SWEEP_ROWS = (1, 4, 16, 256, 1024)
DECODE_TILES = [Tiles(*t) for t in (
    (16, 16, 128, 1, 4, 4), (16, 16, 128, 2, 4, 4), (16, 16, 128, 4, 4, 4), (16, 32, 128, 1, 4, 4),
    (16, 32, 256, 2, 4, 4), (16, 64, 128, 4, 4, 4), (16, 16, 64, 4, 2, 4), (16, 16, 64, 1, 2, 4),
    (16, 16, 64, 8, 2, 4), (16, 32, 64, 4, 2, 4),
)]  # fmt: skip
PREFILL_TILES = [Tiles(*t) for t in (
    (64, 64, 64, 1, 4, 3), (128, 128, 64, 1, 8, 3), (128, 256, 64, 1, 8, 3), (128, 128, 128, 1, 8, 2),
    (128, 64, 64, 1, 4, 4),
)]  # fmt: skip


def _label(t: Tiles | None) -> str:
    return "dequantize+matmul" if t is None else str(tuple(t))


def sweep(
    device: torch.device,
    shapes: dict[str, tuple[int, int]] | None = None,
    rows: tuple[int, ...] = SWEEP_ROWS,
    candidates: tuple[list[Tiles], list[Tiles]] = (DECODE_TILES, PREFILL_TILES),
    log=print,
) -> list[dict]:
    """Each candidate tile configuration's median time on the device (µs, :func:`_graph_time`) beside the picked
    one's, per kernel, shape and M (``candidates``: decode's, for M <= 16, and prefill's)."""
    found = []
    for name, (n, k) in (shapes or {s: SHAPES[s] for s in SWEEP_SHAPES}).items():
        weights = _weights(n, k, device)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, torch.bfloat16)
            for kind in ("int4-g128", "fp8-ch"):
                args, _ = weights[kind]
                call = _kernel(kind)
                per_word = 1 if kind == "fp8-ch" else 8
                group = k if kind == "fp8-ch" else GROUP
                picked = gpu_tiles(m, k, group, per_word)
                times = {}
                for t in dict.fromkeys([picked, *candidates[m > 16]]):
                    try:
                        times[t] = _graph_time(lambda *a, t=t, c=call: c(*a, tiles=t), (x, *args), device)
                    except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses is reported
                        log(f"  {kind} {name} M={m} {_label(t)}: {type(e).__name__}: {str(e)[:80]}")
                best = min(times, key=times.get)
                log(f"sweep {kind:>9} {name:>7} M={m:<5} picked {_label(picked)} {times.get(picked, float('nan')):8.1f} us"
                    f"   best {_label(best)} {times[best]:8.1f} us")  # fmt: skip
                found.append({"kind": kind, "shape": name, "m": m, "picked": picked and list(picked),
                              "best": best and list(best), "times_us": {_label(t): v for t, v in times.items()}})  # fmt: skip
    return found


KINDS = ("dense", "int4-g128", "int8-g128", "fp8-ch")
HEADER = f"{'shape':>8} {'N x K':>12} {'M':>5}  " + "  ".join(f"{k:>30}" for k in KINDS)


def format_row(p: Point) -> str:
    """Per kernel: µs on the device, the weight bytes it read per second, and (in brackets) µs per call from
    Python."""
    cells = []
    for kind in KINDS:
        us = p.kernel_us.get(kind, float("nan"))
        gbs = p.weight_bytes.get(kind, 0) / (us * 1e-6) / 1e9 if us == us and us > 0 else float("nan")
        cells.append(f"{us:>8.1f} us {gbs:>5.0f} GB/s ({p.times_us.get(kind, float('nan')):>6.1f})")
    return f"{p.shape:>8} {p.n:>5} x {p.k:<5} {p.m:>5}  " + "  ".join(f"{c:>30}" for c in cells)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the measurements to this JSON file")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tile configurations (CUDA)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu to run the script in Triton's interpreter")
        return 2
    shapes, rows = (SHAPES, ROWS) if device.type == "cuda" else (CPU_SHAPES, CPU_ROWS)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(
        f"weight-only GEMMs on {name}, bfloat16 activations: µs on the device, weight bytes read per second,"
    )
    print("(µs per call from Python, the launch included)")
    print(HEADER)
    points = run(device, shapes, rows)
    worst = max(d for p in points for d in p.max_rel_diff.values())
    print(
        f"largest difference from the float32 product by the dequantized weight: {worst:.3g} of its largest value"
    )
    swept = sweep(device) if args.sweep and device.type == "cuda" else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "points": [asdict(p) for p in points], "sweep": swept}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
