"""The systems the throughput benchmark compares, each measured in its own subprocess.

``python -m batchgen.bench.systems SPEC.json RESULT.json`` runs one system on one workload: it sets the
torch thread count, loads the model (not timed), runs a short warm-up, then ``repeats`` timed runs, and
writes a JSON result with the wall time of every repeat, the generated token ids of the last repeat (in row
order), prompt tokens computed vs reused, peak memory and, for batchgen, a per-step timeline of the
engine's stats (from a step listener). A subprocess per system keeps peak memory figures apart and gives every
system a fresh interpreter.

Systems (all greedy, float32 by default, ``ignore_eos`` so every row generates exactly its ``max_tokens``):

* ``batchgen``: the full pipeline (:func:`batchgen.job.run_job`: Parquet in → prompts → prefix grouping →
  engine → Parquet parts) with ``data.group_by_prefix=true``; ``batchgen_nogroup`` the same with
  ``false``. Each repeat gets a fresh engine (empty prefix cache); the timed region is ``run_job`` (planning,
  tokenization, generation, writing), the model load is not timed. ``batchgen_llm``: ``LLM.generate`` on the
  token ids (the fallback when the pipeline is unavailable).
* ``hf_generate``: ``model.generate`` on left-padded static batches of ``hf_batch_size`` rows in input order
  (contiguous KV cache); a batch generates the longest ``max_tokens`` of its rows, each row keeps its own.
* ``hf_generate_batch``: transformers' continuous batching (``model.generate_batch``, paged attention,
  block sharing = prefix caching on) with ``page_size`` = batchgen's block size, the same number of KV token
  slots, ``max_batch_tokens`` and ``max_requests_per_batch`` as batchgen; with per-row ``max_tokens`` it uses
  the manager directly (``continuous_batching_context_manager`` + ``add_request(max_new_tokens=...)``).
* ``ct2``: CTranslate2 (float32, its converter on the same checkpoint, its best batch size from a small sweep;
  :mod:`batchgen.bench.ct2`), skipped with the reason without the ``bench-ct2`` extra.
* ``vllm`` is not run here: it runs as :mod:`batchgen.bench.vllm_child` under its own interpreter (vLLM pins its
  own torch and transformers; :mod:`batchgen.bench.launch` starts it).
* ``matmul``: not a system; measures achieved matmul FLOP/s at the model's shapes (for MFU).
* ``greedy_check``: not a system; greedy equality of batchgen's attention backends (Triton on CUDA, torch) and
  transformers in float32 (:func:`run_greedy_check`, the throughput benchmark's ``check=true``).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from batchgen.bench.common import rss_bytes
from batchgen.bench.gpu_idle import ForwardEvents

T = TypeVar("T")

SYSTEMS = ("batchgen", "batchgen_nogroup", "batchgen_llm", "hf_generate", "hf_generate_batch", "ct2")


class Skip(Exception):
    """The system cannot run here (e.g. vLLM not installed); the reason goes into the results."""


# ------------------------------------------------------------------------------------------ memory
class PeakRSS:
    """Samples this process's RSS every `interval` seconds in a thread; ``peak`` in bytes (0 where unknown)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


# ------------------------------------------------------------------------------------------- helpers
def _device(spec: dict[str, Any]) -> str:
    import torch

    d = spec.get("device", "auto")
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return d


def _engine_config(spec: dict[str, Any]) -> Any:
    """The spec's ``engine`` options (an EngineConfig as a dict) on the spec's device."""
    from batchgen.engine.config import EngineConfig

    return EngineConfig(**{**spec["engine"], "device": _device(spec)})


def _load_workload(spec: dict[str, Any]) -> dict[str, Any]:
    from batchgen.bench.workloads import read_workload

    return read_workload(spec["workload_path"])


def _warm_prompts(w: dict[str, Any], n: int = 4, length: int = 24) -> list[list[int]]:
    """Short warm-up prompts: reversed slices of the workload (they share no prefix with it)."""
    return [list(reversed(t[:length])) for t in w["token_ids"][:n]]


class _Timeline:
    """A step listener recording (t, running, waiting, kv_usage, kv_utilization) after every engine step, t in
    seconds since the listener was added (just before ``run_job``)."""

    def __init__(self, engine: Any) -> None:
        self.t0 = time.perf_counter()
        self.rows: list[list[float]] = []
        engine.add_step_listener(self)

    def __call__(self, info: Any) -> None:
        s = info.stats
        self.rows.append(
            [
                round(time.perf_counter() - self.t0, 4),
                s.running_seqs,
                s.waiting_seqs,
                round(s.kv_usage, 4),
                round(s.kv_utilization, 4),
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "columns": ["t", "running_seqs", "waiting_seqs", "kv_usage", "kv_utilization"],
            "rows": self.rows,
        }


# ------------------------------------------------------------------------------------------ batchgen
def _job_config(spec: dict[str, Any], out_dir: str, group: bool) -> Any:
    from batchgen.job.config import DataOptions, JobConfig, ModelOptions, RunOptions
    from batchgen.sampling_params import SamplingParams

    per_row = len(set(_load_workload(spec)["max_tokens"])) > 1
    return JobConfig(
        model=ModelOptions(path=spec["model_path"], dtype=spec["dtype"]),
        data=DataOptions(
            input=spec["workload_path"],
            output=out_dir,
            prompt_column="prompt",
            id_column="id",
            sampling_column="sampling" if per_row else None,
            window_rows=spec["window_rows"],
            group_by_prefix=group,
            overwrite=True,
        ),
        engine=_engine_config(spec),
        sampling=SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, seed=0),
        run=RunOptions(progress="off"),
    )


def _read_job_output(out_dir: str) -> tuple[dict[int, list[int]], dict[int, int]]:
    import pyarrow.parquet as pq

    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    for p in sorted(Path(out_dir).glob("**/part-*.parquet")):
        t = pq.read_table(p, columns=["id", "token_ids", "num_cached_tokens", "status", "error"])
        for rid, ids, c, status, err in zip(*(t.column(i).to_pylist() for i in range(5))):
            if status != "ok":
                raise RuntimeError(f"row {rid} failed in the batchgen pipeline: {err}")
            tokens[int(rid)] = list(ids)
            cached[int(rid)] = int(c or 0)
    return tokens, cached


def _warm_engine(engine: Any, w: dict[str, Any]) -> None:
    from batchgen.driver import EngineRequest, run_requests
    from batchgen.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    warm = [EngineRequest(f"warmup-{i}", p, params) for i, p in enumerate(_warm_prompts(w))]
    run_requests(engine, warm, lambda finished: None)


def _batchgen_route(system: str) -> tuple[str, str]:
    """(system actually run, how): the pipeline, or ``LLM.generate`` for ``batchgen_llm`` or when the
    pipeline cannot be imported."""
    if system == "batchgen_llm":
        return system, "LLM.generate"
    try:
        import batchgen.job  # noqa: F401
    except ImportError as e:  # pipeline not available: fall back to the engine API
        return "batchgen_llm", f"LLM.generate (pipeline import failed: {e})"
    return system, "pipeline (batchgen.job.run_job)"


def _batchgen_once(
    engine: Any, spec: dict[str, Any], w: dict[str, Any], system: str, group: bool, prof: Any
) -> tuple[float, int, dict[int, list[int]], dict[int, int], Any]:
    """One timed run on a warmed engine: (wall seconds, peak RSS, tokens, cached tokens, profiler)."""
    with tempfile.TemporaryDirectory(prefix="bench-job-") as out_dir, PeakRSS() as mem:
        _reset_cuda_peak()
        t0 = time.perf_counter()
        with prof as p:
            if system == "batchgen_llm":
                tokens, cached = _run_llm(engine, w)
            else:
                from batchgen.job import run_job

                res = run_job(
                    _job_config(spec, out_dir, group),
                    engine=engine,
                    handle_signals=False,
                    print_summary=False,
                )
                if res.exit_code != 0:
                    raise RuntimeError(f"run_job failed ({res.exit_code}): {res.message}")
        _sync()
        wall = time.perf_counter() - t0
        if system != "batchgen_llm":
            tokens, cached = _read_job_output(out_dir)
    return wall, mem.peak, tokens, cached, p


def run_batchgen(spec: dict[str, Any], profile: str | None = None) -> dict[str, Any]:
    """The pipeline (``run_job``) with a fresh engine per repeat; or LLM.generate for ``batchgen_llm``.
    With ``profile``, one more run under the profiler (not timed)."""
    from batchgen.engine.core.llm_engine import LLMEngine

    system, via = _batchgen_route(spec["system"])
    w = _load_workload(spec)
    group = spec["system"] != "batchgen_nogroup"
    walls: list[float] = []
    peak = base_rss = 0
    res: dict[str, Any] = {"profile": ""}
    for rep in range(spec["repeats"] + (1 if profile else 0)):
        profiling = profile is not None and rep == spec["repeats"]
        t_init = time.perf_counter()
        engine = LLMEngine(spec["model_path"], _engine_config(spec), dtype=spec["dtype"])
        sizing = _kv_sizing(engine, time.perf_counter() - t_init)
        _warm_engine(engine, w)
        before = engine.stats.snapshot()
        tl = _Timeline(engine)
        idle = ForwardEvents(engine) if engine.device.type == "cuda" else None
        base_rss = max(base_rss, rss_bytes())
        prof = _profiler(profile) if profiling else contextlib.nullcontext()
        wall, mem_peak, tokens, cached, p = _batchgen_once(engine, spec, w, system, group, prof)
        if profiling:
            res["profile"] = _profile_text(profile, p)
            continue
        walls.append(wall)
        peak = max(peak, mem_peak)
        res.update(engine_stats=engine.stats.delta(before).to_dict(), timeline=tl.to_dict(), kv_sizing=sizing)
        res["thread_policy"] = engine.thread_policy.reason
        res.update(tokens=tokens, cached=cached, gpu_idle=idle.summary(wall) if idle else None)
        del engine
    ids = w["ids"]
    tokens, cached = res.pop("tokens", {}), res.pop("cached", {})
    return {
        **res,
        "via": via,
        "wall_s": walls,
        "token_ids": [tokens[i] for i in ids],
        # reused: whole blocks shared (the rows' num_cached_tokens) and tokens copied from a cached block
        "prompt_tokens_cached": sum(cached.get(i, 0) for i in ids)
        + res.get("engine_stats", {}).get("prompt_tokens_copied", 0),
        "cached_per_row": [cached.get(i, 0) for i in ids],
        "peak_rss": peak,
        "base_rss": base_rss,
        "settings": {
            "group_by_prefix": group if system != "batchgen_llm" else None,
            "engine": asdict(_engine_config(spec)),
            "window_rows": spec["window_rows"],
            "threads": res.get("thread_policy"),
        },
    }


def _kv_sizing(engine: Any, init_s: float) -> dict[str, Any]:
    """How the engine sized its KV pool (num_blocks, gpu_memory_utilization on CUDA, kv_cache_memory on CPU)."""
    cfg, st = engine.config, engine.stats
    if cfg.num_blocks is not None:
        source = f"engine.num_blocks={cfg.num_blocks}"
    elif engine.device.type == "cuda":
        source = f"engine.gpu_memory_utilization={cfg.gpu_memory_utilization} (profiled activations)"
    else:
        source = f"engine.kv_cache_memory={cfg.kv_cache_memory}"
    return {
        "source": source,
        "num_blocks": st.num_blocks,
        "kv_cache_bytes": st.num_blocks * st.bytes_per_block,
        "token_slots": st.num_blocks * st.block_size,
        "engine_init_s": init_s,
    }


def _run_llm(engine: Any, w: dict[str, Any]) -> tuple[dict[int, list[int]], dict[int, int]]:
    from batchgen.driver import EngineRequest, run_requests
    from batchgen.sampling_params import SamplingParams

    requests = [
        EngineRequest(rid, p, SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True))
        for rid, p, mt in zip(w["ids"], w["token_ids"], w["max_tokens"])
    ]
    tokens, cached = {}, {}

    def collect(finished: list[Any]) -> None:
        for out in finished:
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            cached[out.request_id] = out.num_cached_tokens

    run_requests(engine, requests, collect)
    return tokens, cached


# -------------------------------------------------------------------------------------- profiling
class _TorchProf:
    def __enter__(self) -> Any:
        import torch

        self.p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        return self.p.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.p.__exit__(*exc)


class _CProf:
    def __enter__(self) -> cProfile.Profile:
        self.p = cProfile.Profile()
        self.p.enable()
        return self.p

    def __exit__(self, *exc: Any) -> None:
        self.p.disable()


def _profiler(kind: str) -> Any:
    return _TorchProf() if kind == "torch" else _CProf()


def _profile_text(kind: str, p: Any) -> str:
    if kind == "torch":
        return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    s = io.StringIO()
    st = pstats.Stats(p, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    return s.getvalue()


# -------------------------------------------------------------------------------------- transformers
def _hf_model(spec: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        spec["dtype"], torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=dtype).to(_device(spec)).eval()
    # ignore_eos: nothing stops a sequence before max_new_tokens
    model.generation_config.eos_token_id = None
    return model


def _reset_cuda_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_repeats(
    run: Callable[[], T], repeats: int, before: Callable[[], None] | None = None
) -> tuple[list[float], int, T]:
    """``repeats`` timed calls of ``run`` (``before`` untimed ahead of each): (wall seconds of each, peak RSS
    over all, the last call's result)."""
    walls: list[float] = []
    peak = 0
    result: Any = None
    for _ in range(repeats):
        if before is not None:
            before()
        _reset_cuda_peak()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            result = run()
            _sync()
            walls.append(time.perf_counter() - t0)
        peak = max(peak, mem.peak)
    return walls, peak, result


def _left_padded(prompts: list[list[int]], pad: int, dev: Any) -> tuple[Any, Any]:
    """Left-padded ``[B, T]`` input ids and attention mask."""
    import torch

    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = 1
    return ids.to(dev), mask.to(dev)


def _hf_static_batches(
    model: Any, prompts: list[list[int]], max_tokens: list[int], bs: int
) -> tuple[list[list[int]], int]:
    """``model.generate`` over static batches of ``bs`` rows in input order: (tokens per row, pad tokens).

    eos is off twice over: ``model.generation_config.eos_token_id`` is None (:func:`_hf_model`; transformers
    5.x fills unset fields of a passed GenerationConfig from it) and the passed config sets none either."""
    import torch
    from transformers import GenerationConfig

    assert model.generation_config.eos_token_id is None
    pad = model.generation_config.pad_token_id or 0
    out: list[list[int]] = []
    padded = 0
    for s in range(0, len(prompts), bs):
        ps, mts = prompts[s : s + bs], max_tokens[s : s + bs]
        ids, mask = _left_padded(ps, pad, model.device)
        padded += ids.numel() - int(mask.sum())
        gc = GenerationConfig(
            max_new_tokens=max(mts), min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=pad
        )
        with torch.no_grad():
            res = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        for g, mt in zip(res[:, ids.shape[1] :].tolist(), mts):
            if len(g) < mt:
                raise RuntimeError(f"hf generate stopped early ({len(g)} < {mt} tokens)")
            out.append(g[:mt])
    return out, padded


def run_hf_generate(spec: dict[str, Any]) -> dict[str, Any]:
    """Left-padded static batches of ``hf_batch_size`` rows in input order."""
    w = _load_workload(spec)
    model = _hf_model(spec)
    bs = spec["hf_batch_size"]
    _hf_static_batches(model, _warm_prompts(w), [4] * 4, bs)
    base = rss_bytes()
    walls, peak, (tokens, padded) = timed_repeats(
        lambda: _hf_static_batches(model, w["token_ids"], w["max_tokens"], bs), spec["repeats"]
    )
    settings = {"batch_size": bs, "padding_side": "left", "cache": "DynamicCache (contiguous)"}
    via = f"model.generate, left-padded static batches of {bs} (input order)"
    return uncached_result(via, walls, tokens, peak, base, settings, pad_tokens=padded)


def uncached_result(
    via: str, walls: list[float], tokens: list[list[int]], peak: int, base: int, settings: dict, **extra: Any
) -> dict[str, Any]:
    """The result of a system that reuses no prompt tokens across rows (no prefix cache)."""
    return {
        "via": via,
        "wall_s": walls,
        "token_ids": tokens,
        "prompt_tokens_cached": 0,
        "cached_per_row": [0] * len(tokens),
        "peak_rss": peak,
        "base_rss": base,
        **extra,
        "settings": settings,
    }


def _count_prefix_hits() -> dict[str, int]:
    """Wrap transformers' PagedAttentionCache.search_prefix_match to count prompt tokens served from cache."""
    from transformers.generation.continuous_batching import cache as cb_cache

    counter = {"tokens": 0}
    cls = cb_cache.PagedAttentionCache
    inner = cls.search_prefix_match

    def wrapped(self: Any, request_id: str, prompt_ids: list[int]) -> int:
        n = inner(self, request_id, prompt_ids)
        counter["tokens"] += int(n or 0)
        return n

    cls.search_prefix_match = wrapped
    return counter


def _cb_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """ContinuousBatchingConfig matching batchgen's engine: page size, KV slots, token and sequence caps."""
    e = spec["engine"]
    return dict(
        page_size=e["block_size"],
        num_blocks=max(1, spec["kv_token_slots"] // e["block_size"]),
        max_batch_tokens=e["max_num_batched_tokens"],
        max_requests_per_batch=e["max_num_seqs"],
        allow_block_sharing=True,
        seed=0,
    )


def _hf_continuous(
    model: Any, prompts: list[list[int]], max_tokens: list[int], cb_kwargs: dict[str, Any]
) -> list[list[int]]:
    """transformers' continuous batching; per-row ``max_tokens`` through the manager directly."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pad = model.generation_config.pad_token_id or 0
    gc = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=-1, pad_token_id=pad)
    cbc = ContinuousBatchingConfig(**cb_kwargs)
    if len(set(max_tokens)) == 1:
        res = model.generate_batch(
            inputs=prompts, generation_config=gc, continuous_batching_config=cbc, warmup=False
        )
        outs = list(res.values())  # in input order
    else:  # per-row max_new_tokens: drive the manager directly, in generate_batch's (sorted) order
        order = sorted(range(len(prompts)), key=lambda i: prompts[i], reverse=True)
        results: dict[str, Any] = {}
        with model.continuous_batching_context_manager(
            generation_config=gc, continuous_batching_config=cbc, block=True, timeout=5, warmup=False
        ) as manager:
            for i in order:
                manager.add_request(
                    prompts[i], request_id=f"r{i}", max_new_tokens=max_tokens[i], eos_token_id=-1
                )
            while len(results) < len(prompts):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers continuous batching thread stopped")
        outs = [results[f"r{i}"] for i in range(len(prompts))]
    tokens = []
    for o, mt in zip(outs, max_tokens):
        if o.error:
            raise RuntimeError(f"generate_batch request failed: {o.error}")
        tokens.append(list(o.generated_tokens)[:mt])
    return tokens


def run_hf_generate_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers continuous batching with paged attention and prefix sharing."""
    import torch

    w = _load_workload(spec)
    model = _hf_model(spec)
    cb_kwargs = _cb_kwargs(spec)
    hits = _count_prefix_hits()
    uniform = len(set(w["max_tokens"])) == 1
    with torch.no_grad():
        _hf_continuous(model, _warm_prompts(w), [4] * 4, cb_kwargs)
        base = rss_bytes()
        walls, peak, tokens = timed_repeats(
            lambda: _hf_continuous(model, w["token_ids"], w["max_tokens"], cb_kwargs),
            spec["repeats"],
            before=lambda: hits.update(tokens=0),
        )
    return {
        "via": "model.generate_batch" if uniform else "continuous_batching_context_manager + add_request",
        "wall_s": walls,
        "token_ids": tokens,
        "prompt_tokens_cached": hits["tokens"],
        "cached_per_row": None,
        "peak_rss": peak,
        "base_rss": base,
        "settings": {"attn_implementation": str(model.config._attn_implementation), **cb_kwargs},
    }


# ------------------------------------------------------------------------------------ greedy check
CHECK_PROMPT_LENS = (1, 15, 16, 17, 100, 300)


def run_greedy_check(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy equality in float32 on prompts around block boundaries: batchgen with every attention backend
    the device has (Triton needs CUDA) against each other and against transformers' ``generate``.

    ``passed`` is Triton == torch token for token (when both ran); mismatches against transformers are
    reported (float32 sums in a different order may flip a near-tie)."""
    import random

    import torch

    from batchgen.llm import LLM
    from batchgen.sampling_params import SamplingParams

    dev = _device(spec)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path, max_tokens = spec["model_path"], spec["max_tokens"]
    rng = random.Random(0)
    vocab = spec.get("vocab_size", 4096)
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in CHECK_PROMPT_LENS]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    backends = ["triton", "torch"] if dev.startswith("cuda") else ["torch"]
    outs: dict[str, list[list[int]]] = {}
    for backend in backends:
        llm = LLM(path, dtype="float32", attention_backend=backend, num_blocks=512, device=dev)
        outs[backend] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        del llm
    model = _hf_model({**spec, "dtype": "float32"})
    ref = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(
                torch.tensor([p], device=model.device), max_new_tokens=max_tokens, do_sample=False
            )
            ref.append(g[0, len(p) :].tolist())

    def mismatches(a: list[list[int]], b: list[list[int]]) -> int:
        return sum(x != y for x, y in zip(a, b))

    counts = {f"{b} vs transformers": mismatches(outs[b], ref) for b in backends}
    if len(backends) == 2:
        counts["triton vs torch"] = mismatches(outs["triton"], outs["torch"])
    return {
        "prompt_lens": list(CHECK_PROMPT_LENS),
        "max_tokens": max_tokens,
        "backends": backends,
        "not_run": [] if len(backends) == 2 else ["triton (needs CUDA)"],
        "mismatching_prompts": counts,
        "passed": counts.get("triton vs torch", 0) == 0,
    }


# ------------------------------------------------------------------------------------------ matmul
def run_matmul(spec: dict[str, Any]) -> dict[str, Any]:
    """Achieved FLOP/s of ``[M, K] @ [K, N]`` at the model's linear shapes, M in ``matmul_rows``: the plain
    matmul and, for float32 on the CPU, oneDNN's packed linear and batchgen's own (its 16-column panels, what
    batchgen's models use there where its C kernels build); the peak is the best of every kernel and shape."""
    import torch

    from batchgen.kernels import cpu_linear
    from batchgen.models.packed_linear import BATCH_HINT, onednn_available

    dev = _device(spec)
    dtype = getattr(torch, spec["dtype"]) if spec["dtype"] != "auto" else torch.float32
    cpu32 = dev == "cpu" and dtype == torch.float32
    packed, panels = cpu32 and onednn_available(), cpu32 and cpu_linear.available()
    seconds = spec.get("matmul_seconds", 0.3)
    rows = []
    for m in spec["matmul_rows"]:
        for name, k, n in spec["matmul_shapes"]:  # [[name, K, N], ...]
            a = torch.randn(m, k, dtype=dtype, device=dev)
            b = torch.randn(k, n, dtype=dtype, device=dev)
            kernels = {"matmul": lambda a=a, b=b: a @ b}
            if packed:
                w = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), BATCH_HINT)
                kernels["onednn"] = lambda a=a, w=w: torch.ops.mkldnn._linear_pointwise(
                    a, w, None, "none", [], ""
                )
            if panels:
                p = cpu_linear.pack(b.t())
                kernels["batchgen"] = lambda a=a, p=p, n=n: cpu_linear.linear(a, p, None, n)
            for kernel, fn in kernels.items():
                rate = 2 * m * k * n / _seconds_per_call(fn, seconds)
                rows.append({"m": m, "name": name, "k": k, "n": n, "kernel": kernel, "flops_per_s": rate})
    return {"shapes": rows, "peak_flops_per_s": max(r["flops_per_s"] for r in rows)}


def _seconds_per_call(fn: Any, seconds: float) -> float:
    for _ in range(3):
        fn()
    _sync()
    iters, t0 = 0, time.perf_counter()
    while True:
        fn()
        iters += 1
        if iters % 4 == 0:
            _sync()
            if time.perf_counter() - t0 > seconds:
                break
    return (time.perf_counter() - t0) / iters


# --------------------------------------------------------------------------------------------- main
def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(0)
    system = spec["system"]
    t0 = time.perf_counter()
    # the machine's matmul speed right now, beside this system's run (shared machines drift)
    matmul = (
        run_matmul(spec) if spec.get("matmul_shapes") and system not in ("matmul", "greedy_check") else None
    )
    try:
        if system == "matmul":
            res = run_matmul(spec)
        elif system == "greedy_check":
            res = run_greedy_check(spec)
        elif system.startswith("batchgen"):
            res = run_batchgen(spec, profile=spec.get("profile"))
        elif system == "hf_generate":
            res = run_hf_generate(spec)
        elif system == "hf_generate_batch":
            res = run_hf_generate_batch(spec)
        elif system == "ct2":
            from batchgen.bench.ct2 import run_ct2

            res = run_ct2(spec)
        else:
            raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        res["status"] = "ok"
    except Skip as e:
        res = {"status": "skipped", "reason": str(e)}
    res["system"] = system
    if matmul is not None:
        res["matmul"] = matmul
    res["threads"] = torch.get_num_threads()
    res["device"] = _device(spec)
    res["process_seconds"] = time.perf_counter() - t0
    res["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if torch.cuda.is_available() and res["device"].startswith("cuda"):
        res["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m batchgen.bench.systems SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    res = run(spec)
    tmp = argv[1] + ".tmp"
    Path(tmp).write_text(json.dumps(res))
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
