"""PagedAttention memory table at real scale, no model needed: ``python -m batchgen.bench.memory``.

Simulates serving with the real :class:`~batchgen.engine.kv_cache.KVCacheManager` against contiguous KV
caches, at the scale of LLaMA-13B (40 layers, 40 KV heads, head dim 128, float16: 800 KiB of K+V per
token) on an 80 GB device after 26 GB of float16 weights, i.e. a 54 GB (54e9 bytes) KV budget =
65,917 token slots.

Systems (same byte budget for all):

* ``contiguous (max_model_len)``: every sequence reserves one contiguous ``max_model_len`` buffer at
  admission (HF static batches, FasterTransformer); n>1 samples each get their own buffer.
* ``contiguous (exact, first-fit)``: each sequence reserves exactly ``prompt + output`` tokens (an oracle
  that knows the output length, Orca-Oracle style) from a first-fit allocator over one address space.
* ``paged bs=B``: our block manager with block size B; prefix caching on unless noted; n>1 samples are
  forks sharing the prompt blocks (partial last block included, copy-on-write).

Scheduling (identical for all): FCFS admission each step of as many waiting requests as fit (at most
``--max-num-seqs`` sequences); paged admission keeps a 1% free-block watermark for growth; every running
sequence then stores one more token per step; when a paged sequence cannot grow, the most recently admitted
request is preempted (freed and re-queued first; n=1 resumes by recomputing prompt+generated, n>1 restarts).

Figures, time-averaged over the *memory-bound* steps (requests are waiting after admission):

* KV utilisation = live token slots ÷ reserved slots (physical slots: a shared slot counts once);
* fragmentation (% of the KV budget) = internal (reserved but not live) + external (free memory no waiting
  request can use: for contiguous caches every free byte while the head request does not fit, since
  running sequences never grow past their reservation; for paged only the budget's remainder below one
  block — any free block serves any sequence); "idle" is the free headroom paged sequences grow into;
* max concurrent requests (and sequences) at any step; steps to drain the workload;
* memory saved by sharing = 1 − physical live slots ÷ logical live tokens (prefix cache, forks).

Workloads (seeded, ``--seed``): **fixed**: 1024 prompt + 256 output tokens, max_model_len 2048 (LLaMA-13B);
**sharegpt**: prompt ~ lognormal(median 95, σ 1.0), output ~ lognormal(median 230, σ 0.85) (means ≈ 157
and 330 tokens, like ShareGPT's 161/338), clipped so prompt + output ≤ max_model_len 2048. Each has three
scenarios: *unique* prompts n=1; *prefix*: 4 templates (512 tokens for fixed, 256 system-prompt tokens for
sharegpt) + the request's own tokens, n=1; *fork*: unique prompts with n=4 samples (¼ as many requests).

``--out DIR`` writes ``memory.json`` and PNG charts (KV utilisation and running sequences over time);
``--small`` shrinks every length 8× and the budget 32× and uses fewer requests (smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from batchgen.engine.kv_cache import KVCacheManager

VOCAB = 32000
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE_BYTES = 40, 40, 128, 2  # LLaMA-13B, float16
KV_BYTES_PER_TOKEN = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V: 819,200 B
DEVICE_BYTES, WEIGHT_BYTES = 80e9, 26e9
KV_BUDGET_BYTES = DEVICE_BYTES - WEIGHT_BYTES
BLOCK_SIZES = (8, 16, 32, 64)
MAIN_BS = 16


@dataclass
class Request:
    rid: int
    prompt: list[int]
    output_len: int
    n: int = 1


@dataclass
class Seq:
    sid: int
    tokens: list[int]  # paged: every token; contiguous: only its length matters
    length: int
    reserved: int = 0
    offset: int = 0


@dataclass
class _Group:
    req: Request
    seqs: list[Seq]
    admitted_step: int
    generated: int = 0


# --------------------------------------------------------------------------------- KV caches


class PagedKV:
    """Our block manager: admission = allocate (+ forks), growth = append_slots, both with real hashing."""

    def __init__(self, capacity: int, block_size: int, caching: bool, watermark: float = 0.01, seed: int = 0):
        num_blocks = capacity // block_size
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.watermark = math.ceil(num_blocks * watermark)
        self.remainder = capacity - num_blocks * block_size
        self.rng = np.random.default_rng(seed)
        self._ids = 0

    def _sid(self) -> int:
        self._ids += 1
        return self._ids

    def admit(self, req: Request) -> list[Seq] | None:
        sid = self._sid()
        if self.mgr.allocate(sid, req.prompt, len(req.prompt), reserve_blocks=self.watermark) is None:
            return None
        self.mgr.cache_full_blocks(sid, req.prompt, len(req.prompt))
        seqs = [Seq(sid, list(req.prompt), len(req.prompt))]
        for _ in range(req.n - 1):
            child = self._sid()
            self.mgr.fork(sid, child)
            seqs.append(Seq(child, list(req.prompt), len(req.prompt)))
        return seqs

    def grow(self, seq: Seq) -> bool:
        n = seq.length + 1
        if self.mgr.append_slots(seq.sid, n) is None:
            return False
        seq.tokens.append(int(self.rng.integers(VOCAB)))
        seq.length = n
        self.mgr.cache_full_blocks(seq.sid, seq.tokens, n)
        return True

    def release(self, seq: Seq) -> None:
        self.mgr.free(seq.sid)

    def measure(self) -> tuple[int, int, int]:
        st = self.mgr.stats()
        return st.allocated_token_slots, st.live_token_slots, st.logical_tokens

    def external(self, head: Request | None) -> int:
        return self.remainder


class FixedContiguousKV:
    """One ``max_model_len`` buffer per sequence (no sharing; growth never needs memory)."""

    def __init__(self, capacity: int, max_model_len: int):
        self.capacity, self.M = capacity, max_model_len
        self.reserved = self.live = 0

    def admit(self, req: Request) -> list[Seq] | None:
        if self.reserved + req.n * self.M > self.capacity:
            return None
        self.reserved += req.n * self.M
        self.live += req.n * len(req.prompt)
        return [Seq(0, [], len(req.prompt), self.M) for _ in range(req.n)]

    def grow(self, seq: Seq) -> bool:
        assert seq.length < seq.reserved
        seq.length += 1
        self.live += 1
        return True

    def release(self, seq: Seq) -> None:
        self.reserved -= seq.reserved
        self.live -= seq.length

    def measure(self) -> tuple[int, int, int]:
        return self.reserved, self.live, self.live

    def external(self, head: Request | None) -> int:
        free = self.capacity - self.reserved
        return free if head is not None and head.n * self.M > free else 0


class FirstFitContiguousKV:
    """Exact ``prompt + output`` reservation per sequence from a first-fit list of free extents."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.starts: list[int] = [0]  # sorted free extents
        self.lengths: list[int] = [capacity]
        self.reserved = self.live = 0

    def _take(self, size: int) -> int | None:
        for i, length in enumerate(self.lengths):
            if length >= size:
                off = self.starts[i]
                if length == size:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += size
                    self.lengths[i] -= size
                return off
        return None

    def _give(self, off: int, size: int) -> None:
        i = bisect_left(self.starts, off)
        self.starts.insert(i, off)
        self.lengths.insert(i, size)
        if i + 1 < len(self.starts) and off + size == self.starts[i + 1]:  # merge right
            self.lengths[i] += self.lengths.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == off:  # merge left
            self.lengths[i - 1] += self.lengths.pop(i)
            self.starts.pop(i)

    def admit(self, req: Request) -> list[Seq] | None:
        size = len(req.prompt) + req.output_len
        seqs: list[Seq] = []
        for _ in range(req.n):
            off = self._take(size)
            if off is None:
                for s in seqs:
                    self._give(s.offset, s.reserved)
                return None
            seqs.append(Seq(0, [], len(req.prompt), size, off))
        self.reserved += size * req.n
        self.live += len(req.prompt) * req.n
        return seqs

    def grow(self, seq: Seq) -> bool:
        assert seq.length < seq.reserved
        seq.length += 1
        self.live += 1
        return True

    def release(self, seq: Seq) -> None:
        self._give(seq.offset, seq.reserved)
        self.reserved -= seq.reserved
        self.live -= seq.length

    def measure(self) -> tuple[int, int, int]:
        return self.reserved, self.live, self.live

    def external(self, head: Request | None) -> int:
        if head is None:
            return 0
        size = len(head.prompt) + head.output_len
        fits = sum(length // size for length in self.lengths)
        return self.capacity - self.reserved if fits < head.n else 0


# ------------------------------------------------------------------------------- simulation


@dataclass
class RunResult:
    workload: str
    scenario: str
    system: str
    block_size: int | None
    requests: int
    sequences: int
    steps: int
    memory_bound_steps: int
    kv_utilization: float
    internal_fragmentation: float
    external_fragmentation: float
    idle_free: float
    live_share: float
    sharing_saved: float
    max_concurrent_requests: int
    max_concurrent_seqs: int
    mean_concurrent_requests: float
    mean_concurrent_seqs: float
    preemptions: int
    cow_copies: int
    prefix_hit_rate: float
    wall_s: float
    series_utilization: list[float] = field(default_factory=list, repr=False)
    series_running_seqs: list[int] = field(default_factory=list, repr=False)

    @property
    def fragmentation(self) -> float:
        return self.internal_fragmentation + self.external_fragmentation


def simulate(
    kv, requests: list[Request], capacity: int, max_num_seqs: int, workload: str, scenario: str, system: str
) -> RunResult:
    """Run the workload to completion over one KV cache; see the module docstring for the policy."""
    t0 = time.perf_counter()
    waiting: deque[Request] = deque(requests)
    running: list[_Group] = []
    nseqs = step = preemptions = 0
    max_req = max_seq = 0
    sums = dict(R=0, L=0, Lg=0, X=0, n=0, seqs=0, reqs=0)
    s_util: list[float] = []
    s_run: list[int] = []
    all_sums = dict(R=0, L=0, Lg=0, X=0, n=0, seqs=0, reqs=0)
    while waiting or running:
        step += 1
        while waiting and nseqs + waiting[0].n <= max_num_seqs:
            seqs = kv.admit(waiting[0])
            if seqs is None:
                break
            running.append(_Group(waiting.popleft(), seqs, step))
            nseqs += len(seqs)
        if not running:
            raise RuntimeError(f"request {waiting[0].rid} can never fit in the KV cache")
        gi = 0
        while gi < len(running):
            g = running[gi]
            if g.admitted_step == step:  # this step was its prefill
                gi += 1
                continue
            preempted_self = False
            for seq in g.seqs:
                while not kv.grow(seq):
                    victim = running.pop()  # the most recently admitted request
                    for s in victim.seqs:
                        kv.release(s)
                    nseqs -= len(victim.seqs)
                    preemptions += 1
                    r = victim.req
                    if r.n == 1 and victim.generated:  # recompute: resume from prompt + generated
                        s = victim.seqs[0]
                        r = Request(r.rid, s.tokens[: s.length] or r.prompt, r.output_len - victim.generated)
                    waiting.appendleft(r)
                    if victim is g:
                        preempted_self = True
                        break
                if preempted_self:
                    break
            if not preempted_self:
                g.generated += 1
                gi += 1
        R, L, Lg = kv.measure()
        head = waiting[0] if waiting else None
        X = kv.external(head)
        max_req = max(max_req, len(running))
        max_seq = max(max_seq, nseqs)
        s_util.append(L / R if R else 1.0)
        s_run.append(nseqs)
        for acc in (all_sums, sums) if head is not None else (all_sums,):
            acc["R"] += R
            acc["L"] += L
            acc["Lg"] += Lg
            acc["X"] += X
            acc["n"] += 1
            acc["seqs"] += nseqs
            acc["reqs"] += len(running)
        done = [g for g in running if g.generated >= g.req.output_len]
        for g in done:
            for s in g.seqs:
                kv.release(s)
            nseqs -= len(g.seqs)
        if done:
            running = [g for g in running if g.generated < g.req.output_len]
    acc = sums if sums["n"] else all_sums
    cap = capacity * acc["n"]
    cow = hit = 0.0
    block_size = None
    if isinstance(kv, PagedKV):
        st = kv.mgr.stats()
        assert st.blocks_used == 0 and st.num_seqs == 0, "blocks leaked"
        cow, hit, block_size = st.num_cow_copies, st.prefix_hit_rate, kv.mgr.block_size
    return RunResult(
        workload=workload,
        scenario=scenario,
        system=system,
        block_size=block_size,
        requests=len(requests),
        sequences=sum(r.n for r in requests),
        steps=step,
        memory_bound_steps=sums["n"],
        kv_utilization=acc["L"] / acc["R"] if acc["R"] else 1.0,
        internal_fragmentation=(acc["R"] - acc["L"]) / cap,
        external_fragmentation=acc["X"] / cap,
        idle_free=(cap - acc["R"] - acc["X"]) / cap,
        live_share=acc["L"] / cap,
        sharing_saved=1.0 - acc["L"] / acc["Lg"] if acc["Lg"] else 0.0,
        max_concurrent_requests=max_req,
        max_concurrent_seqs=max_seq,
        mean_concurrent_requests=acc["reqs"] / acc["n"],
        mean_concurrent_seqs=acc["seqs"] / acc["n"],
        preemptions=preemptions,
        cow_copies=int(cow),
        prefix_hit_rate=hit,
        wall_s=time.perf_counter() - t0,
        series_utilization=s_util,
        series_running_seqs=s_run,
    )


# -------------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    description: str
    max_model_len: int
    scenarios: dict[str, list[Request]]


def _rand_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(VOCAB, size=n).tolist()


def fixed_workload(num_requests: int, scale: int, seed: int, max_model_len: int = 2048) -> Workload:
    prompt, output, mml = 1024 // scale, 256 // scale, max_model_len // scale
    rng = np.random.default_rng(seed)
    templates = [_rand_tokens(rng, prompt // 2) for _ in range(4)]
    unique = [Request(i, _rand_tokens(rng, prompt), output) for i in range(num_requests)]
    prefix = [
        Request(i, templates[i % 4] + _rand_tokens(rng, prompt - prompt // 2), output)
        for i in range(num_requests)
    ]
    fork = [Request(i, _rand_tokens(rng, prompt), output, n=4) for i in range(num_requests // 4)]
    desc = f"{prompt} prompt + {output} output tokens, max_model_len {mml}"
    return Workload("fixed", desc, mml, {"unique": unique, "prefix": prefix, "fork": fork})


def sharegpt_workload(num_requests: int, scale: int, seed: int, max_model_len: int = 2048) -> Workload:
    mml = max_model_len // scale
    rng = np.random.default_rng(seed + 1)
    system_len = 256 // scale

    def lengths(reserve: int) -> tuple[int, int]:
        p = int(np.clip(rng.lognormal(math.log(95 / scale), 1.0), 4, mml - reserve - 4))
        o = int(np.clip(rng.lognormal(math.log(230 / scale), 0.85), 4, mml - reserve - p))
        return p, o

    unique = []
    for i in range(num_requests):
        p, o = lengths(0)
        unique.append(Request(i, _rand_tokens(rng, p), o))
    templates = [_rand_tokens(rng, system_len) for _ in range(4)]
    prefix = []
    for i in range(num_requests):
        p, o = lengths(system_len)
        prefix.append(Request(i, templates[i % 4] + _rand_tokens(rng, p), o))
    fork = []
    for i in range(num_requests // 4):
        p, o = lengths(0)
        fork.append(Request(i, _rand_tokens(rng, p), o, n=4))
    mp = np.mean([len(r.prompt) for r in unique])
    mo = np.mean([r.output_len for r in unique])
    desc = (
        f"ShareGPT-like lognormal lengths (prompt median {95 // scale}, σ 1.0; output median {230 // scale}, "
        f"σ 0.85; sampled means {mp:.0f} / {mo:.0f}), max_model_len {mml}"
    )
    return Workload("sharegpt", desc, mml, {"unique": unique, "prefix": prefix, "fork": fork})


# ------------------------------------------------------------------------------------ driver


def run_workload(wl: Workload, capacity: int, max_num_seqs: int, seed: int) -> list[RunResult]:
    results: list[RunResult] = []

    def go(scenario: str, system: str, make: Callable[[], object]) -> None:
        results.append(
            simulate(make(), wl.scenarios[scenario], capacity, max_num_seqs, wl.name, scenario, system)
        )

    for scenario in ("unique", "prefix", "fork"):
        go(scenario, "contiguous (max_model_len)", lambda: FixedContiguousKV(capacity, wl.max_model_len))
        go(scenario, "contiguous (exact, first-fit)", lambda: FirstFitContiguousKV(capacity))
        for bs in BLOCK_SIZES:
            go(scenario, f"paged bs={bs}", lambda bs=bs: PagedKV(capacity, bs, caching=True, seed=seed))
        if scenario == "prefix":
            go(
                scenario,
                f"paged bs={MAIN_BS}, no prefix cache",
                lambda: PagedKV(capacity, MAIN_BS, False, seed=seed),
            )
    return results


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _mc(r: RunResult) -> str:
    return f"{r.mean_concurrent_requests:.1f} ({r.max_concurrent_requests})"


def _find(results: list[RunResult], scenario: str, system: str) -> RunResult:
    return next(r for r in results if r.scenario == scenario and r.system == system)


def render(wl: Workload, results: list[RunResult]) -> str:
    c = _find(results, "unique", "contiguous (max_model_len)")
    e = _find(results, "unique", "contiguous (exact, first-fit)")
    p = _find(results, "unique", f"paged bs={MAIN_BS}")
    pp = _find(results, "prefix", f"paged bs={MAIN_BS}")
    pn = _find(results, "prefix", f"paged bs={MAIN_BS}, no prefix cache")
    cp = _find(results, "prefix", "contiguous (max_model_len)")
    pf = _find(results, "fork", f"paged bs={MAIN_BS}")
    cf = _find(results, "fork", "contiguous (max_model_len)")
    ef = _find(results, "fork", "contiguous (exact, first-fit)")
    ep = _find(results, "prefix", "contiguous (exact, first-fit)")

    def frag(r: RunResult) -> str:
        return (
            f"{_pct(r.fragmentation)} ({_pct(r.internal_fragmentation)} + {_pct(r.external_fragmentation)})"
        )

    def conc(r: RunResult, base: RunResult) -> str:
        return (
            f"{r.max_concurrent_requests} ({r.max_concurrent_requests / base.max_concurrent_requests:.2f}×)"
        )

    def mconc(r: RunResult, base: RunResult) -> str:
        return f"{r.mean_concurrent_requests:.1f} ({r.mean_concurrent_requests / base.mean_concurrent_requests:.2f}×)"

    lines = [
        f"### Workload `{wl.name}`: {wl.description}",
        "",
        f"| figure | contiguous (max_model_len) | contiguous (exact, first-fit) | paged bs={MAIN_BS} (ours) |",
        "|---|---:|---:|---:|",
        f"| KV memory utilisation (live token slots ÷ reserved slots) | {_pct(c.kv_utilization)} "
        f"| {_pct(e.kv_utilization)} | {_pct(p.kv_utilization)} |",
        f"| max concurrent requests (× contiguous) | {conc(c, c)} | {conc(e, c)} | {conc(p, c)} |",
        f"| mean concurrent requests while memory-bound (× contiguous) | {mconc(c, c)} | {mconc(e, c)} "
        f"| {mconc(p, c)} |",
        f"| fragmentation, internal + external (% of KV memory) | {frag(c)} | {frag(e)} | {frag(p)} |",
        f"| memory saved by prefix sharing (4 templates) | 0% | 0% | {_pct(pp.sharing_saved)} |",
        f"| memory saved by forks (n=4) | 0% | 0% | {_pct(pf.sharing_saved)} |",
        f"| steps to drain the workload (unique) | {c.steps} | {e.steps} | {p.steps} |",
        f"| preemptions (unique) | {c.preemptions} | {e.preemptions} | {p.preemptions} |",
        "",
        "Sharing scenarios, mean concurrent requests while memory-bound (max in brackets): prefix — "
        f"contiguous {_mc(cp)}, exact {_mc(ep)}, paged without prefix cache {_mc(pn)}, paged with prefix cache "
        f"{_mc(pp)} (hit rate {_pct(pp.prefix_hit_rate)}); fork n=4 — contiguous {_mc(cf)}, exact {_mc(ef)}, "
        f"paged {_mc(pf)} ({pf.mean_concurrent_requests / cf.mean_concurrent_requests:.2f}× contiguous, "
        f"{pf.cow_copies} copy-on-write block copies).",
        "",
        "Block-size sweep (paged, prefix cache on):",
        "",
        "| block size | util. (unique) | internal frag. (unique) | mean conc. req. (unique) | preemptions (unique) "
        "| prefix hit rate (prefix) | saved by prefix sharing | mean conc. req. (prefix) | saved by forks "
        "| block-table entries per 1k tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for bs in BLOCK_SIZES:
        u = _find(results, "unique", f"paged bs={bs}")
        x = _find(results, "prefix", f"paged bs={bs}")
        f = _find(results, "fork", f"paged bs={bs}")
        lines.append(
            f"| {bs} | {_pct(u.kv_utilization)} | {_pct(u.internal_fragmentation)} | {u.mean_concurrent_requests:.1f} "
            f"| {u.preemptions} | {_pct(x.prefix_hit_rate)} | {_pct(x.sharing_saved)} | {x.mean_concurrent_requests:.1f} "
            f"| {_pct(f.sharing_saved)} | {1000 / bs:.1f} |"
        )
    return "\n".join(lines)


def targets(results: list[RunResult]) -> list[str]:
    """Check the issue's targets (paged bs=16 vs contiguous max_model_len) per workload."""
    out = []
    for wl in dict.fromkeys(r.workload for r in results):
        rs = [r for r in results if r.workload == wl]
        c = _find(rs, "unique", "contiguous (max_model_len)")
        p = _find(rs, "unique", f"paged bs={MAIN_BS}")
        ratio = p.mean_concurrent_requests / c.mean_concurrent_requests
        ratio_max = p.max_concurrent_requests / c.max_concurrent_requests
        out.append(
            f"- `{wl}`: utilisation {_pct(p.kv_utilization)} (target ≥ 96%: "
            f"{'met' if p.kv_utilization >= 0.96 else 'MISSED'}), fragmentation {_pct(p.fragmentation)} "
            f"(≤ 3%: {'met' if p.fragmentation <= 0.03 else 'MISSED'}), concurrency {ratio:.2f}× contiguous "
            f"(mean; max {ratio_max:.2f}×) (≥ 3×: {'met' if ratio >= 3 else 'MISSED'})"
        )
    return out


def plot(results: list[RunResult], out: Path, budget_note: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for wl in dict.fromkeys(r.workload for r in results):
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
        for system in ("contiguous (max_model_len)", "contiguous (exact, first-fit)", f"paged bs={MAIN_BS}"):
            r = _find([x for x in results if x.workload == wl], "unique", system)
            ax1.plot([100 * u for u in r.series_utilization], label=system, lw=1)
            ax2.plot(r.series_running_seqs, label=system, lw=1)
        r = _find([x for x in results if x.workload == wl], "prefix", f"paged bs={MAIN_BS}")
        ax2.plot(
            r.series_running_seqs,
            label=f"paged bs={MAIN_BS} + prefix sharing (prefix scenario)",
            lw=1,
            ls="--",
        )
        ax1.set_ylabel("KV utilisation (%)\nlive ÷ reserved slots")
        ax1.set_ylim(0, 105)
        ax2.set_ylabel("running sequences")
        ax2.set_xlabel("step (one token per running sequence)")
        ax1.set_title(
            f"LLaMA-13B KV cache, {KV_BUDGET_BYTES / 1e9:.0f} GB budget{budget_note} — workload '{wl}'"
        )
        ax1.legend(fontsize=8, loc="lower right")
        ax2.legend(fontsize=8, loc="upper right")
        fig.tight_layout()
        path = out / f"memory_{wl}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> list[RunResult]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write memory.json and PNG charts here")
    ap.add_argument(
        "--small", action="store_true", help="8x shorter lengths, 32x smaller budget, few requests"
    )
    ap.add_argument("--max-model-len", type=int, default=2048, help="contiguous reservation / length cap")
    ap.add_argument("--workloads", default="fixed,sharegpt", help="comma-separated: fixed, sharegpt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="sequence cap (default: memory-bound)")
    ap.add_argument("--requests", type=int, default=None, help="requests per scenario (default 400 / 1000)")
    args = ap.parse_args(argv)

    scale = 8 if args.small else 1
    capacity = int(KV_BUDGET_BYTES // KV_BYTES_PER_TOKEN) // (32 if args.small else 1)
    n_fixed = args.requests or (48 if args.small else 400)
    n_share = args.requests or (160 if args.small else 1000)
    print(
        f"LLaMA-13B KV: {KV_BYTES_PER_TOKEN:,} B/token (2 × {NUM_LAYERS} layers × {NUM_KV_HEADS} heads × "
        f"{HEAD_DIM} × {DTYPE_BYTES} B); {DEVICE_BYTES / 1e9:.0f} GB device − {WEIGHT_BYTES / 1e9:.0f} GB weights "
        f"= {KV_BUDGET_BYTES / 1e9:.0f} GB KV budget = {capacity:,} token slots"
        + (" (÷32: --small)" if args.small else "")
        + f"; seed {args.seed}; max_num_seqs {args.max_num_seqs}\n"
    )
    results: list[RunResult] = []
    makers = {
        "fixed": lambda: fixed_workload(n_fixed, scale, args.seed, args.max_model_len),
        "sharegpt": lambda: sharegpt_workload(n_share, scale, args.seed, args.max_model_len),
    }
    for name in args.workloads.split(","):
        if name not in makers:
            ap.error(f"unknown workload {name!r}: choose from {', '.join(makers)}")
        wl = makers[name]()
        rs = run_workload(wl, capacity, args.max_num_seqs, args.seed)
        results.extend(rs)
        print(render(wl, rs))
        print()
    print("Targets (paged bs=16 vs contiguous max_model_len, unique prompts):")
    print("\n".join(targets(results)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "config": {
                "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
                "device_bytes": DEVICE_BYTES,
                "weight_bytes": WEIGHT_BYTES,
                "kv_budget_bytes": KV_BUDGET_BYTES,
                "capacity_token_slots": capacity,
                "small": args.small,
                "seed": args.seed,
                "max_num_seqs": args.max_num_seqs,
                "max_model_len": args.max_model_len,
            },
            "results": [
                {
                    **{k: v for k, v in asdict(r).items() if not k.startswith("series")},
                    "fragmentation": r.fragmentation,
                }
                for r in results
            ],
            "series": [
                {
                    "workload": r.workload,
                    "scenario": r.scenario,
                    "system": r.system,
                    "kv_utilization": r.series_utilization,
                    "running_seqs": r.series_running_seqs,
                }
                for r in results
                if r.scenario == "unique"
                and r.system in ("contiguous (max_model_len)", f"paged bs={MAIN_BS}")
            ],
        }
        (args.out / "memory.json").write_text(json.dumps(payload, indent=1))
        paths = plot(results, args.out, " ÷32 (--small)" if args.small else "")
        print(f"\nwrote {args.out / 'memory.json'}, " + ", ".join(str(p) for p in paths))
    return results


if __name__ == "__main__":
    main()
