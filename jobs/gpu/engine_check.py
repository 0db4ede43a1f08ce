"""GPU check of the whole engine (run by jobs/gpu/check.sh on a CUDA machine; prints figures for BENCHMARKS.md).

1. Greedy equality on CUDA, float32: our engine with the Triton backend vs the torch backend vs transformers.
2. Memory sizing: a profiling forward at the full token budget, then the pool from gpu_memory_utilization.
3. Throughput, bfloat16: shared-prefix and unique workloads, batchgen (Triton) vs transformers `generate`
   with left-padded static batches, same prompts, same number of generated tokens.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

import torch


def log(msg: str) -> None:
    print(msg, flush=True)


def main() -> int:
    from transformers import AutoModelForCausalLM

    from batchgen import LLM, SamplingParams
    from batchgen.models.tiny import build_checkpoint

    smoke = "--cpu-smoke" in sys.argv  # a quick run of the same code on CPU, to check the script itself
    dev = "cpu" if smoke else "cuda"
    if not smoke:
        assert torch.cuda.is_available(), "needs CUDA"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results: dict = {"device": "cpu" if smoke else torch.cuda.get_device_name(0)}

    def sync() -> None:
        if not smoke:
            torch.cuda.synchronize()

    tmp = tempfile.mkdtemp()
    rng = random.Random(0)

    # 1. correctness on CUDA (float32) ---------------------------------------------------------------
    small = build_checkpoint(
        f"{tmp}/small", "qwen3", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2
    )
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (1, 15, 16, 17, 100, 300)]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    outs = {}
    for backend in ("torch",) if smoke else ("triton", "torch"):
        llm = LLM(small, dtype="float32", attention_backend=backend, num_blocks=512, device=dev)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        del llm
    outs.setdefault("triton", outs["torch"])
    hf = AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).to(dev)
    ref = []
    for p in prompts:
        g = hf.generate(torch.tensor([p], device=dev), max_new_tokens=32, do_sample=False)
        ref.append(g[0, len(p) :].tolist())
    del hf
    mism_tt = sum(a != b for a, b in zip(outs["triton"], outs["torch"]))
    mism_hf = sum(a != b for a, b in zip(outs["triton"], ref))
    results["greedy_mismatches_triton_vs_torch"] = mism_tt
    results["greedy_mismatches_triton_vs_hf"] = mism_hf
    log(f"[correctness] triton vs torch mismatching prompts: {mism_tt}/{len(prompts)}; vs HF: {mism_hf}")

    # 2 + 3. throughput, bf16 -------------------------------------------------------------------------
    big = build_checkpoint(
        f"{tmp}/big",
        "llama",
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        vocab_size=4096,
        dtype=torch.bfloat16,
        max_position_embeddings=4096,
    )
    rows = int(os.environ.get("GPU_BENCH_ROWS", "8" if smoke else "512"))
    new_tokens = int(os.environ.get("GPU_BENCH_TOKENS", "4" if smoke else "128"))
    templates = [[rng.randrange(5, 4096) for _ in range(300)] for _ in range(4)]
    workloads = {
        "shared-prefix": [
            templates[i % 4] + [rng.randrange(5, 4096) for _ in range(30)] for i in range(rows)
        ],
        "unique": [[rng.randrange(5, 4096) for _ in range(rng.randint(50, 600))] for _ in range(rows)],
    }
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    sizing = {"num_blocks": 4096, "device": "cpu"} if smoke else {"gpu_memory_utilization": 0.85}
    llm = LLM(big, dtype="bfloat16", max_num_seqs=512, max_num_batched_tokens=16384, **sizing)
    results["engine_init_s"] = time.perf_counter() - t0
    results["num_blocks"] = llm.engine.stats.num_blocks
    log(
        f"[sizing] {llm.engine.stats.num_blocks} KV blocks from gpu_memory_utilization=0.85 "
        f"(init {results['engine_init_s']:.1f}s)"
    )
    llm.generate(workloads["unique"][:8], sp, use_tqdm=False)  # warm-up (Triton compile)
    hf = AutoModelForCausalLM.from_pretrained(big, dtype=torch.bfloat16).to(dev)
    for name, wl in workloads.items():
        wl_sorted = sorted(wl)  # what the job's grouper does
        sync()
        t = time.perf_counter()
        outs = llm.generate(wl_sorted, sp, use_tqdm=False)
        sync()
        ours = time.perf_counter() - t
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        sync()
        t = time.perf_counter()
        hf_gen = 0
        bsz = 64
        for s in range(0, len(wl), bsz):
            batch = wl[s : s + bsz]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=dev)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
            g = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            hf_gen += (g.shape[1] - width) * len(batch)
        sync()
        theirs = time.perf_counter() - t
        r = {
            "rows": len(wl),
            "new_tokens": new_tokens,
            "batchgen_gen_tok_s": gen / ours,
            "hf_generate_bs64_gen_tok_s": hf_gen / theirs,
            "ratio": (gen / ours) / (hf_gen / theirs),
            "batchgen_wall_s": ours,
            "hf_wall_s": theirs,
            "prefix_hit_rate": llm.engine.stats.prefix_hit_rate,
        }
        results[name] = r
        log(
            f"[throughput {name}] batchgen {r['batchgen_gen_tok_s']:.0f} gen tok/s vs HF generate(bs=64) "
            f"{r['hf_generate_bs64_gen_tok_s']:.0f} -> {r['ratio']:.2f}x"
        )
    results["peak_memory_gib"] = 0.0 if smoke else torch.cuda.max_memory_allocated() / 2**30
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "engine_check.json"), "w") as f:
        json.dump(results, f, indent=2)
    log(json.dumps(results, indent=2))
    return 0 if mism_tt == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
