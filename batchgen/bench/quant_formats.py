"""GPTQ, AWQ, fp8 and W8A8 checkpoints beside float32 on one model: weight bytes in memory and decode tok/s (wall and
per CPU-second of the process) at 4 and 64 sequences (``python -m batchgen.bench.quant_formats``).

The model is `batchgen.bench.quant`'s random-weight llama (hidden 512, 4 layers, 8 heads / 4 KV heads,
intermediate 1536, vocab 4096); each format is written from it by `batchgen.models.quant.writers` with group
size 128 (fp8 blocks 128 x 128; W8A8 and FP8_DYNAMIC per channel, inputs quantized per token). `--systems`
picks systems by substrings of their names. 32-token prompts, 32 greedy tokens each, after a warm-up; the same prompt ids
for every system. Greedy agreement with float32 is reported for orientation only (quantized weights are other
weights: equality is held against the dequantized reference in the tests, not here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from batchgen.bench.quant import add_model_args, bench_model, generate_run


def main() -> None:
    from batchgen.models.quant import writers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--systems", default="", help="comma-separated substrings: only the systems they name")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="batchgen-quant-formats-"))
    f32 = bench_model(root / "f32", args)
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
        "compressed-tensors W8A8 int8 dynamic": writers.write_compressed_w8a8(
            f32, root / "w8a8", weights="int8"
        ),
        "compressed-tensors FP8_DYNAMIC": writers.write_compressed_w8a8(f32, root / "fp8dyn", weights="fp8"),
    }
    if args.systems:  # substrings naming the systems to run (float32, the base, always runs)
        wanted = [w.strip() for w in args.systems.split(",") if w.strip()]
        systems = {k: v for k, v in systems.items() if k == "float32" or any(w in k for w in wanted)}
    for batch in map(int, args.batches.split(",")):
        base = None
        for name, path in systems.items():
            run = generate_run(path, batch, args, kv_cache_memory="512MiB")
            base = run if base is None else base
            print(json.dumps(run.row(name, batch, base)), flush=True)
    print(json.dumps({"loadavg": os.getloadavg(), "threads": torch.get_num_threads(), "args": vars(args)}))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
