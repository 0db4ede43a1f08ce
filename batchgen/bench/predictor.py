"""Predictor benchmark: how far to trust the dry run's plan.

    python -m batchgen.bench.predictor                      # every workload
    python -m batchgen.bench.predictor --workloads mix --scale 2 --json out.json

Each workload (an input built here, seeded; none was used to tune the predictor) runs as a dry run
(``run.dry_run=true``: tokenizing, prefix-cache simulation, calibration on this machine), then as the real job
into the same output, each with its own engine. The table puts the plan's ``predicted.wall_time_s`` (and its
range) beside the report's ``run.wall_time_s``, and ``predicted.prefix_hit_rate`` beside
``tokens.prefix_hit_rate``, with the calibration's cost as a fraction of the predicted time. Goals: wall time
within +-25 percent and inside the range, hit rate within 0.05, calibration <= 5 percent. Figures, not
assertions: no test times this. The machine's 1-minute load average at calibration and at the job's end (the
report's ``prediction.load``) is printed with the figures: on a shared machine it explains most misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("what is the capital of a country number and why how many people live there in which year did the "
         "river flow through city mountain north south east west old new large small").split()  # fmt: skip
INSTRUCTION = (
    "You are a careful assistant. Read the question and answer it briefly and precisely, in one sentence, "
    "without repeating the question and without citing any sources. "
)


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@dataclass
class Workload:
    """One input and its job settings."""

    name: str
    describe: str
    rows: Callable[[random.Random, int], list[str]]
    num_rows: int
    sampling: dict[str, Any]
    engine: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    model: str = "tiny"
    task: str = "generate"
    continuations: Callable[[random.Random, int], list[str]] | None = None
    """A scoring workload's ``continuation`` column (None: the prompts are scored whole, rolling)."""


def _shared_instruction(rng: random.Random, n: int) -> list[str]:
    return [INSTRUCTION + f"Question {i}: {_words(rng, 3, 60)}?" for i in range(n)]


def _per_row_first(rng: random.Random, n: int) -> list[str]:
    return [f"Ticket {rng.randint(0, 10**6)} ({_words(rng, 1, 4)}): " + INSTRUCTION + _words(rng, 5, 15)
            for _ in range(n)]  # fmt: skip


def _long_short(rng: random.Random, n: int) -> list[str]:
    return [_words(rng, 150, 300) if rng.random() < 0.15 else _words(rng, 5, 20) for _ in range(n)]


def _few_prefixes(rng: random.Random, n: int) -> list[str]:
    heads = [INSTRUCTION * (k + 1) for k in range(3)]
    return [rng.choice(heads) + _words(rng, 2, 30) for _ in range(n)]


WORKLOADS = {
    "shared": Workload(
        "shared",
        "shared instruction first, mixed question lengths; greedy, 32 tokens, tiny",
        _shared_instruction,
        480,
        {"temperature": 0.0, "max_tokens": 32},
        {"max_num_seqs": 16},
        {"window_rows": 128},
    ),  # fmt: skip
    "per-row-first": Workload(
        "per-row-first",
        "per-row ticket id before the shared instruction; T=0.8 top_p=0.9, 48 tokens, tiny",
        _per_row_first,
        400,
        {"temperature": 0.8, "top_p": 0.9, "max_tokens": 48},
        {"max_num_seqs": 32},
        {"window_rows": 100},
    ),  # fmt: skip
    "mix": Workload(
        "mix",
        "15% long (150-300 words) / 85% short prompts, no sharing; T=1.0, 24 tokens, random "
        "llama (hidden 64, 2 layers)",
        _long_short,
        320,
        {"temperature": 1.0, "max_tokens": 24},
        {"max_num_seqs": 16},
        {"window_rows": 64},
        model="llama",
    ),  # fmt: skip
    "stop": Workload(
        "stop",
        "3 instruction prefixes of 1-3x, input order (data.group_by_prefix=false); T=0.7, "
        "stop at '.', 64 tokens, tiny",
        _few_prefixes,
        360,
        {"temperature": 0.7, "max_tokens": 64, "stop": ["."]},
        {"max_num_seqs": 24},
        {"window_rows": 90, "group_by_prefix": False},
    ),  # fmt: skip
    "kv-bound": Workload(
        "kv-bound",
        "no sharing, 20-60 word prompts, 96 tokens at T=0.8, 48 sequences on a KV pool of 192 blocks (the pool "
        "binds: sequences wait and are preempted as contexts grow); tiny",
        lambda rng, n: [_words(rng, 20, 60) for _ in range(n)],
        240,
        {"temperature": 0.8, "max_tokens": 96},
        {"max_num_seqs": 48, "num_blocks": 192},
        {"window_rows": 120},
    ),  # fmt: skip
}

HELD_OUT = {
    "samples": Workload(
        "samples",
        "n=3 samples per row at T=0.9, top_k 40, 40 tokens; prompts 2-90 words, a third after a shared "
        "instruction; 30 sequences, windows of 60; tiny",
        lambda rng, n: [(INSTRUCTION if rng.random() < 0.33 else "") + _words(rng, 2, 90) for _ in range(n)],
        200,
        {"temperature": 0.9, "top_k": 40, "max_tokens": 40, "n": 3},
        {"max_num_seqs": 30},
        {"window_rows": 60},
    ),  # fmt: skip
    "wide": Workload(
        "wide",
        "a larger random Llama (hidden 128, 4 layers); prompts 30-120 words, a few 400; T=0.8 top_p 0.95, "
        "64 tokens; 8 sequences, 256-token prefill chunks, windows of 50",
        lambda rng, n: [
            _words(rng, 400, 420) if rng.random() < 0.05 else _words(rng, 30, 120) for _ in range(n)
        ],
        120,
        {"temperature": 0.8, "top_p": 0.95, "max_tokens": 64},
        {"max_num_seqs": 8, "max_num_batched_tokens": 256},
        {"window_rows": 50},
        model="llama-wide",
    ),  # fmt: skip
}
"""Workloads added after the predictor's last change, for checking it on shapes it was not tuned on: other
sampling (n > 1, top_k), another model size, chunked prefill. Run with ``--workloads samples,wide``."""

PROMPT_ONLY = {
    "embed": Workload(
        "embed",
        "task=embed, last-token pooling on the paged engine: a shared instruction before two thirds of 5-200 "
        "word passages; windows of 500; tiny",
        lambda rng, n: [(INSTRUCTION if rng.random() < 0.67 else "") + _words(rng, 5, 200) for _ in range(n)],
        3000,
        {},
        {},
        {"window_rows": 500},
        task="embed",
    ),  # fmt: skip
    "score": Workload(
        "score",
        "task=score: 1-25 word continuations of 40 shared contexts of 20-150 words; llama (hidden 64)",
        lambda rng, n: [_words(random.Random(i % 40), 20, 150) for i in range(n)],
        2000,
        {},
        {},
        {"window_rows": 400, "continuation_column": "continuation"},
        model="llama",
        task="score",
        continuations=lambda rng, n: [" " + _words(rng, 1, 25) for _ in range(n)],
    ),  # fmt: skip
    "score-rolling": Workload(
        "score-rolling",
        "task=score over whole texts of 10-300 words (rolling log-likelihood: every token's logits); tiny",
        lambda rng, n: [_words(rng, 10, 300) for _ in range(n)],
        1500,
        {},
        {},
        {"window_rows": 300},
        task="score",
    ),  # fmt: skip
}
"""Jobs that only read their prompts (pooling, scoring): no output tokens; their plans calibrate by running a
sample of rows. Run with ``--workloads embed,score,score-rolling``."""

MODELS = {"llama": {"hidden_size": 64, "num_layers": 2}, "llama-wide": {"hidden_size": 128, "num_layers": 4}}


def _model_path(kind: str, root: Path) -> str | None:
    if kind == "tiny":
        return None
    from batchgen.models.tiny import build_checkpoint

    out = root / f"ckpt-{kind}"
    if not out.exists():
        build_checkpoint(out, "llama", **MODELS[kind])
    return str(out)


def _overrides(cfg: Any, w: Workload) -> list[str]:
    """The command line of ``cfg`` (a workload's job) as Hydra overrides."""

    def value(v: Any) -> str:
        return (
            json.dumps(v) if isinstance(v, (list, str)) else str(v).lower() if isinstance(v, bool) else str(v)
        )

    out = [f"task={w.task}", f"data.input={cfg.data.input}", f"data.output={cfg.data.output}", "engine.device=cpu",
           "run.progress=off", f"plan.reuse_step_model={value(cfg.plan.reuse_step_model)}"]  # fmt: skip
    if cfg.model.path:
        out.append(f"model.path={cfg.model.path}")
    for group, items in (("data", w.data), ("engine", w.engine), ("sampling", w.sampling)):
        out += [f"{group}.{k}={value(v)}" for k, v in items.items()]
    return out


def _run(cfg: Any, w: Workload, processes: bool) -> None:
    """The job (or its dry run, ``cfg.run.dry_run``): in this process, or as its own ``python -m batchgen``."""
    from batchgen.job.run import run_job

    if not processes:
        res = run_job(cfg, handle_signals=False, print_summary=False)
        assert res.exit_code == 0, res.message
        return
    cmd = [
        sys.executable,
        "-m",
        "batchgen",
        *_overrides(cfg, w),
        f"run.dry_run={str(cfg.run.dry_run).lower()}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def run_workload(
    w: Workload, root: Path, scale: float = 1.0, seed: int = 0, warm: bool = False, processes: bool = False
) -> dict[str, Any]:
    """Dry run, then the job; the figures of both. ``warm``: a first dry run fills the step-model cache
    (``plan.reuse_step_model``) and the second one's plan is measured; else the cache is not used (a first dry
    run on this setup). ``processes``: each runs as its own ``python -m batchgen`` (a cold engine in a new
    process, as a user runs them); else in this process."""
    from batchgen.engine.config import EngineConfig
    from batchgen.job.config import DataOptions, JobConfig, ModelOptions, RunOptions, default_sampling

    rng = random.Random(seed)
    n = max(8, int(w.num_rows * scale))
    inp = root / f"{w.name}.parquet"
    columns = {"prompt": w.rows(rng, n)}
    if w.continuations is not None:
        columns["continuation"] = w.continuations(rng, n)
    pq.write_table(pa.table(columns), inp)
    out = root / f"out-{w.name}"
    shutil.rmtree(out, ignore_errors=True)  # a finished output of an earlier run would make the job a no-op
    cfg = JobConfig(
        task=w.task,
        model=ModelOptions(path=_model_path(w.model, root)),
        data=DataOptions(input=str(inp), output=str(out), **w.data),
        engine=EngineConfig(device="cpu", **w.engine),
        sampling=dataclasses.replace(default_sampling(), **w.sampling),
        run=RunOptions(progress="off", dry_run=True),
    )
    cfg.plan.reuse_step_model = warm
    if warm:
        _run(cfg, w, processes)
    t0 = time.perf_counter()
    _run(cfg, w, processes)
    dry_s = time.perf_counter() - t0
    plan = json.loads((out / "_plan.json").read_text())
    cfg.run.dry_run = False
    _run(cfg, w, processes)
    report = json.loads((out / "_report.json").read_text())
    p = report["prediction"]
    pw, aw = p["wall_time_s"]["predicted"], p["wall_time_s"]["actual"]
    return {
        "workload": w.name,
        "describe": w.describe,
        "rows": n,
        "predicted_wall_s": pw,
        "range_s": p["wall_time_s"]["range"],
        "actual_wall_s": aw,
        "wall_error": (pw - aw) / aw,
        "inside_range": p["wall_time_s"].get("inside_range"),
        "predicted_hit_rate": p["prefix_hit_rate"]["predicted"],
        "actual_hit_rate": p["prefix_hit_rate"]["actual"],
        "predicted_output_tokens": p["generated_tokens"]["predicted"],
        "actual_output_tokens": p["generated_tokens"]["actual"],
        "predicted_steps": (p.get("engine_steps") or {}).get("predicted"),
        "actual_steps": (p.get("engine_steps") or {}).get("actual"),
        "predicted_preemptions": (p.get("preemptions") or {}).get("predicted"),
        "actual_preemptions": (p.get("preemptions") or {}).get("actual"),
        "task": w.task,
        "calibration_s": plan["calibration"]["seconds"],
        "calibration_rows": plan["calibration"]["rows"],
        "calibration_reused_steps": plan["calibration"].get("reused_steps"),
        "predicted_prompt_tokens_computed": p["prompt_tokens_computed"]["predicted"],
        "actual_prompt_tokens_computed": p["prompt_tokens_computed"]["actual"],
        "calibration_fraction": plan["calibration"]["seconds"] / pw if pw else None,
        "dry_run_s": dry_s,
        "load_plan": (p.get("load") or {}).get("plan"),
        "load_run": (p.get("load") or {}).get("run"),
        "threads_plan": (p.get("load") or {}).get("threads_plan"),
        "threads_run": (p.get("load") or {}).get("threads_run"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="comma-separated: "
        + ", ".join([*WORKLOADS, *HELD_OUT, *PROMPT_ONLY])
        + " (default: "
        + ", ".join(WORKLOADS)
        + ")",
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply each workload's rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="plan each workload twice, measuring the second plan: its step model starts from the first's timed "
        "steps (plan.reuse_step_model, a cache of this run's own)",
    )
    ap.add_argument(
        "--processes",
        action="store_true",
        help="run each dry run and job as its own `python -m batchgen` (a cold engine in a new process, as a user "
        "runs them); default: both in this process",
    )
    ap.add_argument("--dir", help="keep the inputs, plans and reports here (default: a temporary directory)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchgen-predictor-") as tmp:
        if args.dir:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
            tmp = args.dir
        if args.warm:
            os.environ["BATCHGEN_CACHE"] = str(Path(tmp) / "cache")
        for name in args.workloads.split(","):
            r = run_workload(
                {**WORKLOADS, **HELD_OUT, **PROMPT_ONLY}[name],
                Path(tmp),
                args.scale,
                args.seed,
                args.warm,
                args.processes,
            )
            rows.append(r)
            print(
                f"{r['workload']:<14} rows {r['rows']:>5}  wall predicted {r['predicted_wall_s']:7.1f} s "
                f"[{r['range_s'][0]:.1f}-{r['range_s'][1]:.1f}] actual {r['actual_wall_s']:7.1f} s "
                f"({r['wall_error']:+.0%}, {'inside' if r['inside_range'] else 'OUTSIDE'})  hit rate "
                f"{r['predicted_hit_rate']:.3f} vs {r['actual_hit_rate']:.3f}  prompt tokens computed "
                f"{r['predicted_prompt_tokens_computed']} vs {r['actual_prompt_tokens_computed']}  output tokens "
                f"{r['predicted_output_tokens']} vs {r['actual_output_tokens']}  steps {r['predicted_steps']} vs "
                f"{r['actual_steps']}  preemptions {r['predicted_preemptions']} vs {r['actual_preemptions']}  "
                "calibration "
                f"{r['calibration_rows']} rows {r['calibration_s']:.2f} s ({r['calibration_fraction']:.1%})  "
                f"load {r['load_plan']:.1f} at plan, {r['load_run']:.1f} at run  "
                f"threads {r['threads_plan']} at plan, {r['threads_run']} at run",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
