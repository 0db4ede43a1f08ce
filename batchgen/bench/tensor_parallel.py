"""Tensor parallelism: communication volume from model shapes, and the measured step time over TP ranks.

    python -m batchgen.bench.tensor_parallel                  # CPU (gloo): TP 1 vs 2 on a small Llama
    python -m batchgen.bench.tensor_parallel --tp 1 2 4 8 --device cuda --model /ckpt/llama-3.1-70b

**Volume** (no measurement: arithmetic over `config.json` facts). Per token, each decoder layer all-reduces
its attention output and its MLP output (`2 × hidden` values), and the vocabulary-parallel embedding one
more `hidden` (at the first layer); each sampled token also gathers its logits (`vocab` values, of which
rank 0 receives the other ranks' `(tp - 1) / tp`). A ring all-reduce of `S` bytes sends `2 × (tp-1)/tp × S`
bytes per rank. Printed for the 70B-class models the feature exists for and for `--model` when given.

**Measured**: greedy decoding of `--seqs` sequences × `--tokens` tokens (ignore_eos) on one engine per TP size,
mean milliseconds per decode-only step after a warm-up (the step time the engine reports to step listeners),
and tokens per second. On the CPU the ranks share the machine's cores, so this shows gloo's per-step overhead,
not a speed-up; the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

# (name, hidden, layers, vocab) of the models the issue names (from their config.json).
MODELS = [
    ("Llama-3.1-70B", 8192, 80, 128256),
    ("Qwen2.5-72B", 8192, 80, 152064),
    ("Mixtral-8x22B", 6144, 56, 32768),
]


@dataclass
class Volume:
    name: str
    allreduce_bytes: int  # payload all-reduced per token (all layers + embedding)
    ring_bytes_per_rank: float  # bytes each rank sends for it with a ring all-reduce
    logits_bytes: float  # bytes rank 0 receives per sampled token (logits gather)


def volume(name: str, hidden: int, layers: int, vocab: int, tp: int, dtype_bytes: int = 2) -> Volume:
    payload = (2 * layers + 1) * hidden * dtype_bytes
    return Volume(name, payload, 2 * (tp - 1) / tp * payload, (tp - 1) / tp * vocab * dtype_bytes)


def print_volumes(models: list[tuple[str, int, int, int]], tps: list[int]) -> None:
    print(
        "communication per token (bfloat16): all-reduce payload | ring bytes sent per rank | logits to rank 0"
    )
    for name, hidden, layers, vocab in models:
        for tp in tps:
            if tp == 1:
                continue
            v = volume(name, hidden, layers, vocab, tp)
            print(
                f"  {name:<16} TP={tp}: {v.allreduce_bytes / 2**20:6.2f} MiB all-reduced "
                f"({2 * layers + 1} × {hidden} × 2 B) | {v.ring_bytes_per_rank / 2**20:6.2f} MiB/rank | "
                f"{v.logits_bytes / 2**10:6.1f} KiB"
            )


def small_model() -> str:
    """A Llama small enough for the CPU but with real-sized collectives: hidden 512, 4 layers, 8 heads."""
    from batchgen.models.tiny import cached_checkpoint
    from batchgen.runtime.disk_cache import cache_root

    spec = dict(
        arch="llama", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024
    )
    return cached_checkpoint("bench-tp-llama-h512-l4", cache_root(), **spec)


def measure(model: str, tp: int, device: str, seqs: int, tokens: int) -> tuple[float, float]:
    """(mean ms per decode-only step, generated tokens per second) on one engine with `tp` ranks."""
    from batchgen import LLM, SamplingParams

    llm = LLM(model, device=device, tensor_parallel_size=tp, num_blocks=seqs * 64, max_num_seqs=seqs)
    steps: list[float] = []
    llm.engine.add_step_listener(
        lambda info: (
            steps.append(info.step_time_s) if info.num_batched_tokens == info.num_scheduled_seqs else None
        )
    )
    prompts = [[(7 * i + j) % 500 + 1 for j in range(16)] for i in range(seqs)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    del llm
    return statistics.mean(steps) * 1e3, seqs * tokens / wall


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: a small random Llama)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the worker ranks
    import torch

    torch.set_num_threads(args.threads)
    from batchgen.models.config import ModelConfig

    model = args.model or small_model()
    cfg = ModelConfig.from_pretrained(model)
    print_volumes([*MODELS, (os.path.basename(model.rstrip("/")), cfg.hidden_size, cfg.num_layers,
                             cfg.vocab_size)], args.tp)  # fmt: skip
    print(f"\nmeasured: {args.seqs} sequences × {args.tokens} tokens, greedy, {args.device}, "
          f"{args.threads} thread(s) per rank, load average {os.getloadavg()[0]:.2f} at start")  # fmt: skip
    base = None
    for tp in args.tp:
        ms, tps = measure(model, tp, args.device, args.seqs, args.tokens)
        base = base or ms
        print(f"  TP={tp}: {ms:7.2f} ms per decode step ({ms / base:4.2f}×), {tps:7.1f} tokens/s")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
