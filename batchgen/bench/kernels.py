"""Paged-attention kernel benchmark (CUDA): ``python -m batchgen.bench.kernels [--dry-run] [--json PATH]``.

Decode (one query per sequence, every sequence ``ctx`` tokens long, Llama-3-8B heads: 32 q / 8 kv, head_dim
128, bf16, block size 16) over a grid of batch 1..256 × context 128..32k, timing

* ``triton``        our paged decode kernel as the engine calls it (split-K heuristic),
* ``triton-1pass``  the same kernel forced to a single pass (``num_splits=1``),
* ``triton-splitk`` forced split-K (``num_splits = clamp(ctx // 512, 2, 64)``),
* ``sdpa``          ``torch.nn.functional.scaled_dot_product_attention`` on K/V already gathered into
  contiguous ``[B, Hkv, ctx, D]`` tensors (an un-paged lower bound for torch; gather not timed),
* ``torch-ref``     our torch backend (the engine's CPU path) on CUDA: gather + SDPA,
* ``flash-attn``    FlashAttention's paged ``flash_attn_with_kvcache`` (page size 256, its minimum), when
  the ``flash_attn`` package is importable.

Decode is memory-bound, so each row reports the achieved bandwidth ``(K/V bytes read + q + out) / time`` and
its fraction of the device's datasheet peak (H200: 4.8 TB/s) and of a device-to-device copy measured in the
same run (bytes read + written / time: the practical ceiling). Prefill (single chunks of 512..8192 new
tokens, with and without a cached prefix, and a batch of chunks) reports time and TFLOP/s against SDPA
(causal, contiguous; only where no prefix) and flash-attn.

Times are medians of ``triton.testing.do_bench`` (which flushes the L2 between runs). ``--dry-run`` prints the
grid with its byte counts and needs neither CUDA nor Triton. The full run takes about 2 minutes on an H200.
``--cpu`` instead times the torch backend (the engine's CPU attention) on CPU-sized shapes; ``--cpu-decode``
times the C decode kernel (kernels/cpu_kernel.py) against the torch path it replaces, one layer per case;
``--cpu-prefill`` the C prefill kernel against the torch path; ``--cpu-cascade`` decode over shared prefixes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from batchgen.kernels.options import AttentionOptions
from batchgen.kernels.paged_kv import PagedKV

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 8, 32, 128, 256)
DECODE_CONTEXTS = (128, 1024, 4096, 16384, 32768)
MAX_KV_BYTES = 24 * 2**30  # skip grid points whose K/V alone exceed this (SDPA needs a second copy)
# (chunk length, cached prefix length, number of sequences)
PREFILL_CASES = ((512, 0, 1), (2048, 0, 1), (8192, 0, 1), (2048, 6144, 1), (512, 0, 16), (512, 3584, 8))
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "A10": 0.6e12}
FA_PAGE = 256


@dataclass
class DecodePoint:
    batch: int
    context: int
    kv_bytes: int  # K and V read
    io_bytes: int  # q read + out written
    times_us: dict[str, float] = field(default_factory=dict)
    max_abs_diff: float = float("nan")  # ours (heuristic, single pass, split-K) vs the torch backend

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.io_bytes


@dataclass
class PrefillPoint:
    q_len: int
    context: int
    num_seqs: int
    flops: float  # 4 * Hq * D * (query, key) pairs attended
    times_us: dict[str, float] = field(default_factory=dict)


def decode_grid() -> list[DecodePoint]:
    elem = torch.tensor([], dtype=DTYPE).element_size()
    points = []
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            kv = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * elem
            if kv > MAX_KV_BYTES:
                continue
            points.append(DecodePoint(batch, ctx, kv, 2 * batch * NUM_Q_HEADS * HEAD_DIM * elem))
    return points


def prefill_grid() -> list[PrefillPoint]:
    points = []
    for q_len, ctx, n in PREFILL_CASES:
        pairs = n * (q_len * ctx + q_len * (q_len + 1) // 2)
        points.append(PrefillPoint(q_len, ctx, n, 4.0 * NUM_Q_HEADS * HEAD_DIM * pairs))
    return points


def print_dry_run() -> None:
    print(f"decode: Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} {DTYPE} block_size={BLOCK_SIZE}")
    print(f"{'batch':>6} {'context':>8} {'K/V MB':>10} {'q+out KB':>9}")
    for p in decode_grid():
        print(f"{p.batch:>6} {p.context:>8} {p.kv_bytes / 1e6:>10.1f} {p.io_bytes / 1e3:>9.1f}")
    print("prefill:")
    print(f"{'q_len':>6} {'prefix':>7} {'seqs':>5} {'GFLOP':>8}")
    for p in prefill_grid():
        print(f"{p.q_len:>6} {p.context:>7} {p.num_seqs:>5} {p.flops / 1e9:>8.1f}")


# ------------------------------------------------------------------------------------------------ CUDA
def _bench(fn) -> float:
    """Median time of ``fn`` in µs; NaN (with a message) when it fails, e.g. out of memory."""
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3
    except RuntimeError as exc:
        print(f"  measurement failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        torch.cuda.empty_cache()
        return float("nan")


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    us = _bench(lambda: dst.copy_(src))
    return 2 * 2**30 / (us * 1e-6)


def _paged_setup(
    batch: int, ctx: int, block_size: int, device: torch.device, q_len: int = 1
) -> tuple[torch.Tensor, PagedKV]:
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    perm = torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq].to(torch.int32) + 1
    tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch * q_len, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    return q, PagedKV(k_cache, v_cache, tables, seq_lens)


def _flash_attn():
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:
        return None
    return flash_attn_with_kvcache


def _measure_point(
    p, measure, flash_shape: tuple[int, int, int], device: torch.device, log, name: str
) -> None:
    """``measure(p, device)``, then FlashAttention's paged kernel on ``flash_shape`` (batch, q_len, total)
    where it is installed. An error outside a timed call (out of memory) is logged as ``name``'s and keeps
    what was measured."""
    try:
        measure(p, device)
        if _flash_attn() is not None:
            torch.cuda.empty_cache()
            p.times_us["flash-attn"] = _flash_attn_paged(*flash_shape, device)
    except RuntimeError as exc:
        log(f"{name} stopped: {str(exc).splitlines()[0][:200]}")
    torch.cuda.empty_cache()


def run_decode(device: torch.device, log) -> list[DecodePoint]:
    points = decode_grid()
    for p in points:
        name = f"decode B={p.batch} ctx={p.context}"
        _measure_point(p, _measure_decode, (p.batch, 1, p.context), device, log, name)
        log(
            f"decode B={p.batch:<4} ctx={p.context:<6} "
            + " ".join(f"{k}={v:.1f}us" for k, v in p.times_us.items())
            + f" max|ours-ref|={p.max_abs_diff:.2g}"
        )
    return points


def _measure_decode(p: DecodePoint, device: torch.device) -> None:
    from batchgen.kernels import torch_backend
    from batchgen.kernels.decode_attention import MAX_SPLITS, paged_decode_attention

    scale = HEAD_DIM**-0.5
    options = AttentionOptions(scale)
    q, kv = _paged_setup(p.batch, p.context, BLOCK_SIZE, device)
    forced = max(2, min(MAX_SPLITS, p.context // 512))
    t = p.times_us
    t["triton"] = _bench(lambda: paged_decode_attention(q, kv, options, max_seq_len=p.context))
    t["triton-1pass"] = _bench(lambda: paged_decode_attention(q, kv, options, num_splits=1))
    t["triton-splitk"] = _bench(lambda: paged_decode_attention(q, kv, options, num_splits=forced))
    ws = torch_backend.Workspace()
    t["torch-ref"] = _bench(lambda: torch_backend.paged_decode_attention(q, kv, options, workspace=ws))
    ref = torch_backend.paged_decode_attention(q, kv, options, workspace=ws).float()
    ws.clear()
    p.max_abs_diff = max(
        float((paged_decode_attention(q, kv, options, num_splits=n).float() - ref).abs().max())
        for n in (None, 1, forced)
    )
    t["sdpa"] = _sdpa_decode(q, kv, p.context, scale)


def _sdpa_decode(q: torch.Tensor, kv: PagedKV, context: int, scale: float) -> float:
    k, v = _contiguous_kv(kv, context)
    q4 = q.unsqueeze(2)
    return _bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
    )


def _flash_attn_paged(batch: int, q_len: int, total: int, device: torch.device) -> float:
    """FlashAttention's paged kernel on its own cache (page size 256), causal (bottom-right aligned)."""
    fa = _flash_attn()
    q, kv = _paged_setup(batch, total, FA_PAGE, device, q_len=q_len)
    q = q.view(batch, q_len, NUM_Q_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    kc, vc, tables, lens = kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens
    return _bench(
        lambda: fa(q, kc, vc, cache_seqlens=lens, block_table=tables, softmax_scale=scale, causal=True)
    )


def _contiguous_kv(kv: PagedKV, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of every sequence gathered into contiguous ``[B, Hkv, length, D]`` tensors."""
    tables = kv.block_tables.long()
    shape = (tables.shape[0], tables.shape[1] * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = kv.k_cache[tables].view(shape)[:, :length].transpose(1, 2).contiguous()
    v = kv.v_cache[tables].view(shape)[:, :length].transpose(1, 2).contiguous()
    return k, v


def run_prefill(device: torch.device, log) -> list[PrefillPoint]:
    points = prefill_grid()
    for p in points:
        name = f"prefill q={p.q_len} prefix={p.context}"
        flash_shape = (p.num_seqs, p.q_len, p.q_len + p.context)
        _measure_point(p, _measure_prefill, flash_shape, device, log, name)
        log(
            f"prefill q={p.q_len:<5} prefix={p.context:<5} seqs={p.num_seqs:<3} "
            + " ".join(
                f"{k}={v:.1f}us ({p.flops / (v * 1e-6) / 1e12:.0f} TFLOP/s)" for k, v in p.times_us.items()
            )
        )
    return points


def _measure_prefill(p: PrefillPoint, device: torch.device) -> None:
    from batchgen.kernels.prefill_attention import paged_prefill_attention

    scale = HEAD_DIM**-0.5
    options = AttentionOptions(scale)
    total = p.q_len + p.context
    q, kv = _paged_setup(p.num_seqs, total, BLOCK_SIZE, device, q_len=p.q_len)
    cu = torch.arange(p.num_seqs + 1, dtype=torch.int32, device=device) * p.q_len
    t = p.times_us
    t["triton"] = _bench(lambda: paged_prefill_attention(q, cu, kv, options, max_query_len=p.q_len))
    if p.context == 0:  # SDPA's causal mask is top-left aligned: exact only without a prefix
        t["sdpa"] = _sdpa_prefill(q, kv, p, scale)


def _sdpa_prefill(q: torch.Tensor, kv: PagedKV, p: PrefillPoint, scale: float) -> float:
    k, v = _contiguous_kv(kv, p.q_len)
    q4 = q.view(p.num_seqs, p.q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
    return _bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
    )


# ------------------------------------------------------------------------------------------------- CPU
CPU_SHAPE = dict(num_q_heads=8, num_kv_heads=4, head_dim=64, block_size=16)
CPU_LAYERS = 8
CPU_DECODE_BATCHES = (64, 256)
# (chunk length, cached prefix length, number of sequences)
CPU_PREFILL_CASES = ((512, 0, 1), (2048, 0, 1), (512, 1536, 1), (512, 0, 4), (32, 100, 64))


def run_cpu(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), repeats: int = 3) -> list[str]:
    """Time the torch backend (the engine's CPU attention) on CPU shapes: 8 layers, 8 q / 4 kv heads,
    head_dim 64, decode batches with contexts 300..700 and prefill chunks. Best of ``repeats`` wall and CPU
    (process) times per 8-layer pass; CPU time is steadier on a shared machine."""
    from batchgen.kernels import torch_backend
    from batchgen.kernels.testing import make_paged_batch

    def best(fn) -> tuple[float, float]:
        fn()
        wall = cpu = float("inf")
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
        return wall * 1e3, cpu * 1e3

    lines = [f"torch backend on CPU ({torch.get_num_threads()} threads), {CPU_LAYERS} layers, {CPU_SHAPE}"]
    ws = torch_backend.Workspace()
    for dtype in dtypes:
        for batch in CPU_DECODE_BATCHES:
            gen = torch.Generator().manual_seed(batch)
            lens = torch.randint(300, 701, (batch,), generator=gen).tolist()
            layers = [make_paged_batch(lens, dtype=dtype, seed=i, **CPU_SHAPE) for i in range(CPU_LAYERS)]

            def decode(layers=layers):
                for b in layers:
                    torch_backend.paged_decode_attention(b.q, b.kv, b.options(), workspace=ws)

            wall, cpu = best(decode)
            lines.append(
                f"decode  {str(dtype):15} B={batch:<4} ctx 300-700: {wall:8.1f} ms ({cpu:8.1f} ms CPU)"
            )
        for q_len, ctx, n in CPU_PREFILL_CASES:
            layers = [
                make_paged_batch([q_len + ctx] * n, [q_len] * n, dtype=dtype, seed=i, **CPU_SHAPE)
                for i in range(CPU_LAYERS)
            ]

            def prefill(layers=layers):
                for b in layers:
                    torch_backend.paged_prefill_attention(
                        b.q, b.cu_seqlens_q, b.kv, b.options(), workspace=ws
                    )

            wall, cpu = best(prefill)
            lines.append(
                f"prefill {str(dtype):15} {n}x{q_len} new after {ctx} cached: {wall:8.1f} ms ({cpu:8.1f} ms CPU)"
            )
        ws.clear()
    return lines


# (label, context lengths drawn from, number of sequences, shared prefix tokens)
CPU_KERNEL_CASES = (
    ("64 seqs, ctx 300-460", (300, 460), 64, 0),
    ("256 seqs, ctx 300-700", (300, 700), 256, 0),
    ("16 seqs, ctx 200-600", (200, 600), 16, 0),
    ("1 seq, ctx 4096", (4096, 4096), 1, 0),
    ("256 seqs, 360 ctx, 192 shared", (360, 360), 256, 192),
    ("256 seqs, 360 ctx, 288 shared", (360, 360), 256, 288),
)


def _cpu_kernel_case(lens_range, num_seqs: int, shared: int, dtype: torch.dtype, seed: int):
    """One layer's paged decode batch (CPU_SHAPE heads); the first ``shared`` tokens of every sequence sit in
    the same physical blocks (a shared prompt prefix), the rest in shuffled blocks of their own."""
    from batchgen.kernels.testing import make_paged_batch

    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lens_range[0], lens_range[1] + 1, (num_seqs,), generator=gen).tolist()
    batch = make_paged_batch(lens, dtype=dtype, seed=seed, **CPU_SHAPE)
    n = shared // CPU_SHAPE["block_size"]
    if n:
        batch.block_tables[:, :n] = batch.block_tables[0, :n]
    return batch


def run_cpu_decode(repeats: int = 10) -> list[str]:
    """The CPU decode kernel (kernels/cpu_kernel.py) against the torch path it replaces (gather + SDPA,
    ``BATCHGEN_CPU_KERNEL=0``), both through ``torch_backend.paged_decode_attention`` as the engine calls it
    (with a workspace), one layer, float32; bfloat16 for the torch path alone (the kernel does not serve it).
    Medians of ``repeats`` interleaved calls, wall and process CPU time."""
    import os

    from batchgen.kernels import cpu_kernel, torch_backend

    ws = torch_backend.Workspace()
    if cpu_kernel.library() is None:
        return ["the CPU kernel is unavailable here (no compiler, or BATCHGEN_CPU_KERNEL=0)"]
    lines = [
        f"decode attention, one layer, {torch.get_num_threads()} threads, {CPU_SHAPE}; median ms wall (CPU)",
        f"{'case':34} {'torch fp32':>18} {'kernel fp32':>18} {'speed-up':>8} {'max|diff|':>9} {'torch bf16':>18}",
    ]
    for i, (label, lens_range, num_seqs, shared) in enumerate(CPU_KERNEL_CASES):
        runs = {}
        for dtype in (torch.float32, torch.bfloat16):
            b = _cpu_kernel_case(lens_range, num_seqs, shared, dtype, seed=i)
            args = (b.q, b.kv, b.options())
            modes = ("torch", "kernel") if dtype == torch.float32 else ("torch",)
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
            outs = {}
            for _ in range(repeats + 1):
                for mode in modes:
                    os.environ[cpu_kernel.ENV_SWITCH] = "1" if mode == "kernel" else "0"
                    t, c = time.perf_counter(), time.process_time()
                    outs[mode] = torch_backend.paged_decode_attention(*args, workspace=ws, plan_cache={})
                    times[mode].append((time.perf_counter() - t, time.process_time() - c))
            os.environ.pop(cpu_kernel.ENV_SWITCH, None)
            for mode in modes:
                walls, cpus = zip(*times[mode][1:])
                runs[(mode, dtype)] = (
                    sorted(walls)[len(walls) // 2] * 1e3,
                    sorted(cpus)[len(cpus) // 2] * 1e3,
                )
            if dtype == torch.float32:
                diff = (outs["torch"] - outs["kernel"]).abs().max().item()
        cell = {k: f"{w:7.2f} ({c:7.2f})" for k, (w, c) in runs.items()}
        speed = runs[("torch", torch.float32)][0] / runs[("kernel", torch.float32)][0]
        lines.append(
            f"{label:34} {cell[('torch', torch.float32)]:>18} {cell[('kernel', torch.float32)]:>18} "
            f"{speed:7.2f}x {diff:9.1e} {cell[('torch', torch.bfloat16)]:>18}"
        )
        ws.clear()
    return lines


# (label, context lengths, query lengths): fresh prompts, and chunks after a cached context
CPU_PREFILL_CASES = (
    ("1 prompt of 300", [300], [300]),
    ("1 prompt of 1200", [1200], [1200]),
    ("9 prompts of 50-600", [427, 82, 331, 596, 215, 144, 503, 61, 378], None),
    ("64 prompts of 20-60", None, None),
    ("16 chunks of 40 after 300", [340] * 16, [40] * 16),
)


def run_cpu_prefill(repeats: int = 7) -> list[str]:
    """CPU prefill attention, one layer, float32: the C kernel (``cpu_kernel.prefill``, what the engine runs)
    against the torch path it replaced (one flash call per long prompt, padded masked calls for the rest),
    both through ``torch_backend.paged_prefill_attention`` with a workspace; no shared prefix. Medians of
    ``repeats`` interleaved calls, ms wall; the C kernel's GFLOP/s over the causal work."""
    import os
    import random

    from batchgen.kernels import cpu_kernel, torch_backend
    from batchgen.kernels.options import AttentionOptions
    from batchgen.kernels.testing import make_paged_batch

    if cpu_kernel.library() is None:
        return ["the CPU kernel is unavailable here (no compiler, or BATCHGEN_CPU_KERNEL=0)"]
    ws, opt = torch_backend.Workspace(), AttentionOptions(0.125)
    hq, hkv, d, bs = (CPU_SHAPE[k] for k in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"))
    lines = [
        f"prefill attention, one layer, {torch.get_num_threads()} threads, {CPU_SHAPE}; median ms wall",
        f"{'case':28} {'torch path':>11} {'C kernel':>9} {'speed-up':>8} {'GFLOP/s':>8} {'max|diff|':>9}",
    ]
    rng = random.Random(0)
    for label, lens, q_lens in CPU_PREFILL_CASES:
        if lens is None:
            lens = [rng.randint(20, 60) for _ in range(64)]
        q_lens = list(lens) if q_lens is None else q_lens
        b = make_paged_batch(lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs)
        times: dict[str, list[float]] = {"0": [], "1": []}
        outs = {}
        for _ in range(repeats + 1):
            for switch in times:
                os.environ[cpu_kernel.ENV_SWITCH] = switch
                t = time.perf_counter()
                outs[switch] = torch_backend.paged_prefill_attention(
                    b.q, b.cu_seqlens_q, b.kv, opt, workspace=ws
                )
                times[switch].append(time.perf_counter() - t)
        os.environ.pop(cpu_kernel.ENV_SWITCH, None)
        torch_ms, kernel_ms = (sorted(times[k][1:])[repeats // 2] * 1e3 for k in ("0", "1"))
        flops = sum(4 * m * (n - m + (m + 1) / 2) * hq * d for n, m in zip(lens, q_lens))
        diff = (outs["0"] - outs["1"]).abs().max().item()
        lines.append(
            f"{label:28} {torch_ms:11.2f} {kernel_ms:9.2f} {torch_ms / kernel_ms:7.2f}x "
            f"{flops / kernel_ms / 1e6:8.1f} {diff:9.1e}"
        )
        ws.clear()
    return lines


# (sequences, groups, shared prefix blocks per group, own blocks per sequence)
CPU_CASCADE_CASES = (
    (32, 4, 21, 3),
    (64, 4, 21, 3),
    (64, 4, 21, 8),
    (256, 4, 21, 3),
    (64, 2, 64, 4),
    (16, 1, 64, 2),
    (64, 16, 4, 8),
    (64, 8, 2, 20),
    (8, 2, 3, 20),
)


def _cascade_case(num_seqs: int, groups: int, prefix: int, own: int, seed: int):
    """One layer's decode batch whose sequences, in `groups` interleaved groups, share `prefix` blocks."""
    from batchgen.kernels import PagedKV

    gen = torch.Generator().manual_seed(seed)
    bs, hq, hkv, d = (CPU_SHAPE[k] for k in ("block_size", "num_q_heads", "num_kv_heads", "head_dim"))
    num_blocks = groups * prefix + num_seqs * own
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    tables = torch.empty(num_seqs, prefix + own, dtype=torch.int32)
    for b in range(num_seqs):
        tables[b, :prefix] = torch.arange(prefix) + (b % groups) * prefix
        tables[b, prefix:] = torch.arange(own) + groups * prefix + b * own
    lens = (prefix + own - 1) * bs + 1 + torch.randint(0, bs, (num_seqs,), generator=gen).int()
    return torch.randn(num_seqs, hq, d, generator=gen), PagedKV(k, v, tables, lens)


def run_cpu_cascade(repeats: int = 10) -> list[str]:
    """Decode over groups sharing a prefix, one layer, float32: the C kernel reading every block; the cascade
    (each group's prefix once, by the CPU flash op) with its suffixes by gather + SDPA or by the C kernel in
    place; and what the engine's call picks. Medians of ``repeats`` interleaved calls, ms wall."""
    from batchgen.kernels import cpu_kernel, torch_backend
    from batchgen.kernels.options import AttentionOptions

    if cpu_kernel.library() is None:
        return ["the CPU kernel is unavailable here (no compiler, or BATCHGEN_CPU_KERNEL=0)"]
    ws, opt = torch_backend.Workspace(), AttentionOptions(0.125)

    def every_group(q, kv, plans):  # the cascade with the kernel over every group, however little it saves
        keep, cpu_kernel.CASCADE_MIN_GROUP_BLOCKS = cpu_kernel.CASCADE_MIN_GROUP_BLOCKS, 0
        try:
            return torch_backend._decode_cascade(q, kv, 0.125, ws, plans, 0.0, True)
        finally:
            cpu_kernel.CASCADE_MIN_GROUP_BLOCKS = keep

    # Each mode keeps its plan for the case across the repeats, as the engine keeps one for a forward's layers.
    modes = {
        "kernel": lambda q, kv, plans: cpu_kernel.decode(q, kv, opt),
        "cascade+sdpa": lambda q, kv, plans: torch_backend._decode_cascade(q, kv, 0.125, ws, plans, 0.0),
        "cascade+kernel": every_group,
        "engine": lambda q, kv, plans: torch_backend.paged_decode_attention(
            q, kv, opt, workspace=ws, plan_cache=plans
        ),
    }
    lines = [
        f"decode attention over shared prefixes, one layer, {torch.get_num_threads()} threads, {CPU_SHAPE}; "
        "median ms wall",
        f"{'seqs x groups, prefix + own blocks':36} {'saved':>6} " + " ".join(f"{m:>15}" for m in modes),
    ]
    for i, (num_seqs, groups, prefix, own) in enumerate(CPU_CASCADE_CASES):
        q, kv = _cascade_case(num_seqs, groups, prefix, own, seed=i)
        times: dict[str, list[float]] = {m: [] for m in modes}
        plans: dict[str, dict] = {m: {} for m in modes}
        for _ in range(repeats + 1):  # the first round (plans made, kernel loaded) is left out
            for name, fn in modes.items():
                t = time.perf_counter()
                fn(q, kv, plans[name])
                times[name].append(time.perf_counter() - t)
        saved = (num_seqs - groups) * prefix / (num_seqs * (prefix + own))
        cells = " ".join(f"{sorted(t[1:])[repeats // 2] * 1e3:15.2f}" for t in times.values())
        lines.append(f"{f'{num_seqs} x {groups}, {prefix} + {own}':36} {saved:6.2f} {cells}")
    return lines


def _peak_for(name: str) -> float | None:
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    return None


def format_decode_table(points: list[DecodePoint], peak: float | None, copy_bw: float) -> str:
    methods = ["triton", "triton-1pass", "triton-splitk", "sdpa", "torch-ref", "flash-attn"]
    methods = [m for m in methods if any(m in p.times_us for p in points)]
    lines = [
        "Decode: time µs | achieved GB/s | % of datasheet peak | % of measured copy bandwidth",
        "| batch | context | K/V MB | " + " | ".join(methods) + " |",
        "|---:|---:|---:|" + "---:|" * len(methods),
    ]
    for p in points:
        cells = []
        for m in methods:
            us = p.times_us.get(m)
            if us is None:
                cells.append("–")
                continue
            bw = p.total_bytes / (us * 1e-6)
            peak_pct = f"{100 * bw / peak:.0f}%" if peak else "?"
            cells.append(f"{us:.1f} / {bw / 1e9:.0f} / {peak_pct} / {100 * bw / copy_bw:.0f}%")
        lines.append(f"| {p.batch} | {p.context} | {p.kv_bytes / 1e6:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_prefill_table(points: list[PrefillPoint]) -> str:
    methods = [m for m in ("triton", "sdpa", "flash-attn") if any(m in p.times_us for p in points)]
    lines = [
        "Prefill: time µs / TFLOP/s",
        "| q_len | prefix | seqs | " + " | ".join(methods) + " |",
        "|---:|---:|---:|" + "---:|" * len(methods),
    ]
    for p in points:
        cells = [
            f"{p.times_us[m]:.1f} / {p.flops / (p.times_us[m] * 1e-6) / 1e12:.0f}" if m in p.times_us else "–"
            for m in methods
        ]
        lines.append(f"| {p.q_len} | {p.context} | {p.num_seqs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write_json(path, device_name, peak, copy_bw, decode: list[DecodePoint], prefill: list[PrefillPoint]):
    result = {
        "device": device_name,
        "torch": torch.__version__,
        "peak_bandwidth": peak,
        "copy_bandwidth": copy_bw,
        "shape": dict(
            num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            dtype=str(DTYPE),
            block_size=BLOCK_SIZE,
        ),  # fmt: skip
        "decode": [asdict(p) | {"total_bytes": p.total_bytes} for p in decode],
        "prefill": [asdict(p) for p in prefill],
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the grid and byte counts; no CUDA")
    parser.add_argument("--json", help="write all measurements to this JSON file")
    parser.add_argument(
        "--peak-bw", type=float, help="datasheet memory bandwidth in bytes/s (default: by name)"
    )
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="time the torch backend on CPU shapes instead")
    parser.add_argument(
        "--cpu-decode", action="store_true", help="CPU decode: the C kernel vs the torch path, one layer"
    )
    parser.add_argument(
        "--cpu-cascade", action="store_true", help="CPU decode over shared prefixes: kernel vs cascades"
    )
    parser.add_argument(
        "--cpu-prefill", action="store_true", help="CPU prefill: the C kernel vs the torch path, one layer"
    )
    args = parser.parse_args(argv)
    if args.cpu_cascade or args.cpu_prefill:
        for line in run_cpu_cascade() if args.cpu_cascade else run_cpu_prefill():
            print(line, flush=True)
        return 0
    if args.dry_run:
        print_dry_run()
        return 0
    if args.cpu or args.cpu_decode:
        for line in run_cpu_decode() if args.cpu_decode else run_cpu():
            print(line, flush=True)
        return 0
    if not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA GPU (use --dry-run to see the grid)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_bw or _peak_for(name)
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)

    copy_bw = _copy_bandwidth(device)
    log(f"device {name}; datasheet peak {peak / 1e12 if peak else float('nan'):.2f} TB/s; "
        f"measured copy {copy_bw / 1e12:.2f} TB/s; flash-attn {'yes' if _flash_attn() else 'not installed'}")  # fmt: skip
    decode = run_decode(device, log)
    if args.json:
        _write_json(args.json, name, peak, copy_bw, decode, [])
    prefill = [] if args.skip_prefill else run_prefill(device, log)
    print()
    print(format_decode_table(decode, peak, copy_bw))
    if prefill:
        print()
        print(format_prefill_table(prefill))
    if args.json:
        _write_json(args.json, name, peak, copy_bw, decode, prefill)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
