"""Quantized and half-precision weights, and narrow KV caches, side by side on one small random-weight llama:
weight bytes in memory per format and generated tokens per second at 4 and at 64 sequences (greedy, fixed
lengths), and llama.cpp's batched decode on the same GGUF files where it is installed. The GGUF files hold the
LM head as llama.cpp's quantizer writes it (Q8_0 in a Q8_0 file, else Q6_K), the token embedding float32.

    python -m batchgen.bench.quant [--hidden 512 --layers 4 --new 32 --prompt 32] [--drain] [--kv-context 1024]

Each system runs the same prompts (token ids) in one process after a warm-up; the load (os.getloadavg) is printed
with the figures, and each row has ``tok_per_cpu_s`` beside ``tok_s``: tokens per second of this process's CPU
time, the steadier figure on a machine shared with other work. Numbers are for side-by-side comparison on one
machine, never absolute claims. ``--drain`` times the decode steps alone (the prompts' KV blocks computed by an
untimed run first): the memory-bound drain of a job, where a few sequences decode with their prompts long done.

``--kv-context N`` adds the decode-heavy narrow-cache run: ``--kv-seqs`` sequences with N-token prompts whose KV
blocks are computed once (a one-token warm-up run fills the prefix cache), then ``--kv-new`` greedy tokens each:
the timed run is decode steps attending over N-token contexts, per cache dtype of ``--kv-dtypes`` (the first is the
base), each in the float32 cache's memory for those sequences; ``--kv-equal-memory bfloat16,fp8`` adds those dtypes
at the sequences that memory holds in their narrower blocks (2x, 4x). ``--kv-rounds`` timed rounds run interleaved
over the systems and each reports its best round.

llama.cpp (a peer on the Q8_0 and Q4_0 files; rows ``llama.cpp GGUF Q8_0`` / ``Q4_0``, chosen by ``--systems``
as the others): :mod:`batchgen.bench.llamacpp_peer` run as a child process under ``--llamacpp-python`` (default
``$BATCHGEN_LLAMACPP_PYTHON``, else this interpreter), with its own llama.cpp binding (llama-cpp-python or
cyllama; ``pip install batchgen[bench-llamacpp]``): llama.cpp's batched decode of the same prompt ids, the same
number of greedy tokens, as many threads as batchgen's engine ran with. Its row has
``greedy_agreement_with_batchgen`` on the same file; without a binding the row says ``skipped`` and why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GGUF_TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_K": 12, "Q6_K": 14}
LLAMA_CPP_TYPES = ("Q8_0", "Q4_0", "Q4_K")  # the files the peer runs too


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The bench model's shape and the run's lengths (shared by this bench and `bench.quant_formats`)."""
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--batches", default="4,64")
    p.add_argument(
        "--drain",
        action="store_true",
        help="time decoding alone: the prompts' KV blocks computed by an untimed run first (prefix cache)",
    )


def bench_model(root: Path, args, **options) -> str:
    """The random-weight llama both benches run (hidden --hidden, --layers layers, 8 heads / 4 KV heads,
    intermediate 3 x hidden, vocab 4096), written under `root`."""
    from batchgen.models.tiny import build_checkpoint

    shape = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                 intermediate_size=3 * args.hidden)  # fmt: skip
    return build_checkpoint(root, "llama", **shape, **options)


@dataclass(frozen=True)
class Run:
    """One timed greedy run: wall and CPU rates, the model's weight bytes (all of them, and the decoder
    layers' alone), the generated tokens and the prompt tokens the timed run found in the prefix cache."""

    tok_s: float
    tok_per_cpu_s: float
    weight_bytes: int
    decoder_weight_bytes: int
    tokens: list[list[int]]
    cached_prompt_tokens: int = 0

    def row(self, system: str, seqs: int, base: Run | None = None, **extra) -> dict:
        """The printed row; with `base`, the greedy agreement with it."""
        row = {"system": system, "seqs": seqs, "tok_s": round(self.tok_s, 1),
               "tok_per_cpu_s": round(self.tok_per_cpu_s, 1), "weight_MiB": round(self.weight_bytes / 2**20, 2),
               "decoder_weight_MiB": round(self.decoder_weight_bytes / 2**20, 2),
               "cached_prompt_tokens": self.cached_prompt_tokens, **extra}  # fmt: skip
        if base is not None:
            row["greedy_agreement"] = round(_agreement(self.tokens, base.tokens), 3)
        return row


def bench_prompts(batch: int, args, seed: int = 0) -> list[list[int]]:
    """`batch` random prompts of --prompt token ids, the same for every system (another `seed`: other prompts)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (args.prompt,), generator=g).tolist() for _ in range(batch)]


def generate_run(path: str, batch: int, args, kv_cache_memory: str = "1GiB", **options) -> Run:
    """`batch` random prompts of --prompt token ids (the same for every system), --new greedy tokens each, timed
    after a warm-up on two other prompts. With --drain an untimed one-token run over the same prompts puts their KV blocks in the
    prefix cache first, so the timed run is the decode steps of a job's drain (each prompt's last token
    recomputed, the rest of its blocks reused)."""
    from batchgen import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=64, kv_cache_memory=kv_cache_memory, **options)
    prompts = [{"prompt_token_ids": ids} for ids in bench_prompts(batch, args)]
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    warm_up = [
        {"prompt_token_ids": ids} for ids in bench_prompts(2, args, seed=1)
    ]  # shares no block with `prompts`
    llm.generate(warm_up, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    if args.drain:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    named = [(n, p.numel() * p.element_size()) for n, p in llm.engine.model.named_parameters()]
    return Run(
        tok_s=batch * args.new / wall,
        tok_per_cpu_s=batch * args.new / cpu,
        weight_bytes=sum(b for _, b in named),
        decoder_weight_bytes=sum(b for n, b in named if ".layers." in n),
        tokens=[o.outputs[0].token_ids for o in outs],
        cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
    )


@dataclass
class KVSystem:
    """One decode-heavy configuration: a cache dtype, its sequences and its engine with their prompts' KV cached."""

    name: str
    dtype: str
    seqs: int
    llm: object
    prompts: list
    best: tuple[float, float] = (
        0.0,
        0.0,
    )  # (tok / CPU-s, wall tok / s) of the round with the most tok / CPU-s
    tokens: list | None = None


def _kv_system(path: str, args, kv_cache_dtype: str, seqs: int, kv_bytes: int, name: str) -> KVSystem:
    """An engine with `kv_bytes` of KV cache in `kv_cache_dtype` whose prefix cache holds `seqs` prompts of
    --kv-context tokens (a one-token run computed them); the same prompts for every system (the first ones of
    one seeded stream)."""
    from batchgen import LLM, SamplingParams

    ctx = args.kv_context
    llm = LLM(path, max_num_seqs=seqs, kv_cache_memory=f"{max(1, kv_bytes // 2**20 + 64)}MiB",
              kv_cache_dtype=kv_cache_dtype, max_model_len=ctx + args.kv_new + 32)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(5, 4000, (ctx,), generator=g).tolist()} for _ in range(seqs)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return KVSystem(name, kv_cache_dtype, seqs, llm, prompts)


def _kv_round(system: KVSystem, args) -> None:
    """One timed decode-heavy run: --kv-new greedy tokens for each of the system's prompts (their KV cached, so
    the steps attend over --kv-context tokens); keeps the best round's rates."""
    from batchgen import SamplingParams

    params = SamplingParams(max_tokens=args.kv_new, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = system.llm.generate(system.prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = system.seqs * args.kv_new
    if tokens / cpu > system.best[0]:
        system.best = (tokens / cpu, tokens / wall)
    system.tokens = [o.outputs[0].token_ids for o in outs]


def kv_decode_runs(path: str, args) -> list[dict]:
    """The decode-heavy rows: each of --kv-dtypes at --kv-seqs sequences in the float32 cache's memory for them,
    and each of --kv-equal-memory at as many more sequences as that memory holds in its narrower blocks; --kv-rounds
    timed rounds interleaved over the systems (the best round's rates per system: load from other processes
    only ever slows a round down)."""
    from batchgen.kernels.kv_cache_dtype import cache_dtype

    n, ctx = args.kv_seqs, args.kv_context
    kv_bytes = n * (ctx + args.kv_new + 32) * 8 * args.layers * args.hidden  # float32 K+V bytes, with room
    systems = [_kv_system(path, args, d, n, kv_bytes, f"batchgen float32, {d} KV, {ctx}-token contexts")
               for d in args.kv_dtypes.split(",") if d]  # fmt: skip
    for d in (d for d in args.kv_equal_memory.split(",") if d):
        more = n * 4 // cache_dtype(d, torch.float32).itemsize
        name = f"batchgen float32, {d} KV, {ctx}-token contexts, the float32 cache's memory"
        systems.append(_kv_system(path, args, d, more, kv_bytes, name))
    for _ in range(args.kv_rounds):
        for system in systems:
            _kv_round(system, args)
    base = systems[0]
    rows = []
    for s in systems:
        row = {"system": s.name, "seqs": s.seqs, "tok_s": round(s.best[1], 1), "tok_per_cpu_s": round(s.best[0], 1),
               "vs_first_per_cpu_s": round(s.best[0] / base.best[0], 3), "rounds": args.kv_rounds}  # fmt: skip
        if s.seqs == base.seqs:
            row["greedy_agreement"] = round(_agreement(s.tokens, base.tokens), 3)
        rows.append(row)
    return rows


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of generated tokens before each sequence's first difference (greedy agreement)."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
    return same / max(1, sum(map(len, a)))


def peer_agreement(theirs: list[list[int]], ours: list[list[int]]) -> dict:
    """A peer's greedy agreement with batchgen's tokens on the same file: the share of tokens before each
    sequence's first difference, and the share of sequences whose first token is the same."""
    first = [a[:1] == b[:1] for a, b in zip(theirs, ours)]
    return {"greedy_agreement_with_batchgen": round(_agreement(theirs, ours), 3),
            "first_token_agreement": round(sum(first) / max(1, len(first)), 3)}  # fmt: skip


def llama_cpp_peer(python: str, path: str, batch: int, args, threads: int) -> dict:
    """llama.cpp's batched greedy decode of the bench prompts on the GGUF file at `path`, run by
    :mod:`batchgen.bench.llamacpp_peer` under `python`; its result (``status`` ``ok``, ``skipped`` or
    ``error`` with ``reason``)."""
    if not Path(python).is_file():
        return {"status": "skipped", "reason": f"no interpreter {python} (--llamacpp-python)"}
    spec = {"path": path, "prompts": bench_prompts(batch, args), "max_tokens": args.new, "threads": threads}
    with tempfile.TemporaryDirectory(prefix="batchgen-llamacpp-") as d:
        spec_path, out_path = Path(d, "spec.json"), Path(d, "result.json")
        spec_path.write_text(json.dumps(spec))
        script = Path(__file__).with_name("llamacpp_peer.py")
        run = subprocess.run(
            [python, str(script), str(spec_path), str(out_path)], capture_output=True, text=True
        )
        if not out_path.is_file():
            return {"status": "error", "reason": f"exit {run.returncode}: {run.stderr.strip()[-300:]}"}
        return json.loads(out_path.read_text())


def main() -> None:
    from batchgen.models.quant.gguf_writer import llama_cpp_output_type, write_gguf
    from batchgen.runtime import threads as thread_policy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--kv-context", type=int, default=0, help="also the decode-heavy KV run at this context")
    p.add_argument("--kv-seqs", type=int, default=16)
    p.add_argument("--kv-new", type=int, default=64)
    p.add_argument(
        "--kv-dtypes", default="float32,bfloat16,fp8", help="cache dtypes of the KV run (first: base)"
    )
    p.add_argument(
        "--kv-equal-memory", default="", help="dtypes also run at the sequences the base's memory holds"
    )
    p.add_argument(
        "--kv-rounds", type=int, default=3, help="timed rounds per KV system (the best is reported)"
    )
    p.add_argument("--skip-weights", action="store_true", help="only the --kv-context run")
    p.add_argument("--systems", default="", help="comma-separated substrings: only the systems they name")
    p.add_argument("--llamacpp-python", default=os.environ.get("BATCHGEN_LLAMACPP_PYTHON", sys.executable),
                   help="the interpreter with a llama.cpp binding that runs the llama.cpp rows")  # fmt: skip
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="batchgen-quant-bench-"))
    f32 = bench_model(root / "f32", args)
    bf16 = bench_model(root / "bf16", args, dtype=torch.bfloat16)
    systems: dict[str, tuple[str, dict]] = {
        "batchgen float32": (f32, {}),
        "batchgen bfloat16 weights": (bf16, {}),
        "batchgen float32, bf16 KV": (f32, {"kv_cache_dtype": "bfloat16"}),
        "batchgen float32, fp8 KV": (f32, {"kv_cache_dtype": "fp8"}),
    }
    wanted = [w for w in args.systems.split(",") if w]

    def keep(name: str) -> bool:
        return not wanted or any(w in name for w in wanted)

    systems = {name: v for name, v in systems.items() if keep(name)}
    ggufs = {
        name: write_gguf(f32, root / f"{name}.gguf", t, output_type=llama_cpp_output_type(t, args.hidden))
        for name, t in GGUF_TYPES.items()
        if keep(f"batchgen GGUF {name}") or (name in LLAMA_CPP_TYPES and keep(f"llama.cpp GGUF {name}"))
    }
    for name, path in ggufs.items():
        if keep(f"batchgen GGUF {name}"):
            systems[f"batchgen GGUF {name}"] = (path, {})
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    for batch in map(int, args.batches.split(",")) if not args.skip_weights else ():
        base, runs = None, {}
        for name, (path, opts) in systems.items():
            run = runs[name] = generate_run(path, batch, args, **opts)
            base = run if base is None else base
            # greedy agreement with the float32 cache on the same weights
            extra = {"drain": True} if args.drain else {}
            emit(run.row(name, batch, base if "KV" in name else None, **extra))
        for name, path in ggufs.items():
            if name not in LLAMA_CPP_TYPES or not keep(f"llama.cpp GGUF {name}"):
                continue
            # as many threads as batchgen's engine ran with last (its thread policy's count when none ran)
            threads = torch.get_num_threads() if runs else thread_policy.current().num_threads
            res = llama_cpp_peer(args.llamacpp_python, path, batch, args, threads)
            row = {"system": f"llama.cpp GGUF {name}", "seqs": batch}
            if res["status"] != "ok":
                print(json.dumps({**row, res["status"]: res["reason"]}), flush=True)
                continue
            row.update(tok_s=round(res["tok_s"], 1), tok_per_cpu_s=round(res["tok_per_cpu_s"], 1))
            if f"batchgen GGUF {name}" in runs:
                row.update(peer_agreement(res["token_ids"], runs[f"batchgen GGUF {name}"].tokens))
            emit({**row, "threads": res["threads"], "build": res["llama_cpp"]})
    if args.kv_context:
        for row in kv_decode_runs(f32, args):
            emit(row)
    from batchgen.kernels.cpu_quant_linear import integer_inputs

    print(json.dumps({"loadavg": os.getloadavg(), "threads": torch.get_num_threads(),
                      "gguf_block32_integer_inputs": integer_inputs(), "args": vars(args)}))  # fmt: skip


if __name__ == "__main__":
    main()
