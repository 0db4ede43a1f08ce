"""Engine overhead with a near-null model: ``python -m batchgen.bench.overhead``.

The model is a random Llama of one layer, hidden size 32 (built once into the batchgen cache with
:func:`batchgen.models.tiny.cached_checkpoint`), so the forward costs little and what remains is the engine's
own work per step. For each mix and each sequence cap ``N`` (``--seqs``, default 64, 256, 512) one
:class:`~batchgen.engine.core.llm_engine.LLMEngine` runs ``--warmup`` steps to reach a steady state, then
``--steps`` measured steps, while a feeder keeps requests waiting so the engine never drains:

* ``decode``: prompts of 16–48 tokens, 16–240 generated tokens: nearly every step is N decodes plus a few
  short prefills (token budget 4096).
* ``prefill``: prompts of 64–448 tokens, 1–8 generated tokens, token budget ``48 × N``: most tokens of a step
  are prefill chunks of newly admitted requests.

Every request is greedy with ``ignore_eos`` and no stop strings. Phases are timed from outside the engine by
wrapping, on this one engine instance, the calls its step makes (measurement only; the engine is not changed):

* schedule: ``engine.scheduler.schedule``;
* prepare inputs: ``engine.builder.prepare_inputs`` (flat tensors, slot mapping, block tables);
* forward: ``engine.runner.model.forward`` + ``compute_logits`` (the near-null model);
* sample rows: ``engine.builder.sampling_inputs`` (the sampler inputs built every step: per-row
  settings, and row objects only for rows with penalties, bans, logprobs or seeds);
* sampler: ``engine.runner.sample`` (penalties, filters, argmax or draw);
* update/stop: ``engine.scheduler.update`` (append tokens, stop rules, beam steps, free blocks);
* detokenize: ``engine._request_output`` (decode the finished requests' texts, build outputs);
* other: the rest of ``step()`` (copy-on-write copies, logits to float32, listeners).

Step time is the engine's own (``StepInfo.step_time_s`` from a step listener); with ``--repeats R`` each
configuration runs R times on a fresh engine and the run with the fastest mean step is shown (the least
disturbed by other work on a shared machine). Printed per configuration: mean
running sequences, scheduled sequences and tokens per step, milliseconds per step for each phase, and the time
outside the forward per sequence-step and per token. Timings are noisy on a shared machine; the load average
is printed beside them. On CUDA every timed call synchronizes first and last (so phases do not overlap).

``--async-scheduling`` runs the engine with ``engine.async_scheduling=true``: the forward and sampler then run
in a worker thread while the next step is scheduled and prepared, so the phases overlap and the step time
(one step completed per ``step()``) is the figure to compare; the phase columns are still each phase's own
time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PHASES = ("schedule", "prepare", "forward", "sample rows", "sampler", "update", "detokenize", "other")


@dataclass(frozen=True)
class Mix:
    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    budget_per_seq: int | None
    """Token budget = this × N (None: the engine default, 4096)."""


MIXES = {
    "decode": Mix("decode", (16, 48), (16, 240), None),
    "prefill": Mix("prefill", (64, 448), (1, 8), 48),
}


def overhead_model() -> str:
    """The near-null checkpoint: Llama, 1 layer, hidden 32, 2 heads / 1 KV head (built once, then cached)."""
    from batchgen.models.tiny import cached_checkpoint
    from batchgen.runtime.disk_cache import cache_root

    spec: dict[str, Any] = dict(
        arch="llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    return cached_checkpoint("bench-overhead-llama-h32-l1", cache_root(), **spec)


class PhaseTimer:
    """Timing wrappers installed as instance attributes of one engine's parts; totals per step."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.current: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)
        current, calls, sync, clock = self.current, self.calls, self.sync, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if sync is not None:
                sync()
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                current[phase] += clock() - t0
                calls[phase] += 1

        setattr(obj, attr, timed)

    def install(self, engine: Any) -> None:
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.builder, "prepare_inputs", "prepare")
        self.wrap(engine.runner.model, "forward", "forward")
        self.wrap(engine.runner.model, "compute_logits", "forward")
        self.wrap(engine.builder, "sampling_inputs", "sample rows")
        self.wrap(engine.runner, "sample", "sampler")
        self.wrap(engine.scheduler, "update", "update")
        self.wrap(engine, "_request_output", "detokenize")

    def take(self) -> dict[str, float]:
        out = dict(self.current)
        self.current.clear()
        return out


@dataclass
class Result:
    mix: str
    max_num_seqs: int
    max_num_batched_tokens: int
    steps: int
    running_seqs: float
    scheduled_seqs: float
    batched_tokens: float
    prefill_token_share: float
    step_ms: float
    phase_ms: dict[str, float]
    us_per_seq_step_outside_forward: float
    us_per_token_outside_forward: float
    loadavg: float


def _engine(mix: Mix, n: int, seed: int, device: str, model: str | None, overlap: bool = False) -> Any:
    """The engine of one configuration: N sequences, the mix's token budget, a pool that fits ~5N/4 of them."""
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.core.llm_engine import LLMEngine

    bs = 16
    per_seq = -(-(mix.prompt[1] + mix.output[1]) // bs)
    config = EngineConfig(
        block_size=bs,
        max_num_seqs=n,
        max_num_batched_tokens=mix.budget_per_seq * n if mix.budget_per_seq else 4096,
        num_blocks=n * per_seq * 5 // 4 + 64,
        device=device,
        seed=seed,
        async_scheduling=overlap,
    )
    return LLMEngine(model or overhead_model(), config, dtype="float32")


def _feeder(engine: Any, mix: Mix, n: int, seed: int, temperature: float = 0.0) -> Callable[[], None]:
    """A function keeping at least 2N requests in the engine (called outside the timed steps); requests
    sample at ``temperature`` (0: greedy) with the engine's generator."""
    from batchgen.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    next_id = 0

    def feed() -> None:
        nonlocal next_id
        while engine.num_unfinished() < 2 * n:
            prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(*mix.prompt))]
            max_tokens = rng.randint(*mix.output)
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(next_id, prompt, params)
            next_id += 1

    return feed


_Row = tuple[float, int, int, int, dict[str, float]]
"""One step: (step seconds, scheduled sequences, batched tokens, running sequences, phase seconds)."""


def _summarise(mix: Mix, n: int, budget: int, measured: list[_Row], decodes: list[int]) -> Result:
    total = sum(r[0] for r in measured)
    phase = {p: sum(r[4].get(p, 0.0) for r in measured) for p in PHASES[:-1]}
    phase["other"] = total - sum(phase.values())
    seq_steps = sum(r[1] for r in measured)
    tokens = sum(r[2] for r in measured)
    outside = total - phase["forward"]
    k = len(measured)
    return Result(
        mix=mix.name,
        max_num_seqs=n,
        max_num_batched_tokens=budget,
        steps=k,
        running_seqs=statistics.fmean(r[3] for r in measured),
        scheduled_seqs=seq_steps / k,
        batched_tokens=tokens / k,
        prefill_token_share=1.0 - sum(decodes) / tokens if tokens else 0.0,
        step_ms=total / k * 1e3,
        phase_ms={p: v / k * 1e3 for p, v in phase.items()},
        us_per_seq_step_outside_forward=outside / max(seq_steps, 1) * 1e6,
        us_per_token_outside_forward=outside / max(tokens, 1) * 1e6,
        loadavg=os.getloadavg()[0],
    )


def measure(
    mix: Mix,
    n: int,
    steps: int,
    warmup: int,
    seed: int = 0,
    device: str = "cpu",
    model: str | None = None,
    overlap: bool = False,
    temperature: float = 0.0,
) -> tuple[Result, dict[str, int]]:
    """One engine, one configuration; returns the figures and the number of timed calls per phase."""
    import torch

    engine = _engine(mix, n, seed, device, model, overlap)
    timer = PhaseTimer(torch.cuda.synchronize if engine.device.type == "cuda" else None)
    timer.install(engine)
    decodes: list[int] = []
    timed_schedule = engine.scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:  # also count the step's decodes (the rest: prefill)
        out = timed_schedule(*args, **kwargs)
        decodes.append(out.num_decodes)
        return out

    engine.scheduler.schedule = schedule
    rows: list[_Row] = []

    def on_step(info: Any) -> None:
        step = (info.step_time_s, info.num_scheduled_seqs, info.num_batched_tokens, info.stats.running_seqs)
        rows.append((*step, timer.take()))

    engine.add_step_listener(on_step)
    feed = _feeder(engine, mix, n, seed, temperature)
    for _ in range(warmup + steps):
        feed()
        engine.step()
    budget = engine.config.max_num_batched_tokens
    return _summarise(mix, n, budget, rows[warmup:], decodes[warmup:]), dict(timer.calls)


def render(results: list[Result]) -> str:
    head = (
        "| mix | max seqs | running | seqs/step | tokens/step | prefill share | step ms | "
        + " | ".join(PHASES)
        + " | µs/seq-step outside forward | µs/token outside forward | load |"
    )
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for r in results:
        lines.append(
            f"| {r.mix} | {r.max_num_seqs} | {r.running_seqs:.0f} | {r.scheduled_seqs:.0f} | "
            f"{r.batched_tokens:.0f} | {100 * r.prefill_token_share:.0f}% | {r.step_ms:.2f} | "
            + " | ".join(f"{r.phase_ms[p]:.2f}" for p in PHASES)
            + f" | {r.us_per_seq_step_outside_forward:.1f} | {r.us_per_token_outside_forward:.2f} | "
            f"{r.loadavg:.2f} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="64,256,512", help="comma-separated sequence caps N (max_num_seqs)")
    ap.add_argument("--mixes", default="decode,prefill", help=f"comma-separated: {', '.join(MIXES)}")
    ap.add_argument("--steps", type=int, default=50, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=30, help="steps run before measuring")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per configuration; the one with the fastest steps is shown",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--async-scheduling", action="store_true", help="engine.async_scheduling=true (overlapped steps)"
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="requests' temperature (0: greedy)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap


def main(argv: list[str] | None = None) -> list[Result]:
    ap = _parser()
    args = ap.parse_args(argv)

    import torch

    from batchgen.bench.common import machine_info

    torch.set_num_threads(args.threads)
    machine = machine_info()
    print(
        f"Machine: {machine['cpu']}, nproc={machine['nproc']}, torch {machine['torch']}, "
        f"threads={args.threads}, device {args.device}, async_scheduling={args.async_scheduling}, "
        f"temperature={args.temperature}; "
        f"load average at start {machine['loadavg'][0]:.2f}. "
        f"Model: Llama, 1 layer, hidden 32 (near-null). {args.warmup} warm-up + {args.steps} measured steps, "
        f"best of {args.repeats} run(s) per configuration; phases in ms per step.\n",
        flush=True,
    )
    model = overhead_model()
    results: list[Result] = []
    for mix_name in args.mixes.split(","):
        if mix_name not in MIXES:
            ap.error(f"unknown mix {mix_name!r}: choose from {', '.join(MIXES)}")
        for n in (int(x) for x in args.seqs.split(",")):
            runs = [
                measure(
                    MIXES[mix_name],
                    n,
                    args.steps,
                    args.warmup,
                    args.seed,
                    args.device,
                    model,
                    args.async_scheduling,
                    args.temperature,
                )[0]
                for _ in range(args.repeats)
            ]
            result = min(runs, key=lambda r: r.step_ms)
            results.append(result)
            print(f"  {mix_name} N={n}: {result.step_ms:.2f} ms/step", flush=True)
    print()
    print(render(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine, "args": vars(args) | {"json": str(args.json)}}
        payload["results"] = [asdict(r) for r in results]
        args.json.write_text(json.dumps(payload, indent=1))
    return results


if __name__ == "__main__":
    main()
