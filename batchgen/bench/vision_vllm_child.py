"""vLLM as a system of the image-text benchmark, run as a script under vLLM's own interpreter.

    /path/to/vllm-venv/bin/python batchgen/bench/vision_vllm_child.py SPEC.json REPLY_FD

Imports nothing from batchgen (vLLM pins its own torch and transformers). The spec names the checkpoint, the
engine budgets and, per workload, the rows (prompt text with the model's ``<image>`` placeholder, the path of
the image's encoded bytes) and ``max_tokens``. The engine starts once and is warmed up with an unrelated image
row; then the child answers commands read from stdin, one per line: a workload's name runs it once, timed
from the encoded bytes (decode and vLLM's processor inside the wall time, as for the other systems), its
prefix and multimodal caches reset first; ``quit`` ends it. Each answer is one JSON line on file descriptor
REPLY_FD (vLLM logs on stdout): first the start (``status`` ``ok`` with ``via``, ``engine_init_s`` and
``settings``; ``skipped`` when vLLM cannot be imported; ``error`` with the reason), then per run ``wall_s``,
``cpu_s`` (CPU seconds of this process and vLLM's engine processes over the run), ``loadavg``,
``token_ids`` (row order) and ``prompt_tokens_cached``. Between runs the parent may stop the whole process
tree (SIGSTOP), so that vLLM's idle polling takes nothing from the other systems' runs.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # our siblings never shadow packages


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and every live process under it (vLLM's engine core and
    worker run in child processes)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def start(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The warmed-up engine and the start message (engine None when vLLM cannot be imported)."""
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        if e.name not in ("vllm", "PIL"):
            raise
        return None, {"status": "skipped", "reason": f"{e.name} cannot be imported by {sys.executable} ({e})"}
    e = spec["engine"]
    kw = dict(
        model=spec["model"],
        dtype="float32",
        seed=0,
        max_model_len=int(e["max_model_len"]),
        enable_prefix_caching=True,
        max_num_seqs=int(e["max_num_seqs"]),
        max_num_batched_tokens=int(e["max_num_batched_tokens"]),
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=int(e["kv_cache_bytes"]),
        limit_mm_per_prompt={"image": 1},
    )
    t0 = time.perf_counter()
    llm = LLM(**kw)
    init_s = time.perf_counter() - t0
    llm.generate(
        rows_of(spec["warmup"]),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    return llm, {
        "status": "ok",
        "via": f"vllm {vllm.__version__} LLM.generate with multi_modal_data (eager)",
        "engine_init_s": init_s,
        "settings": {k: v for k, v in kw.items() if k != "model"},
    }


def rows_of(rows: list[list[str]]) -> list[dict[str, Any]]:
    from PIL import Image

    out = []
    for prompt, path in rows:
        image = Image.open(io.BytesIO(Path(path).read_bytes())).convert("RGB")
        out.append({"prompt": prompt, "multi_modal_data": {"image": image}})
    return out


def run(llm: Any, workload: dict[str, Any]) -> dict[str, Any]:
    """One timed run of ``workload`` (its caches reset first)."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    if hasattr(llm, "reset_mm_cache"):
        llm.reset_mm_cache()
    params = SamplingParams(temperature=0.0, max_tokens=int(workload["max_tokens"]), ignore_eos=True)
    load0 = os.getloadavg()[0]
    cpu0 = _tree_cpu_s()
    t = time.perf_counter()
    outs = llm.generate(rows_of(workload["rows"]), params, use_tqdm=False)
    wall = time.perf_counter() - t
    return {
        "status": "ok",
        "wall_s": wall,
        "cpu_s": _tree_cpu_s() - cpu0,
        "loadavg": [load0, os.getloadavg()[0]],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "prompt_tokens_cached": sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    reply = os.fdopen(int(sys.argv[2]), "w", buffering=1)

    def answer(msg: dict[str, Any]) -> None:
        reply.write(json.dumps(msg) + "\n")

    try:
        llm, msg = start(spec)
    except Exception as e:  # the parent reports it as this system's error
        traceback.print_exc()
        llm, msg = None, {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    answer(msg)
    if llm is None:
        return
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        try:
            answer(run(llm, spec["workloads"][name]))
        except Exception as e:
            traceback.print_exc()
            answer({"status": "error", "reason": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
