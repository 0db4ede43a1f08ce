"""Rows/s of one job over 1 vs N engine replicas, and the coordinator's cost per window:
``python -m batchgen.bench.replicas``.

The job (``run_job``, the same code as the CLI) runs over a generated Parquet input (``--rows`` prompts: 8
few-shot templates of ~60 words + a short item, so prefix grouping matters) with greedy sampling,
``ignore_eos`` and ``--max-tokens`` tokens per row, once per entry of ``--replicas``: ``1`` = one engine in
the job's own process (``engine.data_parallel_size=1``, every core), ``N`` > 1 = ``engine.data_parallel_size=N``
(N replica processes, the cores split between them, and the job's process as coordinator). Each run writes a fresh output directory. Figures per run (from its report):
rows/s and generated tokens/s over the run's wall time *after* the engines started (start-up is printed
apart), and per replica rows/s.

Coordinator overhead: the job process's CPU time during the run (``resource.getrusage``: reading and
tokenising windows, handing them out, receiving results, writing parts and the manifest) divided by the
windows; with replicas this process does no engine work, so this is all it costs (it runs beside the
replicas and takes its share of the cores); with one engine the figure includes the engine's own work. ``--model`` (default: a random Llama of hidden 256, 4 layers,
built once into the batchgen cache) picks the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

TEMPLATE_WORDS = (
    "the committee reviewed the quarterly report on river levels reservoir capacity rainfall forecasts and "
    "the maintenance schedule for the northern pumping stations before approving the budget for new sensors "
    "and asked the engineers to summarise the risks in plain language for the council"
).split()


def make_input(path: Path, rows: int) -> Path:
    prompts = []
    for i in range(rows):
        t = i % 8
        head = " ".join(TEMPLATE_WORDS[t:] + TEMPLATE_WORDS[:t])
        prompts.append(f"Template {t}: {head}. Item {i}: summarise point {i * 7 % 101}.")
    pq.write_table(pa.table({"prompt": prompts}), path)
    return path


def bench_model() -> str:
    from batchgen.models.tiny import cached_checkpoint

    return cached_checkpoint(
        "bench-replicas-h256-l4", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4
    )


def _threads(replicas: int) -> int:
    """torch threads per engine: this process's for one engine, each replica's share of the cores else."""
    import torch

    if replicas == 1:
        return torch.get_num_threads()
    from batchgen.job.replicas.run import _cpu_count

    return max(1, _cpu_count() // replicas)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_once(model: str, inp: Path, out: Path, replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    from batchgen.engine.config import EngineConfig
    from batchgen.job.config import DataOptions, JobConfig, ModelOptions, RunOptions, default_sampling
    from batchgen.job.run import run_job

    sampling = default_sampling()
    sampling.temperature, sampling.max_tokens, sampling.ignore_eos = 0.0, args.max_tokens, True
    cfg = JobConfig(
        model=ModelOptions(path=model),
        data=DataOptions(input=str(inp), output=str(out), window_rows=args.window_rows),
        engine=EngineConfig(
            device="cpu",
            kv_cache_memory="512MiB",
            max_num_seqs=args.max_num_seqs,
            data_parallel_size=replicas,
        ),  # fmt: skip
        sampling=sampling,
        run=RunOptions(progress="off"),
    )
    t0, cpu0 = time.monotonic(), _cpu_s()
    res = run_job(cfg, handle_signals=False, print_summary=False)
    wall, cpu = time.monotonic() - t0, _cpu_s() - cpu0
    if res.exit_code != 0:
        raise SystemExit(f"run with {replicas} replica(s) failed: {res.message}")
    rep = res.report
    windows = rep["windows"]["this_run"]
    return {
        "replicas": replicas,
        "threads": _threads(replicas),
        "rows": rep["run"]["rows"],
        "windows": windows,
        "startup_s": rep.get("startup_s"),
        "run_s": rep["run"]["wall_time_s"],
        "rows_per_s": rep["run"]["rows_per_s"],
        "generated_tokens_per_s": rep["run"]["generated_tokens_per_s"],
        "job_process_cpu_s": round(cpu, 3),
        "job_process_cpu_ms_per_window": round(1000 * cpu / max(windows, 1), 2),
        "total_wall_s": round(wall, 3),
        "per_replica_rows_per_s": [round(r["rows_per_s"], 2) for r in rep.get("replicas") or []],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2],
                   help="1 = one engine in the job's process; N > 1 = engine.data_parallel_size=N")  # fmt: skip
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--window-rows", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument(
        "--model", default=None, help="checkpoint directory (default: a random Llama h256 x 4 layers)"
    )
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the one-engine runs (default: torch's, every core)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    model = args.model or bench_model()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-replicas-") as tmp:
        inp = make_input(Path(tmp) / "in.parquet", args.rows)
        for n in args.replicas:
            load = os.getloadavg()[0]
            r = run_once(model, inp, Path(tmp) / f"out-{len(results)}", n, args)
            r["load_before"] = round(load, 2)
            r["load_after"] = round(os.getloadavg()[0], 2)
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'replicas':>8} {'threads':>7} {'rows/s':>8} {'gen tok/s':>10} {'startup s':>10} {'job CPU ms/window':>18} "
          f"{'per replica rows/s':>20} {'load':>11}")  # fmt: skip
    for r in results:
        name = "1 (job)" if r["replicas"] == 1 else str(r["replicas"])
        print(f"{name:>8} {r['threads']:>7} {r['rows_per_s']:>8.2f} {r['generated_tokens_per_s']:>10.1f} {r['startup_s']:>10.1f} "
              f"{r['job_process_cpu_ms_per_window']:>18.1f} {str(r['per_replica_rows_per_s']):>20} "
              f"{r['load_before']:>5}/{r['load_after']:<5}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
