"""Start-up benchmark: where the time from command to first generated token goes.

    python -m batchgen.bench.startup                 # the README's demo (`batchgen`), 5 fresh processes
    python -m batchgen.bench.startup --runs 9 -- model.path=/ckpt sampling.max_tokens=16
    python -m batchgen.bench.startup --against ../main    # before/after: another checkout, interleaved

Runs the ``batchgen`` command (the console script next to this interpreter, else ``python -m
batchgen.cli``) ``--warmup`` times (not counted: a warm cache is the case measured) then ``--runs`` times,
each in a fresh process with ``BATCHGEN_TRACE_STARTUP=1`` and its own
empty ``data.output``, and prints per phase the median seconds since the command was spawned (measured on
this process's clock: interpreter start included): ``imports`` (the CLI's imports done), ``config`` (Hydra
composed the configuration), ``plan`` (input, model config and output planned), ``model_loaded`` (engine
built: weights, tokenizer, KV pool), ``first_token`` (first engine step that sampled tokens), ``done`` (job
finished) and ``exit`` (process gone). ``--against SRC`` runs another source tree's batchgen (on PYTHONPATH)
interleaved with this one, run for run, and prints both columns. Then one more run under ``python -X
importtime`` lists the imports that cost most. Figures, not assertions: no test times this.
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

from batchgen.runtime.startup_trace import ENV_VAR, PHASES, PREFIX

ALL_PHASES = (*PHASES, "exit")


def command(overrides: list[str], output: str, importtime: bool = False) -> list[str]:
    """The ``batchgen`` command line for one run (``python -X importtime -m batchgen.cli`` when asked)."""
    script = Path(sys.executable).with_name("batchgen")
    if script.is_file() and not importtime:
        head = [str(script)]
    else:
        head = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "batchgen.cli"]
    return [*head, f"data.output={output}", *overrides]


def run_once(overrides: list[str], workdir: Path, index: int, source: str | None = None) -> dict[str, float]:
    """Seconds from spawn to each phase of one fresh run (of the batchgen in `source`, put first on
    PYTHONPATH, when given); raises if the command fails."""
    out = workdir / f"out{index}"
    env = {**os.environ, ENV_VAR: "1"}
    if source:
        env["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [env.get("PYTHONPATH")])])
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
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"(the -X importtime run exited with status {proc.returncode}: {last})")
    return sorted(rows, reverse=True)[:top]


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _phase_table(columns: dict[str, list[dict[str, float]]]) -> None:
    """Median (min-max) seconds per phase, one column per variant."""
    print(f"\n{'phase':<14}" + "".join(f"{name + ': median (min-max) s':>32}" for name in columns))
    for phase in ALL_PHASES:
        cells = []
        for runs in columns.values():
            vals = [r[phase] for r in runs if phase in r]
            cell = (
                f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})"
                if vals
                else "- (no marker)"
            )
            cells.append(f"{cell:>32}")
        print(f"{phase:<14}" + "".join(cells))
    print("(seconds since the command was spawned)")


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
    ap.add_argument(
        "--against",
        metavar="SRC",
        help="another batchgen source tree (e.g. a git worktree of main): its runs interleave with these, "
        "run for run, so both see the same load",
    )
    ap.add_argument("overrides", nargs="*", help="batchgen overrides after --, e.g. model.path=...")
    args = ap.parse_args(argv)
    variants = {"this": None, **({"against": args.against} if args.against else {})}
    print(f"command: batchgen {' '.join(args.overrides)}".rstrip())
    if args.against:
        print(f"against: PYTHONPATH={args.against}")
    print(f"load average before: {load_average()}  (cpus: {os.cpu_count()})")
    with tempfile.TemporaryDirectory(prefix="batchgen-startup-") as tmp:
        work = Path(tmp)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for i in range(-args.warmup, args.runs):
            for name, source in variants.items():
                times = run_once(args.overrides, work, i, source)
                if i >= 0:
                    runs[name].append(times)
        print(f"load average after:  {load_average()}")
        _phase_table(runs)
        if args.top > 0:
            print("\nimports costing most (one run with -X importtime; depth <= 1 of the import tree):")
            print(f"{'cumulative s':>12}{'self s':>9}  module")
            for cum, own, name in import_offenders(args.overrides, work, args.top):
                print(f"{cum:>12.3f}{own:>9.3f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
