"""Mixed LoRA batches vs the base model vs one merged model per adapter: ``python -m batchgen.bench.lora``.

One random Llama (built once into the batchgen cache; ``--hidden``, ``--layers``) and ``--adapters`` random PEFT
adapters of it (``--ranks``, default 8, 16, 16, 32; every q/k/v/o/gate/up/down projection; written as PEFT
writes them), and ``--rows`` prompts of ``--prompt-len`` random tokens, each generating ``--max-tokens`` greedy
tokens (``ignore_eos``). Row ``i`` belongs to adapter ``i % adapters``. Three ways to produce the same rows, timed
in one process, one after the other:

* ``base``: the base model alone, every row, no adapters (the floor: what LoRA costs on top of it);
* ``mixed``: one engine with ``enable_lora`` and ``max_loras = adapters``: every row under its adapter, all
  in the same steps (batched LoRA);
* ``separate``: what a user without batched LoRA does: each adapter merged into a full copy of the model with
  PEFT (``merge_and_unload`` + ``save_pretrained``, done once before the rounds, timed apart as ``merge``), then
  per adapter one engine started on its merged checkpoint, generating that adapter's rows, and shut down, one
  after the other. Its time counts the engines' start-up (loading each merged model) with their generation.

The base and mixed engines are started once (their start-up is reported apart); then ``--repeats`` rounds run
base, mixed and separate in turn (so all three see the same drift of a shared machine's load), and each keeps
its best run (noise only slows runs down). Printed: seconds, generated tokens/s, the ratio to ``base``, and how
many rows of ``mixed`` produced the same tokens as their merged model (merging rounds the weights, so a near
tie may go the other way). ``--json`` writes it all. The separate side needs ``peft`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from batchgen.bench.common import machine_info
from batchgen.lora_request import LoRARequest
from batchgen.runtime.disk_cache import cache_root
from batchgen.sampling_params import SamplingParams

_TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def base_model(hidden: int, layers: int) -> str:
    from batchgen.models.tiny import cached_checkpoint

    spec: dict[str, Any] = dict(
        arch="llama", hidden_size=hidden, num_layers=layers, num_heads=hidden // 64, num_kv_heads=max(1, hidden // 128),
        intermediate_size=hidden * 8 // 3 // 64 * 64, vocab_size=4096, initializer_range=0.05,
    )  # fmt: skip
    return cached_checkpoint(f"bench-lora-llama-h{hidden}-l{layers}", cache_root(), **spec)


def write_adapter(base: str, out: Path, rank: int, seed: int) -> str:
    """A random PEFT adapter of ``base`` (rank ``rank`` on every projection) in ``out``; returns ``out``."""
    weights = load_file(str(Path(base) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    alpha = 2.0 * rank
    tensors = {}
    for name, w in weights.items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module not in _TARGETS or ".layers." not in name:
            continue
        out_f, in_f = w.shape
        prefix = "base_model.model." + name[: -len(".weight")]
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(_TARGETS),
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def merge_with_peft(base: str, adapter: str, out: Path) -> str:
    """``base`` with ``adapter`` merged in, saved as a full checkpoint in ``out`` the way a user without batched
    LoRA does it: PEFT's ``merge_and_unload`` then ``save_pretrained`` (safetensors), the tokenizer files
    copied beside it. Returns ``out``."""
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise SystemExit(
            f"bench.lora merges the adapters with PEFT for its separate side: pip install peft ({e})"
        ) from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load and save, per adapter: noise in the bench's output
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    for f in Path(base).iterdir():
        if f.is_file() and not (out / f.name).exists() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return str(out)


def _timed(fn) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def _adapters_and_merged(
    base: str, work: Path, ranks: list[int]
) -> tuple[list[LoRARequest], list[str], float]:
    """One adapter per rank, and each merged into a full model copy with PEFT (the seconds that took)."""
    adapters, merged = [], []
    t_merge = 0.0
    for i, r in enumerate(ranks):
        path = write_adapter(base, work / f"adapter-{i}", r, seed=100 + i)
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, path))
        t, out = _timed(lambda path=path, i=i: merge_with_peft(base, path, work / f"merged-{i}"))
        t_merge += t
        merged.append(out)
    return adapters, merged, t_merge


def _run_separate(
    merged: list[str], owner: list[int], prompts: list[list[int]], sp: SamplingParams, engine: dict[str, Any]
) -> tuple[list[Any], float]:
    """One engine per merged model, started, run over its adapter's rows, shut down, in turn: the outputs in
    row order and the seconds spent starting engines."""
    from batchgen.llm import LLM

    outs: list[Any] = [None] * len(prompts)
    loading = 0.0
    for i, path in enumerate(merged):
        t, llm = _timed(lambda path=path: LLM(path, **engine))
        loading += t
        rows = [j for j in range(len(prompts)) if owner[j] == i]
        for j, o in zip(rows, llm.generate([prompts[j] for j in rows], sp, use_tqdm=False)):
            outs[j] = o
        del llm
        gc.collect()
    return outs, loading


def run(args: argparse.Namespace) -> dict[str, Any]:
    from batchgen.llm import LLM

    load_start = list(os.getloadavg())
    base = base_model(args.hidden, args.layers)
    work = Path(args.workdir or cache_root() / "bench-lora-adapters")
    ranks = [int(r) for r in args.ranks.split(",")][: args.adapters]
    ranks += [ranks[-1]] * (args.adapters - len(ranks))
    adapters, merged, t_merge = _adapters_and_merged(base, work, ranks)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 4000) for _ in range(args.prompt_len)] for _ in range(args.rows)]
    owner = [i % args.adapters for i in range(args.rows)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(device="cpu", max_num_seqs=args.rows, kv_cache_memory="1GiB", enable_prefix_caching=False)
    lora_opts = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=max(ranks))
    tokens = args.rows * args.max_tokens

    t_base_start, base_llm = _timed(lambda: LLM(base, **engine))
    t_mixed_start, mixed_llm = _timed(lambda: LLM(base, **engine, **lora_opts))
    loras = [adapters[o] for o in owner]
    load_times: list[float] = []

    def run_separate() -> list[Any]:
        outs, loading = _run_separate(merged, owner, prompts, sp, engine)
        load_times.append(loading)
        return outs

    # Round-robin repeats (base, mixed, separate, base, ...): a shared machine's load drifts, and each system
    # should see the same; the best run of each is kept (noise only slows runs down).
    times: dict[str, list[float]] = {"base": [], "mixed": [], "separate": []}
    for _ in range(args.repeats):
        t, _ = _timed(lambda: base_llm.generate(prompts, sp, use_tqdm=False))
        times["base"].append(t)
        t, mixed_out = _timed(lambda: mixed_llm.generate(prompts, sp, use_tqdm=False, lora_request=loras))
        times["mixed"].append(t)
        t, sep_out = _timed(run_separate)
        times["separate"].append(t)
    t_base, t_mixed, t_sep = (min(times[k]) for k in ("base", "mixed", "separate"))
    t_sep_load = load_times[times["separate"].index(t_sep)]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(mixed_out, sep_out))
    return {
        "config": vars(args),
        "ranks": ranks,
        "machine": machine_info(),
        "loadavg_start": load_start,
        "generated_tokens": tokens,
        "base_s": t_base,
        "mixed_s": t_mixed,
        "separate_s": t_sep,
        "separate_loading_s": t_sep_load,
        "merge_s": t_merge,
        "base_startup_s": t_base_start,
        "mixed_startup_s": t_mixed_start,
        "mixed_vs_base": t_mixed / t_base,
        "separate_vs_base": t_sep / t_base,
        "rows_same_as_merged": same,
        "all_runs_s": times,
    }


def format_result(r: dict[str, Any]) -> str:
    c = r["config"]
    tok = r["generated_tokens"]
    lines = [
        f"{c['rows']} rows x {c['max_tokens']} tokens (prompts of {c['prompt_len']}), {c['adapters']} adapters "
        f"ranks {r['ranks']}, Llama hidden {c['hidden']} x {c['layers']} layers; "
        f"load {r['loadavg_start']} at start, {r['machine']['loadavg']} at end",
        f"{'run':<10}{'seconds':>10}{'tok/s':>10}{'vs base':>10}",
        f"{'base':<10}{r['base_s']:>10.2f}{tok / r['base_s']:>10.1f}{1.0:>10.2f}",
        f"{'mixed':<10}{r['mixed_s']:>10.2f}{tok / r['mixed_s']:>10.1f}{r['mixed_vs_base']:>10.2f}",
        f"{'separate':<10}{r['separate_s']:>10.2f}{tok / r['separate_s']:>10.1f}{r['separate_vs_base']:>10.2f}"
        f"   ({r['separate_loading_s']:.1f} s of it starting {c['adapters']} engines on merged models)",
        f"start-up: base engine {r['base_startup_s']:.1f} s, mixed engine {r['mixed_startup_s']:.1f} s; "
        f"merging the {c['adapters']} adapters with PEFT beforehand: {r['merge_s']:.1f} s",
        f"mixed rows with the same tokens as their merged model: {r['rows_same_as_merged']} / {c['rows']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--ranks", default="8,16,16,32", help="adapter ranks, comma-separated (the last repeats)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where adapters and merged models are written")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("BATCHGEN_BENCH_THREADS", torch.get_num_threads())))
    result = run(args)
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
