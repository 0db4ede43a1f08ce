"""Start-up benchmark: where the time from command to first generated token goes.

    python -m batchgen.bench.startup                 # the README's demo (`batchgen`), 5 fresh processes
    python -m batchgen.bench.startup --runs 9 -- model.path=/ckpt sampling.max_tokens=16

Runs the ``batchgen`` command (the console script next to this interpreter, else ``python -m
batchgen.cli``) ``--warmup`` times (not counted: a warm cache is the case measured) then ``--runs`` times,
each in a fresh process with ``BATCHGEN_TRACE_STARTUP=1`` and its own
empty ``data.output``, and prints per phase the median seconds since the command was spawned (measured on
this process's clock: interpreter start included): ``imports`` (the CLI's imports done), ``config`` (Hydra
composed the configuration), ``plan`` (input, model config and output planned), ``model_loaded`` (engine
built: weights, tokenizer, KV pool), ``first_token`` (first engine step that sampled tokens), ``done`` (job
finished) and ``exit`` (process gone). Then one more run under ``python -X importtime`` lists the imports
that cost most. Figures, not assertions: no test times this.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchgen.startup_trace import ENV_VAR, PHASES, PREFIX

ALL_PHASES = (*PHASES, "exit")


def command(overrides: list[str], output: str, importtime: bool = False) -> list[str]:
    """The ``batchgen`` command line for one run (``python -X importtime -m batchgen.cli`` when asked)."""
    script = Path(sys.executable).with_name("batchgen")
    if script.is_file() and not importtime:
        head = [str(script)]
    else:
        head = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "batchgen.cli"]
    return [*head, f"data.output={output}", *overrides]


def run_once(overrides: list[str], workdir: Path, index: int) -> dict[str, float]:
    """Seconds from spawn to each phase of one fresh run; raises if the command fails."""
    out = workdir / f"out{index}"
    env = {**os.environ, ENV_VAR: "1"}
    t0 = time.time()
    proc = subprocess.run(command(overrides, str(out)), env=env, capture_output=True, text=True, cwd=workdir)
    t_exit = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"run {index} exited with status {proc.returncode}:\n{proc.stderr[-2000:]}")
    times = {"exit": t_exit - t0}
    for line in proc.stderr.splitlines():
        if line.startswith(PREFIX):
            _, phase, _age, unix = line.split()
            times[phase] = float(unix) - t0
    shutil.rmtree(out, ignore_errors=True)
    return times


def import_offenders(overrides: list[str], workdir: Path, top: int) -> list[tuple[float, float, str]]:
    """(cumulative s, self s, module) of the costliest imports of one run, top-level packages first."""
    out = workdir / "out-importtime"
    proc = subprocess.run(
        command(overrides, str(out), importtime=True), capture_output=True, text=True, cwd=workdir
    )
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, self_us, cum_us, name = (p for p in line.replace("import time:", "|", 1).split("|"))
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        if depth <= 1:  # imported by batchgen itself or by the package it imported
            rows.append((int(cum_us) / 1e6, int(self_us) / 1e6, name.strip()))
    shutil.rmtree(out, ignore_errors=True)
    return sorted(rows, reverse=True)[:top]


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes to take the median over")
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="runs first, not counted (fill the OS file cache and $BATCHGEN_CACHE)",
    )
    ap.add_argument(
        "--top", type=int, default=15, help="import offenders to list (0: skip the importtime run)"
    )
    ap.add_argument("overrides", nargs="*", help="batchgen overrides after --, e.g. model.path=...")
    args = ap.parse_args(argv)
    print(f"command: batchgen {' '.join(args.overrides)}".rstrip())
    print(f"load average before: {load_average()}  (cpus: {os.cpu_count()})")
    with tempfile.TemporaryDirectory(prefix="batchgen-startup-") as tmp:
        work = Path(tmp)
        for i in range(args.warmup):
            run_once(args.overrides, work, -1 - i)
        runs = [run_once(args.overrides, work, i) for i in range(args.runs)]
        print(f"load average after:  {load_average()}")
        print(f"\n{'phase':<14}{'median s':>10}{'min s':>9}{'max s':>9}   (since the command was spawned)")
        for phase in ALL_PHASES:
            vals = [r[phase] for r in runs if phase in r]
            if vals:
                print(f"{phase:<14}{statistics.median(vals):>10.2f}{min(vals):>9.2f}{max(vals):>9.2f}")
            else:
                print(f"{phase:<14}{'-':>10}   (no marker: this batchgen does not trace it)")
        if args.top > 0:
            print("\nimports costing most (one run with -X importtime; depth <= 1 of the import tree):")
            print(f"{'cumulative s':>12}{'self s':>9}  module")
            for cum, own, name in import_offenders(args.overrides, work, args.top):
                print(f"{cum:>12.3f}{own:>9.3f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
