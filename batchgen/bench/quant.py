"""Quantized and half-precision weights, and narrow KV caches, side by side on one small random-weight llama:
weight bytes in memory per format and generated tokens per second at 4 and at 64 sequences (greedy, fixed
lengths), and llama.cpp (llama-cpp-python's batched decode) on the same GGUF files where it is installed.

    python -m batchgen.bench.quant [--hidden 512 --layers 4 --new 32 --prompt 32]

Each system runs the same prompts (token ids) in one process after a warm-up; the load (os.getloadavg) is printed
with the figures. Numbers are for side-by-side comparison on one machine, never absolute claims.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

GGUF_TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_K": 12}


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _batchgen(path: str, batch: int, args, **options) -> tuple[float, int, list[list[int]]]:
    from batchgen import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=64, kv_cache_memory="1GiB", **options)
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(5, 4000, (args.prompt,), generator=g).tolist()}
        for _ in range(batch)
    ]
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    return batch * args.new / (time.perf_counter() - start), _weight_bytes(llm.engine.model), tokens


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of generated tokens before each sequence's first difference (greedy agreement)."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
    return same / max(1, sum(map(len, a)))


def _llama_cpp(path: str, batch: int, args) -> float | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(path, n_ctx=batch * (args.prompt + args.new) + 64, n_batch=512, n_seq_max=batch,
                          n_threads=torch.get_num_threads(), verbose=False, logits_all=False)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (args.prompt,), generator=g).tolist() for _ in range(batch)]
    ctx, model = llm.ctx, llm.model
    n_vocab = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(model))
    start = time.perf_counter()
    b = llama_cpp.llama_batch_init(batch * args.prompt, 0, batch)
    pos = [0] * batch
    last = [0] * batch

    def submit(tokens_per_seq: list[list[int]]) -> None:
        b.n_tokens = 0
        for s, toks in enumerate(tokens_per_seq):
            for i, t in enumerate(toks):
                k = b.n_tokens
                b.token[k], b.pos[k], b.n_seq_id[k] = t, pos[s] + i, 1
                b.seq_id[k][0] = s
                b.logits[k] = i == len(toks) - 1
                b.n_tokens += 1
            last[s] = b.n_tokens - 1
            pos[s] += len(toks)
        if llama_cpp.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    submit(prompts)
    for _ in range(args.new):
        nxt = []
        for s in range(batch):
            logits = llama_cpp.llama_get_logits_ith(ctx, last[s])
            nxt.append([max(range(n_vocab), key=lambda j: logits[j])])
        submit(nxt)
    llama_cpp.llama_batch_free(b)
    return batch * args.new / (time.perf_counter() - start)


def main() -> None:
    from batchgen.models.quant.gguf_writer import write_gguf
    from batchgen.models.tiny import build_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--batches", default="4,64")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="batchgen-quant-bench-"))
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                 intermediate_size=3 * args.hidden)  # fmt: skip
    f32 = build_checkpoint(root / "f32", "llama", **shape)
    bf16 = build_checkpoint(root / "bf16", "llama", dtype=torch.bfloat16, **shape)
    systems: dict[str, tuple[str, dict]] = {
        "batchgen float32": (f32, {}),
        "batchgen bfloat16 weights": (bf16, {}),
        "batchgen float32, bf16 KV": (f32, {"kv_cache_dtype": "bfloat16"}),
        "batchgen float32, fp8 KV": (f32, {"kv_cache_dtype": "fp8"}),
    }
    ggufs = {name: write_gguf(f32, root / f"{name}.gguf", t) for name, t in GGUF_TYPES.items()}
    for name, path in ggufs.items():
        systems[f"batchgen GGUF {name}"] = (path, {})
    rows = []
    for batch in map(int, args.batches.split(",")):
        base = None
        for name, (path, opts) in systems.items():
            tps, wbytes, tokens = _batchgen(path, batch, args, **opts)
            base = tokens if base is None else base
            row = {
                "system": name,
                "seqs": batch,
                "tok_s": round(tps, 1),
                "weight_MiB": round(wbytes / 2**20, 2),
            }
            if "KV" in name:  # greedy agreement with the float32 cache on the same weights
                row["greedy_agreement_vs_f32_kv"] = round(_agreement(tokens, base), 3)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
        for name, path in ggufs.items():
            tps = _llama_cpp(path, batch, args)
            if tps is not None:
                rows.append({"system": f"llama.cpp GGUF {name}", "seqs": batch, "tok_s": round(tps, 1)})
                print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"loadavg": os.getloadavg(), "threads": torch.get_num_threads(), "args": vars(args)}))


if __name__ == "__main__":
    main()
