"""PagedAttention memory table at real scale, no model needed: ``python -m batchgen.bench.memory``.

batchgen's figures come from the engine's real scheduler and KV cache manager driven with fake tokens
(:mod:`batchgen.bench.fake_runner`); the contiguous caches it is compared with are small analytical models of
other systems' allocation. The scale is LLaMA-13B's (:func:`batchgen.bench.common.llama_13b`: 40 layers, 40 KV
heads, head dim 128, float16: 800 KiB of K+V per token) on an 80 GB device after its float16 weights (13.0 B
parameters, 26 GB), i.e. a 54 GB KV budget, about 65,900 token slots.

Systems (same byte budget for all):

* ``contiguous (max_model_len)``: every sequence reserves one contiguous ``max_model_len`` buffer at
  admission (HF static batches, FasterTransformer); n>1 samples each get their own buffer.
* ``contiguous (exact, first-fit)``: each sequence reserves exactly ``prompt + output`` tokens (an oracle
  that knows the output length, Orca-Oracle style) from a first-fit allocator over one address space.
* ``paged bs=B`` (ours): batchgen's :class:`~batchgen.engine.sched.scheduler.Scheduler` over a pool of
  ``budget // B`` blocks of B tokens; prefix caching on unless noted; n>1 samples are forks sharing the prompt
  blocks (partial last block included, copy-on-write).

Scheduling: the contiguous models admit first-come-first-served as many waiting requests as fit (at most
``--max-num-seqs`` sequences) and then never need memory again. The paged system is whatever the scheduler
does (admission with its free-block watermark, preemption of the most recently admitted sequence, recompute);
its token budget (``--max-num-batched-tokens``, default: the whole pool) is set so that memory, not the budget,
limits admission, as in the models. In all systems a request's prefill step samples its first token and every
later step one more per sequence; figures are read after each step.

Figures, time-averaged over the *memory-bound* steps (requests still waiting after the step):

* KV utilization = live token slots ÷ reserved slots (physical slots: a shared slot counts once);
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

``--out DIR`` writes ``memory.json`` and, with matplotlib, PNG charts (KV utilization and running sequences
over time); ``--small`` shrinks every length 8× and the budget 32× and uses fewer requests (smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from batchgen.bench import fake_runner
from batchgen.bench.common import kv_bytes_per_token, llama_13b, num_params, pyplot
from batchgen.bench.fake_runner import FakeRequest
from batchgen.engine.config import EngineConfig

MODEL = llama_13b()
VOCAB = MODEL.vocab_size
KV_BYTES_PER_TOKEN = kv_bytes_per_token(MODEL)  # K and V: 819,200 B
DEVICE_BYTES = 80e9
WEIGHT_BYTES = num_params(MODEL) * MODEL.dtype.itemsize
KV_BUDGET_BYTES = DEVICE_BYTES - WEIGHT_BYTES
BLOCK_SIZES = (8, 16, 32, 64)
MAIN_BS = 16
CONTIGUOUS = "contiguous (max_model_len)"
EXACT = "contiguous (exact, first-fit)"


# ------------------------------------------------------------------------- contiguous baselines
class FixedContiguousKV:
    """One ``max_model_len`` buffer per sequence (no sharing; growth never needs memory)."""

    def __init__(self, capacity: int, max_model_len: int):
        self.capacity, self.M = capacity, max_model_len
        self.reserved = 0

    def admit(self, req: FakeRequest) -> list[tuple[int, int]] | None:
        if self.reserved + req.n * self.M > self.capacity:
            return None
        self.reserved += req.n * self.M
        return [(0, self.M)] * req.n

    def release(self, extent: tuple[int, int]) -> None:
        self.reserved -= extent[1]

    def external(self, head: FakeRequest | None) -> int:
        free = self.capacity - self.reserved
        return free if head is not None and head.n * self.M > free else 0


class FirstFitContiguousKV:
    """Exact ``prompt + output`` reservation per sequence from a first-fit list of free extents."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.starts: list[int] = [0]  # sorted free extents
        self.lengths: list[int] = [capacity]
        self.reserved = 0

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

    def admit(self, req: FakeRequest) -> list[tuple[int, int]] | None:
        size = len(req.prompt) + req.max_tokens
        extents: list[tuple[int, int]] = []
        for _ in range(req.n):
            off = self._take(size)
            if off is None:
                for e in extents:
                    self._give(*e)
                return None
            extents.append((off, size))
        self.reserved += size * req.n
        return extents

    def release(self, extent: tuple[int, int]) -> None:
        self._give(*extent)
        self.reserved -= extent[1]

    def external(self, head: FakeRequest | None) -> int:
        if head is None:
            return 0
        size = len(head.prompt) + head.max_tokens
        fits = sum(length // size for length in self.lengths)
        return self.capacity - self.reserved if fits < head.n else 0


# ---------------------------------------------------------------------------------------- results
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


# One step's state: reserved slots R, live slots L, logical tokens Lg, external X, running sequences and
# requests, and whether requests are still waiting (a memory-bound step).
Sample = tuple[int, int, int, int, int, int, bool]


def summarize(
    samples: Iterable[Sample],
    capacity: int,
    requests: list[FakeRequest],
    t0: float,
    *,
    block_size: int | None,
    preemptions: int = 0,
    cow_copies: int = 0,
    prefix_hit_rate: float = 0.0,
    **names: str,
) -> RunResult:
    """Time-average the per-step samples (over memory-bound steps when there are any) of a run of
    ``requests`` started at ``t0`` (``time.perf_counter``); preemptions, copies and hits default to none."""
    wall_s = time.perf_counter() - t0
    samples = list(samples)
    bound = [s for s in samples if s[6]] or samples
    n = len(bound)
    R, L, Lg, X, seqs, reqs = (sum(s[i] for s in bound) for i in range(6))
    cap = capacity * n
    return RunResult(
        steps=len(samples),
        memory_bound_steps=sum(1 for s in samples if s[6]),
        kv_utilization=L / R if R else 1.0,
        internal_fragmentation=(R - L) / cap,
        external_fragmentation=X / cap,
        idle_free=(cap - R - X) / cap,
        live_share=L / cap,
        sharing_saved=1.0 - L / Lg if Lg else 0.0,
        max_concurrent_requests=max(s[5] for s in samples),
        max_concurrent_seqs=max(s[4] for s in samples),
        mean_concurrent_requests=reqs / n,
        mean_concurrent_seqs=seqs / n,
        series_utilization=[s[1] / s[0] if s[0] else 1.0 for s in samples],
        series_running_seqs=[s[4] for s in samples],
        requests=len(requests),
        sequences=sum(r.n for r in requests),
        block_size=block_size,
        preemptions=preemptions,
        cow_copies=cow_copies,
        prefix_hit_rate=prefix_hit_rate,
        wall_s=wall_s,
        **names,  # type: ignore[arg-type]
    )


def run_contiguous(
    kv, requests: list[FakeRequest], capacity: int, max_num_seqs: int, **names: str
) -> RunResult:
    """A contiguous cache under FCFS admission; every step samples one token per running sequence."""
    t0 = time.perf_counter()
    waiting: deque[FakeRequest] = deque(requests)
    running: list[list] = []  # [request, extents, tokens sampled]
    nseqs = 0
    samples: list[Sample] = []
    while waiting or running:
        while waiting and nseqs + waiting[0].n <= max_num_seqs:
            extents = kv.admit(waiting[0])
            if extents is None:
                break
            running.append([waiting.popleft(), extents, 0])
            nseqs += len(extents)
        if not running:
            raise RuntimeError(f"a request of {len(waiting[0].prompt)} prompt tokens can never fit")
        for g in running:
            g[2] += 1
        for g in [g for g in running if g[2] >= g[0].max_tokens]:
            for e in g[1]:
                kv.release(e)
            nseqs -= len(g[1])
        running = [g for g in running if g[2] < g[0].max_tokens]
        # the token sampled in this step gets its KV slot in the next one (as in the engine)
        live = sum(g[0].n * (len(g[0].prompt) + g[2] - 1) for g in running)
        head = waiting[0] if waiting else None
        samples.append((kv.reserved, live, live, kv.external(head), nseqs, len(running), head is not None))
    return summarize(samples, capacity, requests, t0, block_size=None, **names)


def engine_config(capacity: int, block_size: int, caching: bool, max_num_seqs: int, budget: int | None):
    """The EngineConfig of a paged run: the budget's whole blocks; the token budget defaults to the pool."""
    return EngineConfig(
        block_size=block_size,
        num_blocks=capacity // block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget or capacity,
        enable_prefix_caching=caching,
    )


def run_paged(
    config: EngineConfig,
    requests: list[FakeRequest],
    capacity: int,
    seed: int,
    max_model_len: int,
    **names: str,
) -> RunResult:
    """batchgen: the real scheduler over ``config.num_blocks`` blocks, fake tokens (see fake_runner)."""
    t0 = time.perf_counter()
    run = fake_runner.run(requests, config, max_model_len=max_model_len, seed=seed, vocab_size=VOCAB)
    bs = config.block_size
    remainder = capacity - config.num_blocks * bs  # below one block: no sequence can use it
    samples = [
        (
            s.blocks_used * bs,
            s.live_token_slots,
            s.logical_tokens,
            remainder,
            s.running_seqs,
            s.running_requests,
            s.waiting_seqs > 0,
        )
        for s in run.steps
    ]
    st = run.stats
    return summarize(
        samples, capacity, requests, t0, block_size=bs, preemptions=st.num_preemptions,
        cow_copies=st.num_cow_copies, prefix_hit_rate=st.prefix_hit_rate, **names,
    )  # fmt: skip


# -------------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    description: str
    max_model_len: int
    scenarios: dict[str, list[FakeRequest]]


def _rand_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(VOCAB, size=n).tolist()


def fixed_workload(num_requests: int, scale: int, seed: int, max_model_len: int = 2048) -> Workload:
    prompt, output, mml = 1024 // scale, 256 // scale, max_model_len // scale
    rng = np.random.default_rng(seed)
    templates = [_rand_tokens(rng, prompt // 2) for _ in range(4)]
    unique = [FakeRequest(_rand_tokens(rng, prompt), output) for _ in range(num_requests)]
    prefix = [
        FakeRequest(templates[i % 4] + _rand_tokens(rng, prompt - prompt // 2), output)
        for i in range(num_requests)
    ]
    fork = [FakeRequest(_rand_tokens(rng, prompt), output, n=4) for _ in range(num_requests // 4)]
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
    for _ in range(num_requests):
        p, o = lengths(0)
        unique.append(FakeRequest(_rand_tokens(rng, p), o))
    templates = [_rand_tokens(rng, system_len) for _ in range(4)]
    prefix = []
    for i in range(num_requests):
        p, o = lengths(system_len)
        prefix.append(FakeRequest(templates[i % 4] + _rand_tokens(rng, p), o))
    fork = []
    for _ in range(num_requests // 4):
        p, o = lengths(0)
        fork.append(FakeRequest(_rand_tokens(rng, p), o, n=4))
    mp = np.mean([len(r.prompt) for r in unique])
    mo = np.mean([r.max_tokens for r in unique])
    desc = (
        f"ShareGPT-like lognormal lengths (prompt median {95 // scale}, σ 1.0; output median {230 // scale}, "
        f"σ 0.85; sampled means {mp:.0f} / {mo:.0f}), max_model_len {mml}"
    )
    return Workload("sharegpt", desc, mml, {"unique": unique, "prefix": prefix, "fork": fork})


# ------------------------------------------------------------------------------------ driver


def run_workload(
    wl: Workload, capacity: int, max_num_seqs: int, seed: int, budget: int | None = None
) -> list[RunResult]:
    results: list[RunResult] = []
    for scenario in ("unique", "prefix", "fork"):
        reqs = wl.scenarios[scenario]
        names = dict(workload=wl.name, scenario=scenario)
        fixed = FixedContiguousKV(capacity, wl.max_model_len)
        results.append(run_contiguous(fixed, reqs, capacity, max_num_seqs, system=CONTIGUOUS, **names))
        exact = FirstFitContiguousKV(capacity)
        results.append(run_contiguous(exact, reqs, capacity, max_num_seqs, system=EXACT, **names))
        paged = [(bs, True, f"paged bs={bs}") for bs in BLOCK_SIZES]
        if scenario == "prefix":
            paged.append((MAIN_BS, False, f"paged bs={MAIN_BS}, no prefix cache"))
        for bs, caching, system in paged:
            cfg = engine_config(capacity, bs, caching, max_num_seqs, budget)
            results.append(run_paged(cfg, reqs, capacity, seed, wl.max_model_len, system=system, **names))
    return results


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _mc(r: RunResult) -> str:
    return f"{r.mean_concurrent_requests:.1f} ({r.max_concurrent_requests})"


def _find(results: list[RunResult], scenario: str, system: str) -> RunResult:
    return next(r for r in results if r.scenario == scenario and r.system == system)


def _frag(r: RunResult) -> str:
    return f"{_pct(r.fragmentation)} ({_pct(r.internal_fragmentation)} + {_pct(r.external_fragmentation)})"


def _conc(r: RunResult, base: RunResult) -> str:
    return f"{r.max_concurrent_requests} ({r.max_concurrent_requests / base.max_concurrent_requests:.2f}×)"


def _mconc(r: RunResult, base: RunResult) -> str:
    return f"{r.mean_concurrent_requests:.1f} ({r.mean_concurrent_requests / base.mean_concurrent_requests:.2f}×)"


def render(wl: Workload, results: list[RunResult]) -> str:
    c = _find(results, "unique", CONTIGUOUS)
    e = _find(results, "unique", EXACT)
    p = _find(results, "unique", f"paged bs={MAIN_BS}")
    pp = _find(results, "prefix", f"paged bs={MAIN_BS}")
    pn = _find(results, "prefix", f"paged bs={MAIN_BS}, no prefix cache")
    cp = _find(results, "prefix", CONTIGUOUS)
    pf = _find(results, "fork", f"paged bs={MAIN_BS}")
    cf = _find(results, "fork", CONTIGUOUS)
    ef = _find(results, "fork", EXACT)
    ep = _find(results, "prefix", EXACT)

    lines = [
        f"### Workload `{wl.name}`: {wl.description}",
        "",
        f"| figure | contiguous (max_model_len) | contiguous (exact, first-fit) | paged bs={MAIN_BS} (ours) |",
        "|---|---:|---:|---:|",
        f"| KV memory utilization (live token slots ÷ reserved slots) | {_pct(c.kv_utilization)} "
        f"| {_pct(e.kv_utilization)} | {_pct(p.kv_utilization)} |",
        f"| max concurrent requests (× contiguous) | {_conc(c, c)} | {_conc(e, c)} | {_conc(p, c)} |",
        f"| mean concurrent requests while memory-bound (× contiguous) | {_mconc(c, c)} | {_mconc(e, c)} "
        f"| {_mconc(p, c)} |",
        f"| fragmentation, internal + external (% of KV memory) | {_frag(c)} | {_frag(e)} | {_frag(p)} |",
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
    lines += [_sweep_row(results, bs) for bs in BLOCK_SIZES]
    return "\n".join(lines)


def _sweep_row(results: list[RunResult], bs: int) -> str:
    """The block-size sweep's row for block size `bs`."""
    u = _find(results, "unique", f"paged bs={bs}")
    x = _find(results, "prefix", f"paged bs={bs}")
    f = _find(results, "fork", f"paged bs={bs}")
    return (
        f"| {bs} | {_pct(u.kv_utilization)} | {_pct(u.internal_fragmentation)} | {u.mean_concurrent_requests:.1f} "
        f"| {u.preemptions} | {_pct(x.prefix_hit_rate)} | {_pct(x.sharing_saved)} | {x.mean_concurrent_requests:.1f} "
        f"| {_pct(f.sharing_saved)} | {1000 / bs:.1f} |"
    )


def targets(results: list[RunResult]) -> list[str]:
    """Check the issue's targets (paged bs=16 vs contiguous max_model_len) per workload."""
    out = []
    for wl in dict.fromkeys(r.workload for r in results):
        rs = [r for r in results if r.workload == wl]
        c = _find(rs, "unique", CONTIGUOUS)
        p = _find(rs, "unique", f"paged bs={MAIN_BS}")
        ratio = p.mean_concurrent_requests / c.mean_concurrent_requests
        ratio_max = p.max_concurrent_requests / c.max_concurrent_requests
        out.append(
            f"- `{wl}`: utilization {_pct(p.kv_utilization)} (target ≥ 96%: "
            f"{'met' if p.kv_utilization >= 0.96 else 'MISSED'}), fragmentation {_pct(p.fragmentation)} "
            f"(≤ 3%: {'met' if p.fragmentation <= 0.03 else 'MISSED'}), concurrency {ratio:.2f}× contiguous "
            f"(mean; max {ratio_max:.2f}×) (≥ 3×: {'met' if ratio >= 3 else 'MISSED'})"
        )
    return out


def plot(results: list[RunResult], out: Path, budget_note: str = "") -> list[Path]:
    """memory_<workload>.png: KV utilization and running sequences over time (none without matplotlib)."""
    plt = pyplot()
    paths: list[Path] = []
    if plt is None:
        return paths
    for wl in dict.fromkeys(r.workload for r in results):
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
        for system in (CONTIGUOUS, EXACT, f"paged bs={MAIN_BS}"):
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
        ax1.set_ylabel("KV utilization (%)\nlive ÷ reserved slots")
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


def _parser() -> argparse.ArgumentParser:
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
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the paged scheduler's token budget per step (default: the whole pool, so memory is the limit)",
    )
    return ap


def _payload(args: argparse.Namespace, capacity: int, results: list[RunResult]) -> dict[str, object]:
    """memory.json: the run's settings, every result's figures, and the unique scenario's series of the
    contiguous and main paged systems."""
    return {
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
            "max_num_batched_tokens": args.max_num_batched_tokens,
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
            if r.scenario == "unique" and r.system in (CONTIGUOUS, f"paged bs={MAIN_BS}")
        ],
    }


def main(argv: list[str] | None = None) -> list[RunResult]:
    ap = _parser()
    args = ap.parse_args(argv)

    scale = 8 if args.small else 1
    capacity = int(KV_BUDGET_BYTES // KV_BYTES_PER_TOKEN) // (32 if args.small else 1)
    n_fixed = args.requests or (48 if args.small else 400)
    n_share = args.requests or (160 if args.small else 1000)
    print(
        f"LLaMA-13B KV: {KV_BYTES_PER_TOKEN:,} B/token (2 × {MODEL.num_layers} layers × {MODEL.num_kv_heads} "
        f"heads × {MODEL.head_dim} × {MODEL.dtype.itemsize} B); {DEVICE_BYTES / 1e9:.0f} GB device − "
        f"{WEIGHT_BYTES / 1e9:.1f} GB weights = {KV_BUDGET_BYTES / 1e9:.1f} GB KV budget = {capacity:,} token "
        "slots" + (" (÷32: --small)" if args.small else "") + f"; seed {args.seed}; max_num_seqs "
        f"{args.max_num_seqs}; paged token budget {args.max_num_batched_tokens or 'the whole pool'}\n"
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
        rs = run_workload(wl, capacity, args.max_num_seqs, args.seed, args.max_num_batched_tokens)
        results.extend(rs)
        print(render(wl, rs))
        print()
    print("Targets (paged bs=16 vs contiguous max_model_len, unique prompts):")
    print("\n".join(targets(results)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = _payload(args, capacity, results)
        (args.out / "memory.json").write_text(json.dumps(payload, indent=1))
        paths = plot(results, args.out, " ÷32 (--small)" if args.small else "")
        print(f"\nwrote {args.out / 'memory.json'}" + "".join(f", {p}" for p in paths))
    return results


if __name__ == "__main__":
    main()
