"""GPTQ, AWQ and fp8 checkpoints beside float32 on one model: weight bytes in memory and decode tok/s at 4 and 64
sequences (``python -m batchgen.bench.quant_formats``).

The model is `batchgen.bench.quant`'s random-weight llama (hidden 512, 4 layers, 8 heads / 4 KV heads,
intermediate 1536, vocab 4096); each format is written from it by `batchgen.models.quant.writers` with group
size 128 (fp8 blocks 128 x 128). 32-token prompts, 32 greedy tokens each, after a warm-up; the same prompt ids
for every system. Greedy agreement with float32 is reported for orientation only (quantized weights are other
weights: equality is held against the dequantized reference in the tests, not here).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _run(path: str, batch: int, args) -> tuple[float, int, list[list[int]]]:
    from batchgen import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=64, kv_cache_memory="512MiB")
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(5, 4000, (args.prompt,), generator=g).tolist()}
        for _ in range(batch)
    ]
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    model = llm.engine.model
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." in n)
    return batch * args.new / elapsed, weights, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    from batchgen.models.quant import writers
    from batchgen.models.tiny import build_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--batches", default="4,64")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="batchgen-quant-formats-"))
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                 intermediate_size=3 * args.hidden)  # fmt: skip
    f32 = build_checkpoint(root / "f32", "llama", **shape)
    systems = {
        "float32": f32,
        "GPTQ int4 sym g128": writers.write_gptq(f32, root / "gptq", bits=4, group_size=128),
        "GPTQ int4 asym act-order g128": writers.write_gptq(
            f32, root / "gptq-act", bits=4, group_size=128, desc_act=True, sym=False
        ),
        "GPTQ int8 sym g128": writers.write_gptq(f32, root / "gptq8", bits=8, group_size=128),
        "AWQ int4 g128": writers.write_awq(f32, root / "awq", group_size=128),
        "fp8 block 128x128": writers.write_block_fp8(f32, root / "fp8", block=(128, 128)),
        "compressed-tensors fp8 channel": writers.write_compressed_fp8(f32, root / "ctfp8"),
    }
    for batch in map(int, args.batches.split(",")):
        base = None
        for name, path in systems.items():
            tps, weights, tokens = _run(path, batch, args)
            base = tokens if base is None else base
            same = sum(
                next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
                for x, y in zip(tokens, base)
            )
            print(json.dumps({"system": name, "seqs": batch, "tok_s": round(tps, 1),
                              "decoder_weight_MiB": round(weights / 2**20, 2),
                              "greedy_agreement_vs_f32": round(same / sum(map(len, tokens)), 3)}))  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
