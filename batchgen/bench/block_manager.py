"""Micro-benchmark of the block manager (not a test): ``python -m batchgen.bench.block_manager``.

Prints:

1. allocate+free operations per second of the free-queue designs against bitmaps, at two pool sizes,
   with single-block and batched (k=16) allocation; the pool keeps the fastest (list stack + OrderedDict LRU);
2. the cost of the chained content hash (SHA-256 vs BLAKE2b) per block;
3. a simulated continuous-batching workload over :class:`KVCacheManager` (shared few-shot prefixes,
   n=2 forks, token-by-token decode, preemption when full): prefix hits, KV utilisation, fragmentation,
   copy-on-write copies and the manager's cost per sequence-step.

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

from batchgen.engine.block_pool import BlockPool
from batchgen.engine.kv_cache import KVCacheManager

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


def simulate(
    num_requests: int = 512,
    num_blocks: int = 2048,
    block_size: int = 16,
    max_num_seqs: int = 256,
    fork_every: int = 4,
    seed: int = 0,
) -> dict[str, float]:
    """Continuous batching over KVCacheManager: 4 few-shot templates (~256 tok) + distinct ~32-tok items.

    Every ``fork_every``-th request samples n=2 (fork after prefill). Each step admits waiting requests
    while ``allocate`` succeeds, then every running sequence grows by one token; when ``append_slots``
    fails the most recently admitted request is preempted (freed, recomputed later).
    """
    rng = random.Random(seed)
    templates = [[rng.randrange(32000) for _ in range(rng.randint(240, 272))] for _ in range(4)]
    reqs = []
    for i in range(num_requests):
        prompt = templates[i % 4] + [rng.randrange(32000) for _ in range(rng.randint(24, 40))]
        reqs.append((i, prompt, rng.randint(32, 128), 2 if i % fork_every == 0 else 1))
    mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    waiting = list(reversed(reqs))
    running: list[list] = []  # [seq_id, req_index, tokens, remaining, admitted_order]
    util, frag, nrun = [], [], []
    preemptions = steps = seq_steps = 0
    mgr_time = 0.0
    order = 0
    while waiting or running:
        steps += 1
        t0 = time.perf_counter()
        while waiting and len(running) < max_num_seqs:
            i, prompt, out_len, n = waiting[-1]
            if mgr.allocate((i, 0), prompt, len(prompt)) is None:
                break
            waiting.pop()
            mgr.cache_full_blocks((i, 0), prompt, len(prompt))
            order += 1
            running.append([(i, 0), i, list(prompt), out_len, order])
            for j in range(1, n):
                mgr.fork((i, 0), (i, j))
                running.append([(i, j), i, list(prompt), out_len, order])
        k = 0
        while k < len(running):
            seq = running[k]
            sid, toks = seq[0], seq[2]
            if mgr.append_slots(sid, len(toks) + 1) is None:
                # preempt the most recently admitted request (all its samples) and retry
                victim = max(running, key=lambda s: s[4])[4]
                group = [s for s in running if s[4] == victim]
                for s in group:
                    mgr.free(s[0])
                running = [s for s in running if s[4] != victim]
                waiting.append(reqs[group[0][1]])
                preemptions += 1
                k = min(k, len(running))
                continue
            toks.append(rng.randrange(32000))
            mgr.cache_full_blocks(sid, toks, len(toks))
            seq[3] -= 1
            k += 1
        seq_steps += len(running)
        st = mgr.stats()
        util.append(st.kv_utilization)
        frag.append(st.internal_fragmentation)
        nrun.append(len(running))
        for s in [s for s in running if s[3] <= 0]:
            mgr.free(s[0])
        running = [s for s in running if s[3] > 0]
        mgr_time += time.perf_counter() - t0
    st = mgr.stats()
    assert st.blocks_used == 0 and st.blocks_free == num_blocks
    return {
        "requests": num_requests,
        "sequences (with n=2 forks)": num_requests + num_requests // fork_every,
        "steps": steps,
        "prefix hit rate (prompt tokens)": st.prefix_hit_rate,
        "mean KV utilisation": statistics.fmean(util),
        "mean internal fragmentation": statistics.fmean(frag),
        "mean running sequences": statistics.fmean(nrun),
        "peak blocks used": st.peak_blocks_used,
        "copy-on-write copies": st.num_cow_copies,
        "cached-block evictions": st.num_evictions,
        "preemptions": preemptions,
        "manager µs per sequence-step": mgr_time / max(seq_steps, 1) * 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", type=int, default=100_000, help="allocate+free operations per measurement")
    args = ap.parse_args(argv)

    print("## Allocate + free throughput (blocks/s, median of", args.repeats, "runs, 75% occupancy)\n")
    sizes = (4096, 65536)
    header = "| allocator | " + " | ".join(f"{n} blocks, k={k}" for n in sizes for k in (1, 16)) + " |"
    print(header)
    print("|---|" + "---:|" * (len(sizes) * 2))
    for name, factory in ALLOCATORS.items():
        cells = []
        for n in sizes:
            for k in (1, 16):
                ops = args.ops // k
                rates = [bench_allocator(factory, n, k, ops, seed=r) for r in range(args.repeats)]
                cells.append(f"{statistics.median(rates) / 1e6:.2f} M")
        print(f"| {name} | " + " | ".join(cells) + " |")

    print("\n## Content hash of one 16-token block (ns, median)\n")
    for name, ns in bench_hash(args.repeats).items():
        print(f"- {name}: {ns:.0f} ns")

    print("\n## Simulated workload (KVCacheManager, 2048 blocks x 16 tokens, max 256 seqs)\n")
    for key, value in simulate().items():
        print(f"- {key}: {value:.4g}" if isinstance(value, float) else f"- {key}: {value}")


if __name__ == "__main__":
    main()
