"""Native vs transformers backend vs transformers `generate`, on the same checkpoint and workload.

    python -m batchgen.bench.model_impls                                  # all archs, defaults
    python -m batchgen.bench.model_impls --archs gemma2,mixtral --rows 64 --max-tokens 32 --repeats 3
    python -m batchgen.bench.model_impls --no-workload --forward-reps 20 --threads 1     # model step only
    python -m batchgen.bench.model_impls --gemm-layout --threads 1      # row- vs column-major weight GEMMs

For each architecture a random-weight checkpoint is built once from transformers' own config class (bench
sizes: hidden 256, 4 layers, 8 query / 4 KV heads, intermediate 768, vocab 4096; MoE: 8 experts, top-2; Gemma 2
/ Gemma 3 / Mistral / Phi-3 windows of 128 tokens, shorter than the prompts) into ``$BATCHGEN_CACHE`` (default
``~/.cache/batchgen``). The workload is the throughput benchmark's (`batchgen.bench.workloads`, default
``shared_prefix``: 4 templates of ~300 tokens + a ~30-token item per row), greedy, ``ignore_eos``.

Systems, each warmed up, then timed ``--repeats`` times, in turn within each repeat (median wall time):

- ``native``: ``LLM(path, model_impl="native")`` — batchgen's own model code;
- ``transformers``: ``LLM(path, model_impl="transformers")`` — transformers' modeling code over batchgen's paged
  attention (same engine, scheduler, prefix cache);
- ``hf_generate``: ``model.generate`` on left-padded static batches of 32 (eager attention, contiguous cache,
  eos off: the model's ``generation_config.eos_token_id`` is cleared, since ``generate`` fills a passed
  config's unset fields from it).

A first table times the model step alone (native vs transformers backend, same kernels: a 256-token prefill
chunk, and a 16-sequence decode step at 300 tokens of context), ``--forward-reps`` times back to back: each
one's minimum, and the median of the paired ratios — robust on a shared machine. The workload table gives generated tok/s, wall time, process CPU time (all threads; steadier than wall time on a shared
machine), rows whose tokens differ from ``hf_generate``'s, and the native path's speed over each system's
(``native ÷ system``, by wall and by CPU time).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from functools import partial
from typing import Any

import torch

from batchgen.models.tiny import build_random_checkpoint, special_token_kwargs
from batchgen.runtime.atomic import build_dir_once
from batchgen.runtime.disk_cache import cache_root

BENCH_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 128}),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"sliding_window": 128, "original_max_position_embeddings": 2048},
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"sliding_window": 128, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 50.0},
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 128, "query_pre_attn_scalar": 32},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384, "norm_topk_prob": True},
    ),
}
_SIZES = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=4096,
    max_position_embeddings=2048,
    initializer_range=0.08,
    tie_word_embeddings=False,
)
_VERSION = "v1"


def bench_checkpoint(arch: str) -> str:
    """The benchmark checkpoint of `arch`, built on first use (atomic rename into the cache)."""
    import transformers

    cfg_name, model_name, extra = BENCH_ARCHS[arch]

    def config(ids: dict[str, int]):
        return getattr(transformers, cfg_name)(**{**_SIZES, **extra}, **special_token_kwargs(ids))

    return build_dir_once(
        cache_root() / "bench-impls" / f"{arch}-{_VERSION}",
        "config.json",
        lambda tmp: build_random_checkpoint(tmp, config, model_name, vocab_size=_SIZES["vocab_size"]),
    )


def _workload(path: str, name: str, rows: int, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    from batchgen.bench.workloads import WorkloadSpec, make_workload
    from batchgen.models.loader import load_tokenizer

    table = make_workload(name, WorkloadSpec(rows=rows, max_tokens=max_tokens), load_tokenizer(path))
    return table.column("prompt_token_ids").to_pylist(), table.column("max_tokens").to_pylist()


def _engine_runner(path: str, impl: str, engine: dict[str, Any]):
    """A callable running the workload on a fresh engine (an empty prefix cache each time), warmed up."""
    from batchgen import LLM, SamplingParams

    def run(prompts, max_tokens):
        llm = LLM(path, model_impl=impl, **engine)
        llm.generate(_warm_prompts(), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        t0, c0 = time.perf_counter(), time.process_time()
        res = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, time.process_time() - c0, [r.outputs[0].token_ids for r in res]

    return run


def _warm_prompts() -> list[list[int]]:
    """Random prompts (no prefix shared with the workload) to warm the kernels and allocator."""
    g = torch.Generator().manual_seed(123)
    return [torch.randint(5, 4000, (24,), generator=g).tolist() for _ in range(4)]


def _hf_generate_runner(path: str, batch_size: int = 32):
    """A callable running the workload with `generate` on left-padded static batches (eos off)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # generate() fills a GenerationConfig's unset fields from the model's: eos must be removed there to be off
    model.generation_config.eos_token_id = None
    pad = model.generation_config.pad_token_id or 0

    def generate(ps, mts):
        out = []
        for s in range(0, len(ps), batch_size):
            chunk, mt = ps[s : s + batch_size], mts[s : s + batch_size]
            n = max(map(len, chunk))
            ids = torch.full((len(chunk), n), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), n), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, n - len(p) :] = torch.tensor(p)
                mask[i, n - len(p) :] = 1
            gc = GenerationConfig(
                max_new_tokens=max(mt), do_sample=False, eos_token_id=None, pad_token_id=pad
            )
            with torch.inference_mode():
                res = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
            if res.shape[1] != n + max(mt):
                raise RuntimeError("transformers generate stopped early")
            out += [g[:m] for g, m in zip(res[:, n:].tolist(), mt)]
        return out

    generate(_warm_prompts(), [4] * 4)

    def run(prompts, max_tokens):
        t0, c0 = time.perf_counter(), time.process_time()
        out = generate(prompts, max_tokens)
        return time.perf_counter() - t0, time.process_time() - c0, out

    return run


def bench(
    archs: list[str], workload: str, rows: int, max_tokens: int, repeats: int, engine: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per arch, the systems run in turn within each repeat (so load drifts hit them alike); medians."""
    results = []
    for arch in archs:
        path = bench_checkpoint(arch)
        prompts, mts = _workload(path, workload, rows, max_tokens)
        generated = sum(mts)
        runners = {
            "native": _engine_runner(path, "native", engine),
            "transformers": _engine_runner(path, "transformers", engine),
            "hf_generate": _hf_generate_runner(path),
        }
        walls: dict[str, list[float]] = {k: [] for k in runners}
        cpus: dict[str, list[float]] = {k: [] for k in runners}
        outs: dict[str, list[list[int]]] = {}
        for _ in range(repeats):
            for system, run in runners.items():
                wall, cpu, outs[system] = run(prompts, mts)
                walls[system].append(wall)
                cpus[system].append(cpu)
        ref = outs["hf_generate"]
        native_wall, native_cpu = statistics.median(walls["native"]), statistics.median(cpus["native"])
        for system in runners:
            wall, cpu = statistics.median(walls[system]), statistics.median(cpus[system])
            results.append(
                {
                    "arch": arch,
                    "system": system,
                    "wall_s": wall,
                    "wall_min_max": (min(walls[system]), max(walls[system])),
                    "cpu_s": cpu,
                    "gen_tok_s": generated / wall,
                    "mismatch_rows": sum(a != b for a, b in zip(outs[system], ref)),
                    "native_speedup": wall / native_wall,
                    "native_speedup_cpu": cpu / native_cpu,
                }
            )
    return results


def _meta(seqs: list[tuple[list[int], int, int]], num_decode: int, block_size: int):
    from batchgen.attention import AttentionMetadata

    return AttentionMetadata.for_sequences(seqs, num_decode, block_size)


@torch.inference_mode()
def bench_forward(archs: list[str], reps: int, prefill: int = 256, batch: int = 16, context: int = 300):
    """Model step alone (forward + logits of the sampled rows), native vs transformers backend, same kernels:
    a `prefill`-token chunk, and a decode step of `batch` sequences at `context` tokens, `reps` times, the two
    implementations back to back. Reports each one's minimum and the median of the paired ratios, by wall and by
    process CPU time (robust to the load of a shared machine; CPU time is the steadiest with 1 thread)."""
    from batchgen.attention import ForwardContext, PagedAttention
    from batchgen.models import load_model

    block = 16
    rows = []
    for arch in archs:
        path = bench_checkpoint(arch)
        models = {impl: load_model(path, implementation=impl) for impl in ("native", "transformers")}
        c = models["native"].config
        per_seq = -(-(context + 1) // block)
        kv = torch.zeros(c.num_layers, 2, per_seq * batch, block, c.num_kv_heads, c.head_dim, dtype=c.dtype)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        ids = torch.randint(5, c.vocab_size, (prefill,), generator=torch.Generator().manual_seed(0))
        steps = {
            "prefill": (ids, torch.arange(prefill), _meta([(tables[0], 0, prefill)], 0, block), 1),
            "decode": (
                ids[:batch],
                torch.full((batch,), context),
                _meta([(t, context, 1) for t in tables], batch, block),
                batch,
            ),
        }
        times: dict[tuple[str, str], list[float]] = {}
        cpu: dict[tuple[str, str], list[float]] = {}
        attn = PagedAttention("torch")
        for _ in range(reps):
            for step, (x, pos, meta, n_logits) in steps.items():
                for impl, model in models.items():  # back to back: a pair sees the same machine load
                    t0, c0 = time.perf_counter(), time.process_time()
                    model.compute_logits(model(x, pos, ForwardContext(attn, meta, kv))[-n_logits:])
                    times.setdefault((impl, step), []).append(time.perf_counter() - t0)
                    cpu.setdefault((impl, step), []).append(time.process_time() - c0)
        for step in steps:
            native, generic = times[("native", step)], times[("transformers", step)]
            rows.append(
                {
                    "arch": arch,
                    "step": step,
                    "native_ms": min(native) * 1e3,
                    "transformers_ms": min(generic) * 1e3,
                    "paired_ratio": statistics.median(g / n for g, n in zip(generic, native)),
                    "paired_cpu_ratio": statistics.median(
                        g / n for g, n in zip(cpu[("transformers", step)], cpu[("native", step)])
                    ),
                }
            )
    return rows


@torch.inference_mode()
def bench_gemm_layout(
    reps: int = 9,
    rows: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 64, 256),
    shapes: tuple[tuple[int, int], ...] = (
        (1536, 256),
        (512, 256),
        (256, 768),
        (4096, 4096),
        (22016, 4096),
        (4096, 11008),
    ),
) -> str:
    """A float32 linear layer four ways, for the bench models' projection shapes and 4096-wide ones:
    `F.linear` on the weight as loaded (row-major), on it stored column-major (the loaders' last fallback,
    `packed_linear.use_column_major_weights`), oneDNN's packed linear (`PackedLinear` layout ``onednn``, the
    fallback without batchgen's C kernels) and batchgen's GEMM (`PackedLinear` layout ``panels``, what the
    loader uses). Each cell: the median over `reps` back-to-back runs of every layout of the process-CPU-time
    ratios row-major ÷ each other layout (above 1: faster than row-major), in that order."""
    import torch.nn.functional as F

    from batchgen.kernels import cpu_linear
    from batchgen.models.packed_linear import PackedLinear, onednn_available

    lines = [
        "| weight [out, in] | " + " | ".join(f"{m} rows" for m in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for n, k in shapes:
        w = torch.randn(n, k)
        wc = w.t().contiguous().t()
        layouts = [partial(F.linear, weight=w), partial(F.linear, weight=wc)]
        if onednn_available():
            layouts.append(PackedLinear(w, None, "onednn"))
        if cpu_linear.available():
            layouts.append(PackedLinear(w, None, "panels"))
        cells = []
        for m in rows:
            x = torch.randn(m, k)
            ratios: list[list[float]] = [[] for _ in layouts[1:]]
            for _ in range(reps + 1):
                times = []
                for fn in layouts:
                    t0 = time.process_time()
                    fn(x)
                    times.append(max(time.process_time() - t0, 1e-9))
                for r, t in zip(ratios, times[1:]):
                    r.append(times[0] / t)
            cells.append(" / ".join(f"{statistics.median(r[1:]):.2f}×" for r in ratios))
        lines.append(f"| [{n}, {k}] | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def forward_table(rows: list[dict[str, Any]], prefill: int = 256, batch: int = 16, context: int = 300) -> str:
    lines = [
        "| arch | step | native ms (min) | transformers backend ms (min) | native speed-up (median of pairs) "
        "| by CPU time |",
        "|---|---|---:|---:|---:|---:|",
    ]
    names = {"prefill": f"prefill {prefill} tokens", "decode": f"decode {batch} seqs @ {context}"}
    for r in rows:
        lines.append(
            f"| {r['arch']} | {names[r['step']]} | {r['native_ms']:.1f} | {r['transformers_ms']:.1f} "
            f"| {r['paired_ratio']:.2f}× | {r['paired_cpu_ratio']:.2f}× |"
        )
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| arch | system | gen tok/s | wall s (min–max) | CPU s | mismatch rows vs hf_generate "
        "| native ÷ system (wall) | native ÷ system (CPU) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lo, hi = r["wall_min_max"]
        lines.append(
            f"| {r['arch']} | {r['system']} | {r['gen_tok_s']:.1f} | {r['wall_s']:.2f} ({lo:.2f}–{hi:.2f}) "
            f"| {r['cpu_s']:.2f} | {r['mismatch_rows']} | {r['native_speedup']:.2f}× "
            f"| {r['native_speedup_cpu']:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--archs", default=",".join(BENCH_ARCHS), help="comma-separated: " + ", ".join(BENCH_ARCHS)
    )
    p.add_argument("--workload", default="shared_prefix", help="shared_prefix, unique or long_tail")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument(
        "--forward-reps", type=int, default=15, help="model-step table: alternating runs (0: skip)"
    )
    p.add_argument("--no-workload", action="store_true", help="only the model-step table")
    p.add_argument(
        "--gemm-layout",
        action="store_true",
        help="only the GEMM table: row- vs column-major vs packed weights",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    archs = [a for a in args.archs.split(",") if a]
    unknown = sorted(set(archs) - set(BENCH_ARCHS))
    if unknown:
        p.error(f"unknown arch(s) {unknown}; choose from {', '.join(BENCH_ARCHS)}")
    engine = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
    machine = f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}"
    if args.gemm_layout:
        load0 = os.getloadavg()[0]
        table_ = bench_gemm_layout()
        print(
            "float32 linear, row-major F.linear time ÷ column-major F.linear time / ÷ oneDNN-packed time / ÷ batchgen GEMM time; "
            f"{machine}; load average {load0:.2f}"
        )
        print(table_)
        return 0
    if args.forward_reps > 0:
        t0, load0 = time.time(), os.getloadavg()[0]
        rows = bench_forward(archs, args.forward_reps)
        print(
            f"model step (forward + logits), {args.forward_reps} back-to-back pairs, float32, torch attention "
            f"backend; {machine}; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; {time.time() - t0:.0f} s"
        )
        print(forward_table(rows))
        print()
    if not args.no_workload:
        t0, load0 = time.time(), os.getloadavg()[0]
        results = bench(archs, args.workload, args.rows, args.max_tokens, args.repeats, engine)
        print(
            f"workload {args.workload}, {args.rows} rows x {args.max_tokens} tokens, greedy, float32, "
            f"{args.repeats} repeat(s); {machine}; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}; "
            f"{time.time() - t0:.0f} s"
        )
        print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
