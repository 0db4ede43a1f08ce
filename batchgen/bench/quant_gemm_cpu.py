"""The CPU weight-only GEMM alone: ``python -m batchgen.bench.quant_gemm_cpu [--rows 1,4,16] [--against LIB.so]``.

Times ``kernels/csrc/quant_linear_cpu.c`` on one projection of a 1B-class Llama (``N x K`` = 5632 x 2048, the
gate/up width of a hidden-2048 model) for GGUF Q4_0, Q8_0, Q4_K and Q6_K weights, at a few input rows (the
decode of a few sequences to a batch), beside the float32 GEMM of ``kernels/csrc/linear_cpu.c`` on the same
weights: the median of ``--repeats`` rounds, each timing a run of calls, on ``torch.get_num_threads()``
threads. Q4_0 and Q8_0 are the ``gguf`` package's quantization of random weights; the other formats (``--kinds``)
random blocks (their bytes decode to finite weights). ``--against`` times a second build of the kernel library (an earlier
commit's ``batchgen_cpu.so``, from ``$BATCHGEN_CACHE/cpu_kernels/``) round by round beside the current one and
checks that both give the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from batchgen.kernels import cpu_kernel, cpu_linear
from batchgen.kernels.cpu_quant_linear import FORMATS, integer_inputs

KINDS = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")
"""The formats timed by default (``--kinds`` picks any of :data:`FORMATS`)."""


def _packed(name: str, n: int, k: int, rng: np.random.Generator, weight: np.ndarray) -> np.ndarray:
    import gguf

    from batchgen.models.quant.gguf_writer import random_blocks

    qtype = getattr(gguf.GGMLQuantizationType, name)
    if name in ("Q4_0", "Q8_0"):
        return gguf.quants.quantize(weight, qtype)
    return random_blocks(n, k, int(qtype), seed=int(rng.integers(1 << 31)), scale=0.01).numpy()


def _call(lib: ctypes.CDLL, x: torch.Tensor, packed: np.ndarray, type_id: int, out: torch.Tensor) -> None:
    m, k = x.shape
    n = packed.shape[0]
    status = lib.batchgen_quant_linear(
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(k), ctypes.c_void_p(packed.ctypes.data),
        ctypes.c_int64(packed.shape[1]), ctypes.c_int(type_id), None, ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int64(n), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(n), ctypes.c_int(torch.get_num_threads()),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"batchgen_quant_linear refused type {type_id} [{m}, {k}] x {n}")


def _time(fn, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def run(
    rows: list[int], n: int, k: int, repeats: int, against: str | None, kinds: tuple[str, ...] = KINDS
) -> list[dict[str, Any]]:
    """One entry per row count: median ms per call of each kind (and of ``against``'s build), float32 too."""
    lib = cpu_kernel.library()
    if lib is None:
        raise SystemExit("the C kernels are unavailable here (BATCHGEN_CPU_KERNEL=0 or no C compiler)")
    other = ctypes.CDLL(against) if against else None
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    ids = {FORMATS[t].name: t for t in FORMATS}
    packs = {name: _packed(name, n, k, rng, weight) for name in kinds}
    dense = cpu_linear.pack(torch.from_numpy(weight))
    results = []
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        calls = max(3, 200 // m)
        times: dict[str, list[float]] = {}
        for _ in range(repeats):
            times.setdefault("float32", []).append(
                _time(partial(cpu_linear.linear, x, dense, None, n), calls)
            )
            for name in kinds:
                out = torch.empty(m, n)
                times.setdefault(name, []).append(
                    _time(partial(_call, lib, x, packs[name], ids[name], out), calls)
                )
                if other is not None:
                    theirs = torch.empty(m, n)
                    times.setdefault(f"{name} (--against)", []).append(
                        _time(partial(_call, other, x, packs[name], ids[name], theirs), calls)
                    )
                    if not torch.equal(out, theirs):
                        raise SystemExit(f"{name} at {m} rows: the two builds give different results")
        results.append({"rows": m, "ms": {key: round(statistics.median(v), 3) for key, v in times.items()}})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,16,64")
    ap.add_argument("--n", type=int, default=5632)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated GGUF formats: any of " +
                    ", ".join(f.name for f in FORMATS.values()))  # fmt: skip
    ap.add_argument("--against", help="another build of the kernel library (.so) to time beside this one")
    ap.add_argument("--json", help="write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.k % 256:
        ap.error("--k must be a multiple of 256 (the K-quants' blocks)")
    kinds = tuple(args.kinds.split(","))
    unknown = [name for name in kinds if name not in {f.name for f in FORMATS.values()}]
    if unknown:
        ap.error(f"--kinds: unknown format(s) {unknown}")
    results = run([int(r) for r in args.rows.split(",")], args.n, args.k, args.repeats, args.against, kinds)
    print(f"weight-only GEMM, {args.n} x {args.k}, {torch.get_num_threads()} threads: ms per call (median)")
    if integer_inputs():
        print(
            "(all but Q2_K and Q3_K: integer products over block-integer inputs; BATCHGEN_QUANT_AMX=0: float32)"
        )
    for r in results:
        print(f"{r['rows']:>5} rows  " + "  ".join(f"{key} {ms:.2f}" for key, ms in r["ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"n": args.n, "k": args.k, "threads": torch.get_num_threads(), "results": results},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
