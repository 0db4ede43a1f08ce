"""Micro-benchmark of the block manager (not a test): ``python -m batchgen.bench.block_manager``.

Prints:

1. allocate+free operations per second of the free-queue designs against bitmaps, at two pool sizes,
   with single-block and batched (k=16) allocation; the pool keeps the fastest (list stack + OrderedDict LRU);
2. the cost of the chained content hash (SHA-256 vs BLAKE2b) per block;
3. a continuous-batching workload through the engine's real scheduler and KV cache manager with fake tokens
   (shared few-shot prefixes, n=2 forks, chunked prefill, preemption when full): prefix hits, KV utilization,
   fragmentation, copy-on-write copies and the scheduler's cost per sequence-step.

Timings are medians of ``--repeats`` runs; they are noisy on shared machines, compare ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

from batchgen.bench import fake_runner
from batchgen.bench.fake_runner import FakeRequest
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv.block_pool import BlockPool

# ---------------------------------------------------------------- allocators under comparison


class StackLRUQueue:
    """What BlockPool uses: a list stack of free blocks + an OrderedDict LRU of cached ones."""

    def __init__(self, n: int) -> None:
        self.free_ = list(range(n - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()

    def allocate(self, k: int) -> list[int]:
        free = self.free_
        m = len(free)
        if k <= m:
            out = free[m - k :]
            del free[m - k :]
            return out
        out = free[:]
        free.clear()
        for _ in range(k - m):
            out.append(self.lru.popitem(last=False)[0])
        return out

    def free(self, blocks: list[int]) -> None:
        self.free_.extend(blocks)


class LinkedFreeQueue:
    """Doubly linked free list over prev/next arrays (vLLM's FreeKVCacheBlockQueue design)."""

    def __init__(self, n: int) -> None:
        self.prev = list(range(-1, n - 1))
        self.next = list(range(1, n + 1))
        self.next[n - 1] = -1
        self.head, self.tail = 0, n - 1

    def allocate(self, k: int) -> list[int]:
        out = []
        nxt, prev = self.next, self.prev
        for _ in range(k):
            b = self.head
            if b == -1:
                raise RuntimeError("empty")
            h = nxt[b]
            self.head = h
            if h == -1:
                self.tail = -1
            else:
                prev[h] = -1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        nxt, prev = self.next, self.prev
        for b in blocks:
            t = self.tail
            prev[b] = t
            nxt[b] = -1
            if t == -1:
                self.head = b
            else:
                nxt[t] = b
            self.tail = b


class BigIntBitmap:
    """One arbitrary-precision int, bit i set = block i free; lowest set bit via ``x & -x``."""

    def __init__(self, n: int) -> None:
        self.bits = (1 << n) - 1

    def allocate(self, k: int) -> list[int]:
        out = []
        bits = self.bits
        for _ in range(k):
            low = bits & -bits
            if not low:
                raise RuntimeError("empty")
            out.append(low.bit_length() - 1)
            bits ^= low
        self.bits = bits
        return out

    def free(self, blocks: list[int]) -> None:
        bits = self.bits
        for b in blocks:
            bits |= 1 << b
        self.bits = bits


class WordBitmap:
    """Array of 64-bit words (bit set = free) with a rotating cursor to the last non-empty word."""

    def __init__(self, n: int) -> None:
        self.words = [(1 << 64) - 1] * (n // 64) + ([(1 << (n % 64)) - 1] if n % 64 else [])
        self.cursor = 0

    def allocate(self, k: int) -> list[int]:
        out = []
        words = self.words
        nw = len(words)
        c = self.cursor
        for _ in range(k):
            scanned = 0
            while not words[c]:
                c = c + 1 if c + 1 < nw else 0
                scanned += 1
                if scanned > nw:
                    raise RuntimeError("empty")
            w = words[c]
            low = w & -w
            words[c] = w ^ low
            out.append(c * 64 + low.bit_length() - 1)
        self.cursor = c
        return out

    def free(self, blocks: list[int]) -> None:
        words = self.words
        for b in blocks:
            words[b >> 6] |= 1 << (b & 63)


class PoolAdapter:
    """The real BlockPool (refcounts included) behind the same two calls."""

    def __init__(self, n: int) -> None:
        self.pool = BlockPool(n, 16)

    def allocate(self, k: int) -> list[int]:
        return self.pool.allocate(k)

    def free(self, blocks: list[int]) -> None:
        self.pool.free(blocks)


ALLOCATORS: dict[str, Callable[[int], object]] = {
    "free queue: list stack + OrderedDict LRU (BlockPool's core)": StackLRUQueue,
    "free queue: doubly linked list": LinkedFreeQueue,
    "bitmap: big int, lowest set bit": BigIntBitmap,
    "bitmap: 64-bit words + cursor": WordBitmap,
    "BlockPool (with refcounts)": PoolAdapter,
}


def bench_allocator(factory: Callable[[int], object], num_blocks: int, k: int, ops: int, seed: int) -> float:
    """Allocated+freed blocks per second at 75% steady occupancy, random victims (same for all designs)."""
    a = factory(num_blocks)
    held: list[list[int]] = []
    held_blocks = 0
    while held_blocks + k <= num_blocks * 3 // 4:
        held.append(a.allocate(k))  # type: ignore[attr-defined]
        held_blocks += k
    rng = random.Random(seed)
    victims = [rng.randrange(len(held)) for _ in range(ops)]
    alloc, free = a.allocate, a.free  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for v in victims:
        free(held[v])
        held[v] = alloc(k)
    dt = time.perf_counter() - t0
    return ops * k / dt


def bench_hash(repeats: int, block_size: int = 16, n: int = 50_000) -> dict[str, float]:
    toks = list(range(1000, 1000 + block_size))
    parent = b"\x01" * 32
    packer = struct.Struct(f"<{block_size}q")
    fns = {
        "sha256 (used)": lambda: hashlib.sha256(parent + packer.pack(*toks)).digest(),
        "blake2b-128": lambda: hashlib.blake2b(parent + packer.pack(*toks), digest_size=16).digest(),
        "python hash(tuple) (not stable, reference)": lambda: hash((parent, tuple(toks))),
    }
    out = {}
    for name, fn in fns.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
        out[name] = statistics.median(times) * 1e9
    return out


# ------------------------------------------------------------------------- simulated workload


def workload(num_requests: int = 512, fork_every: int = 4, seed: int = 0) -> list[FakeRequest]:
    """4 few-shot templates (~256 tokens) + a distinct ~32-token item each; every ``fork_every``-th request
    samples n=2; 32-128 output tokens."""
    rng = random.Random(seed)
    templates = [[rng.randrange(32000) for _ in range(rng.randint(240, 272))] for _ in range(4)]
    reqs = []
    for i in range(num_requests):
        prompt = templates[i % 4] + [rng.randrange(32000) for _ in range(rng.randint(24, 40))]
        reqs.append(FakeRequest(prompt, rng.randint(32, 128), 2 if i % fork_every == 0 else 1))
    return reqs


def simulate(
    num_requests: int = 512,
    num_blocks: int = 2048,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 4096,
    fork_every: int = 4,
    seed: int = 0,
) -> dict[str, float]:
    """The workload above through the engine's real scheduler and KV cache manager, fake tokens
    (:mod:`batchgen.bench.fake_runner`); figures as the scheduler and the manager report them."""
    reqs = workload(num_requests, fork_every, seed)
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    run = fake_runner.run(reqs, config, seed=seed)
    st, kv, steps = run.stats, run.kv, run.steps
    return {
        "requests": num_requests,
        "sequences (with n=2 forks)": sum(r.n for r in reqs),
        "steps": st.num_steps,
        "prefix hit rate (prompt tokens)": st.prefix_hit_rate,
        "mean KV utilization": statistics.fmean(s.kv_utilization for s in steps),
        "mean internal fragmentation": statistics.fmean(1 - s.kv_utilization for s in steps),
        "mean running sequences": statistics.fmean(s.running_seqs for s in steps),
        "peak running sequences": st.peak_running_seqs,
        "peak blocks used": kv.peak_blocks_used,
        "copy-on-write copies": st.num_cow_copies,
        "cached-block evictions": kv.num_evictions,
        "preemptions": st.num_preemptions,
        "scheduler µs per sequence-step (schedule + update)": run.scheduler_s / max(run.seq_steps, 1) * 1e6,
    }


def bench_allocators(repeats: int, total_ops: int) -> None:
    print("## Allocate + free throughput (blocks/s, median of", repeats, "runs, 75% occupancy)\n")
    sizes = (4096, 65536)
    header = "| allocator | " + " | ".join(f"{n} blocks, k={k}" for n in sizes for k in (1, 16)) + " |"
    print(header)
    print("|---|" + "---:|" * (len(sizes) * 2))
    for name, factory in ALLOCATORS.items():
        cells = []
        for n in sizes:
            for k in (1, 16):
                ops = total_ops // k
                rates = [bench_allocator(factory, n, k, ops, seed=r) for r in range(repeats)]
                cells.append(f"{statistics.median(rates) / 1e6:.2f} M")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", type=int, default=100_000, help="allocate+free operations per measurement")
    ap.add_argument("--requests", type=int, default=512, help="requests of the simulated workload")
    ap.add_argument(
        "--sections", default="alloc,hash,workload", help="comma-separated: alloc, hash, workload"
    )
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    figures: dict[str, float] = {}
    if "alloc" in sections:
        bench_allocators(args.repeats, args.ops)
    if "hash" in sections:
        print("\n## Content hash of one 16-token block (ns, median)\n")
        for name, ns in bench_hash(args.repeats).items():
            print(f"- {name}: {ns:.0f} ns")
    if "workload" in sections:
        print(
            "\n## Simulated workload (Scheduler + KVCacheManager, fake tokens; 2048 x 16-token blocks, max 256 seqs)\n"
        )
        figures = simulate(num_requests=args.requests)
        for key, value in figures.items():
            print(f"- {key}: {value:.4g}" if isinstance(value, float) else f"- {key}: {value}")
    return figures


if __name__ == "__main__":
    main()
