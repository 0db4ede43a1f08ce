"""Beam-search memory and recompute-vs-swap preemption, measured on the engine.

``python -m batchgen.bench.beam_swap [--quick] [--model tiny|bench|PATH] [--device cpu] [--out FILE.json]``

1. **Beam memory**: one beam request (``beam_width=k``, ``ignore_eos``) at a time; after every step, KV blocks in
   use against ``k x ceil(sequence length / block_size)``, the blocks ``k`` independent sequences would hold.
   Reported: that ratio at the last step and its peak over the run, and the same for ``n=k`` sampling (forks
   that share only the prompt) as a contrast.
2. **Recompute vs swap**: the same workload (long outputs; a pool that holds a few of the sequences) under
   ``engine.preemption_mode=recompute`` and ``swap``: wall and CPU time, generated tokens/s, preemptions,
   tokens run through the model (``tokens_computed``; ``recomputed`` = those beyond one pass over every
   prompt and output token) and blocks swapped out/in, with the time the swap copies took. Outputs are
   checked identical. On a shared machine compare ``cpu_seconds`` rather than wall time.

The model is a random-weight Llama: ``tiny`` (the embedded ~1.3M-parameter default) or ``bench`` (the
throughput benchmark's ~50M-parameter one), or a checkpoint path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass

import torch

from batchgen import LLM, SamplingParams

BS = 16


def _model(name: str) -> str:
    if name == "tiny":
        from batchgen.models.tiny import tiny_default_checkpoint

        return tiny_default_checkpoint()
    if name == "bench":
        from batchgen.bench.throughput import BenchModel, ensure_model

        return ensure_model(BenchModel())
    return os.path.expanduser(name)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(length)] for _ in range(n)]


# ----------------------------------------------------------------------------------------- beam memory
def beam_memory(path: str, k: int, prompt_len: int, max_tokens: int, n_sampling: bool = False) -> dict:
    llm = LLM(path, num_blocks=4096, block_size=BS, device="cpu")
    engine = llm.engine
    prompt = _prompts(1, prompt_len, seed=k)[0]
    if n_sampling:
        sp = SamplingParams(n=k, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    else:
        sp = SamplingParams(beam_width=k, n=k, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("r", prompt, sp)
    ratios: list[float] = []
    last = (0, 0)
    while engine.has_unfinished():
        engine.step()
        kv = engine.scheduler.kv.stats()
        if kv.num_seqs == k:
            seq_len = max(s.num_tokens for s in engine.scheduler.running_seqs())
            independent = k * -(-seq_len // BS)
            ratios.append(kv.blocks_used / independent)
            last = (kv.blocks_used, independent)
    return {
        "mode": f"n={k} sampling" if n_sampling else f"beam_width={k}",
        "prompt_tokens": prompt_len,
        "max_tokens": max_tokens,
        "blocks_used_last_step": last[0],
        "independent_blocks_last_step": last[1],
        "ratio_last_step": round(last[0] / last[1], 3),
        "ratio_peak": round(max(ratios), 3),
        "cow_copies": engine.stats.num_cow_copies,
    }


# ---------------------------------------------------------------------------------- recompute vs swap
@dataclass
class PreemptionWorkload:
    name: str
    num_requests: int
    prompt_len: int
    max_tokens: int
    num_blocks: int


def run_preemption(path: str, w: PreemptionWorkload, mode: str, device: str) -> tuple[dict, list]:
    prompts = _prompts(w.num_requests, w.prompt_len, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    llm = LLM(
        path,
        num_blocks=w.num_blocks,
        block_size=BS,
        device=device,
        preemption_mode=mode,
        swap_space="2GiB",
        max_num_seqs=64,
    )
    warm = _prompts(1, w.prompt_len, seed=99)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    engine = llm.engine
    computed = [0]
    engine.add_step_listener(lambda info: computed.__setitem__(0, computed[0] + info.num_batched_tokens))
    swap_time = [0.0]
    runner = engine.runner
    plain_moves = runner.apply_moves

    def timed_moves(moves):
        t = time.perf_counter()
        plain_moves(moves)
        if moves.swap_out or moves.swap_in:
            swap_time[0] += time.perf_counter() - t

    runner.apply_moves = timed_moves  # type: ignore[method-assign]
    before = engine.stats.snapshot()
    computed[0] = 0
    c0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = engine.stats.delta(before)
    once = w.num_requests * (w.prompt_len + w.max_tokens - 1)  # every token computed once (the last never)
    row = {
        "workload": w.name,
        "mode": mode,
        "seconds": round(dt, 2),
        "cpu_seconds": round(cpu, 2),
        "gen_tokens_per_s": round(st.generated_tokens / dt, 1),
        "preemptions": st.num_preemptions,
        "tokens_computed": computed[0],
        "recomputed": computed[0] - once,
        "swapped_out_blocks": st.num_swapped_out_blocks,
        "swapped_in_blocks": st.num_swapped_in_blocks,
        "swap_copy_seconds": round(swap_time[0], 3),
        "steps": st.num_steps,
    }
    return row, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, bench or a checkpoint path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = _model(args.model)

    results: dict[str, list] = {"beam_memory": [], "preemption": []}
    gen = 32 if args.quick else 128
    for k in (2, 4) if args.quick else (2, 4, 8):
        for prompt_len in (32, 256):
            results["beam_memory"].append(beam_memory(path, k, prompt_len, gen))
    results["beam_memory"].append(beam_memory(path, 4, 256, gen, n_sampling=True))
    for r in results["beam_memory"]:
        print(json.dumps(r))

    scale = 4 if args.quick else 1
    workloads = [
        # ~8 of the 16 sequences fit at full length (18 blocks each): many preemptions late in the run.
        PreemptionWorkload("long_outputs", 16, 32, 512 // scale, 160 // scale),
        # long prompts make recomputation expensive
        PreemptionWorkload("long_prompts", 16, 512 // scale, 256 // scale, 240 // scale),
    ]
    for w in workloads:
        tokens = {}
        for mode in ("recompute", "swap"):
            row, tokens[mode] = run_preemption(path, w, mode, args.device)
            results["preemption"].append(row)
            print(json.dumps(row))
        assert tokens["recompute"] == tokens["swap"], f"{w.name}: swap and recompute outputs differ"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
