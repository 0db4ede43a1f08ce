"""llama.cpp as a peer of the quantization benchmark, run as a script under the interpreter that has it.

    /path/to/llamacpp-venv/bin/python batchgen/bench/llamacpp_peer.py SPEC.json RESULT.json

The binding is llama-cpp-python (``llama_cpp``: ctypes over a shared llama.cpp, here built from source with
``GGML_NATIVE``) where importable, else `cyllama <https://pypi.org/project/cyllama/>`_ (a Cython binding whose
manylinux wheels link llama.cpp, an AVX2 build). Either lives in its own virtual environment or beside batchgen
(``pip install batchgen[bench-llamacpp]`` installs cyllama); this file imports nothing from batchgen, only the
standard library and the binding. The parent (:mod:`batchgen.bench.quant`) writes the spec: ``path`` (a GGUF
file), ``prompts`` (token ids, one list per sequence), ``max_tokens``, ``threads``.

What runs is llama.cpp's batched decode through its C API (``llama_batch`` / ``llama_decode``), as its
``batched`` example does: one sequence id per prompt, all prompts prefilled in one batch (split into
``n_ubatch`` micro-batches by llama.cpp), then one decode call per step holding every sequence's last token,
each next token chosen by llama.cpp's greedy sampler on that sequence's logits; ``max_tokens`` tokens per
sequence, end-of-sequence tokens ignored (batchgen's ``ignore_eos``). llama.cpp's defaults otherwise (f16 KV
cache, flash attention ``auto``, one KV stream per sequence). ``threads`` is ``n_threads`` and
``n_threads_batch``. A short warm-up on two prompts runs first and its KV cache is cleared; model load is not
timed.

Result keys: ``status`` (``ok``; ``skipped`` with the reason when neither binding can be imported; ``error``),
``tok_s`` (generated tokens per wall second), ``tok_per_cpu_s`` (per second of this process's CPU time, all its
threads), ``wall_s``, ``cpu_s``, ``token_ids`` (row order), ``llama_cpp`` (the llama.cpp build), ``python``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is sys.path[0]; its sibling modules would shadow packages of those names.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


class CyllamaPeer:
    """llama.cpp through cyllama's wrappers of the C API: one GGUF model and a context sized for ``n_seqs``
    sequences of up to ``n_tokens`` tokens each."""

    def __init__(self, path: str, n_seqs: int, n_tokens: int, threads: int, verbose: bool = False) -> None:
        import cyllama
        from cyllama._internal import build_config
        from cyllama.llama import llama_cpp as cp

        v = build_config.versions()
        self.build = f"llama.cpp {v['llama_cpp_version']} (cyllama {cyllama.__version__} wheel)"
        if not verbose:
            cp.disable_logging()
        cp.ggml_backend_load_all()
        mp = cp.LlamaModelParams()
        mp.n_gpu_layers = 0
        self.model = cp.LlamaModel(path, mp)
        params = cp.LlamaContextParams()
        params.n_seq_max = n_seqs
        params.n_ctx = n_seqs * n_tokens  # one KV stream of n_tokens per sequence (llama.cpp pads to 256)
        params.n_batch = max(512, n_seqs * n_tokens)
        params.n_threads = threads
        params.n_threads_batch = threads
        self.ctx = cp.LlamaContext(self.model, params)
        self.sampler = cp.LlamaSampler(cp.LlamaSamplerChainParams())
        self.sampler.add_greedy()
        self.batch = cp.LlamaBatch(n_tokens=params.n_batch, embd=0, n_seq_max=1)

    def clear_batch(self) -> None:
        self.batch.clear()

    def add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        self.batch.add(token, pos, [seq], logits)

    def decode(self) -> None:
        self.ctx.decode(self.batch)

    def sample(self, row: int) -> int:
        return self.sampler.sample(self.ctx, row)

    def clear_cache(self) -> None:
        self.ctx.kv_cache_clear()


class LlamaCppPythonPeer:
    """llama.cpp through llama-cpp-python's ctypes bindings of the C API (the same calls as `CyllamaPeer`)."""

    def __init__(self, path: str, n_seqs: int, n_tokens: int, threads: int, verbose: bool = False) -> None:
        import llama_cpp

        lc = self.lc = llama_cpp
        info = lc.llama_print_system_info().decode()
        simd = " ".join(f for f in info.replace("|", " ").split() if f.startswith("AVX"))
        self.build = f"llama.cpp of llama-cpp-python {lc.__version__} ({simd or info.strip()})"
        if not verbose:
            self._quiet = lc.llama_log_callback(lambda level, text, data: None)
            lc.llama_log_set(self._quiet, None)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_seq_max = n_seqs
        params.n_ctx = n_seqs * n_tokens
        params.n_batch = max(512, n_seqs * n_tokens)
        params.n_threads = threads
        params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.sampler = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_greedy())
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)

    def clear_batch(self) -> None:
        self.batch.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        b, k = self.batch, self.batch.n_tokens
        b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = token, pos, 1, logits
        b.seq_id[k][0] = seq
        b.n_tokens = k + 1

    def decode(self) -> None:
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def sample(self, row: int) -> int:
        return self.lc.llama_sampler_sample(self.sampler, self.ctx, row)

    def clear_cache(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)


def generate(peer: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuation of every prompt, `max_tokens` tokens each: all prompts in one batch, then one batched
    decode per step of every sequence's last token."""
    peer.clear_batch()
    last = []  # each sequence's row in the batch whose logits choose its next token
    row = 0
    for s, ids in enumerate(prompts):
        for i, t in enumerate(ids):
            peer.add(t, i, s, i == len(ids) - 1)
        row += len(ids)
        last.append(row - 1)
    peer.decode()
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(max_tokens):
        nxt = [peer.sample(k) for k in last]
        for s, t in enumerate(nxt):
            out[s].append(t)
        if step == max_tokens - 1:
            break
        peer.clear_batch()
        for s, t in enumerate(nxt):
            peer.add(t, len(prompts[s]) + step, s, True)
        last = list(range(len(prompts)))
        peer.decode()
    return out


def binding() -> tuple[type | None, str]:
    """The llama.cpp binding this interpreter has (llama-cpp-python first, then cyllama), or None and why."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        return LlamaCppPythonPeer, "llama_cpp"
    if importlib.util.find_spec("cyllama") is not None:
        return CyllamaPeer, "cyllama"
    return None, f"no llama.cpp binding (llama_cpp or cyllama) importable by {sys.executable}"


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The timed greedy run the spec describes (see the module docstring)."""
    cls, why = binding()
    if cls is None:
        return {"status": "skipped", "reason": why}
    prompts, new = spec["prompts"], int(spec["max_tokens"])
    longest = max(map(len, prompts)) + new
    peer = cls(spec["path"], len(prompts), longest, int(spec["threads"]), bool(spec.get("verbose")))
    generate(peer, prompts[:2], min(4, new))  # warm-up
    peer.clear_cache()
    start, cpu = time.perf_counter(), time.process_time()
    tokens = generate(peer, prompts, new)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = len(prompts) * new
    return {
        "status": "ok",
        "tok_s": n / wall,
        "tok_per_cpu_s": n / cpu,
        "wall_s": wall,
        "cpu_s": cpu,
        "token_ids": tokens,
        "llama_cpp": peer.build,
        "threads": int(spec["threads"]),
        "python": sys.executable,
    }


def answer(spec_path: str, out_path: str) -> None:
    """Run the spec at `spec_path`; write the result to `out_path` atomically (an exception: status error)."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        res = run(spec)
    except Exception as e:  # the parent reports it as this system's error row
        traceback.print_exc()
        res = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    tmp = out_path + ".tmp"
    Path(tmp).write_text(json.dumps(res))
    os.replace(tmp, out_path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: llamacpp_peer.py SPEC.json RESULT.json", file=sys.stderr)
        return 2
    answer(argv[0], argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
