"""Scale benchmark: what grows with the dataset before the first token, planning a billion rows, commit cost.

    python -m batchgen.bench.scale                      # 10k vs 10M rows, 1e9-row planning, 2,000 commits
    python -m batchgen.bench.scale --large-rows 2000000 --commits 2000     # smaller

Inputs are generated into a temporary directory (removed at the end):

1. *First token*: the ``batchgen`` command (embedded model, ``sampling.max_tokens=1``, defaults otherwise) on
   ``--small-rows`` and ``--large-rows`` short prompts (two Parquet files each), a fresh process per run with
   ``BATCHGEN_TRACE_STARTUP=1``; the seconds from spawn to the ``first_token`` marker (the median of ``--runs``
   runs, interleaved; the process is stopped there). Then *resume*: the large job is run until ``--resume-windows``
   windows are committed, killed (-9), and rerun to its first token.
2. *Planning 1e9 rows*: ``--files`` Parquet files of ``--rows-per-file`` rows each (one dictionary-encoded prompt
   column: small files, real footers) planned in a fresh process as a job does (:func:`batchgen.job.plan.plan_job`,
   the fresh manifest, the windows to do, the first window's spec), after planning one file (the imports); its
   seconds, and the peak RSS against the RSS before it.
3. *Commit cost*: ``--commits`` one-row windows committed into a local output directory (the job's commit and
   part roll-up); the mean milliseconds of the first and of the last 100 commits.
4. *Part roll memory*: ``--roll-windows`` committed windows of about ``--roll-window-mib`` MiB of incompressible
   text each rolled into one part in a fresh process; the part's size and the peak RSS of the roll beyond the
   RSS before it (the peak counter reset through ``/proc/self/clear_refs``).

Figures, not assertions: no test times this.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchgen.bench.startup import load_average
from batchgen.runtime.startup_trace import ENV_VAR, PREFIX


def write_prompts(directory: Path, rows: int, files: int = 2) -> Path:
    """`rows` short distinct prompts in `files` Parquet files under `directory`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    per = -(-rows // files)
    for k in range(files):
        lo, hi = k * per, min(rows, (k + 1) * per)
        prompts = pa.array([f"Tell me about item {i}" for i in range(lo, hi)])
        pq.write_table(pa.table({"prompt": prompts}), directory / f"part-{k:03d}.parquet")
    return directory


def write_billion(directory: Path, files: int, rows_per_file: int) -> Path:
    """`files` copies of one file of `rows_per_file` rows of a dictionary-encoded prompt column: real footers
    (a row group per million rows) of a few KB each."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    words = pa.array([f"Tell me about topic {i}" for i in range(16)])
    indices = pa.array(np.arange(rows_per_file, dtype=np.int32) % 16)
    col = pa.DictionaryArray.from_arrays(indices, words)
    first = directory / "f00000.parquet"
    pq.write_table(pa.table({"prompt": col}), first, row_group_size=1 << 20)
    for i in range(1, files):
        shutil.copyfile(first, directory / f"f{i:05d}.parquet")
    return directory


def _batchgen(overrides: list[str]) -> list[str]:
    script = Path(sys.executable).with_name("batchgen")
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "batchgen.cli"]
    return [*head, *overrides]


def first_token_s(inp: Path, out: Path, extra: list[str] = ()) -> float:
    """Seconds from spawn to the first sampled token of ``batchgen`` on `inp` (the process is then killed)."""
    cmd = _batchgen([f"data.input={inp}", f"data.output={out}", "sampling.max_tokens=1", "run.progress=off",
                     *extra])  # fmt: skip
    env = {**os.environ, ENV_VAR: "1"}
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            if line.startswith(PREFIX) and line.split()[1] == "first_token":
                return float(line.split()[3]) - t0
        raise RuntimeError(f"{' '.join(cmd)} exited with status {proc.wait()} before its first token")
    finally:
        proc.kill()
        proc.wait()


def run_until_windows(inp: Path, out: Path, windows: int) -> int:
    """Run the job on `inp` until `windows` windows are committed, then kill it (-9); returns the count."""
    cmd = _batchgen([f"data.input={inp}", f"data.output={out}", "sampling.max_tokens=1", "run.progress=off"])
    from batchgen.data.commit_log import read_state
    from batchgen.data.local_storage import LocalLocation

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = 0
    try:
        while proc.poll() is None and done < windows:
            time.sleep(0.5)
            try:  # the manifest and the commit records after it
                state = read_state(LocalLocation(out))[0]
                done = len(state.windows) if state is not None else 0
            except (OSError, ValueError, KeyError):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return done


_PLAN_CHILD = """
import json, sys, time
from batchgen.job.config import JobConfig
from batchgen.job.plan import fresh_manifest, plan_job
from batchgen.job.resume import windows_to_do

def plan(inp, out):
    cfg = JobConfig()
    cfg.data.input, cfg.data.output = inp, out
    plan = plan_job(cfg)
    todo = windows_to_do(plan, fresh_manifest(plan), None)
    return plan, todo, next(iter(todo)).spec

def status_mib(key):  # VmRSS now, VmHWM the peak (ru_maxrss would count the parent's peak: kept over exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024

plan(sys.argv[3], sys.argv[2])  # a one-file input first: the imports planning needs (the model's config)
rss0 = status_mib("VmRSS")
t0 = time.perf_counter()
p, todo, first = plan(sys.argv[1], sys.argv[2])
t1 = time.perf_counter()
print(json.dumps({"rows": p.input.num_rows, "files": len(p.input.files), "windows": len(p.windows),
                  "todo": len(todo), "first": [first.row_start, first.row_end], "plan_s": t1 - t0,
                  "rss_before_mib": rss0, "rss_peak_mib": status_mib("VmHWM")}))
"""


def plan_billion(inp: Path, out: Path) -> dict:
    """Plan the job on `inp` in a fresh process: its figures (seconds, RSS before and at the peak)."""
    one = next(inp.glob("*.parquet"))
    cmd = [sys.executable, "-c", _PLAN_CHILD, str(inp), str(out), str(one)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"planning failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_ROLL_CHILD = """
import os, sys, time
import pyarrow as pa
from batchgen.data.manifest import Manifest, WindowRecord
from batchgen.data.output_dir import OutputDir
from batchgen.data.part_roll import PartRoller

out, windows, mib = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rows = 256
def status_mib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024
od = OutputDir(out)
od.open(Manifest("fp", {}, {}, {"index": 0, "count": 1}, rows, windows, "bench"))
size = int(mib * (1 << 20) / rows / 2)
for w in range(windows):
    text = pa.array([os.urandom(size).hex() for _ in range(rows)])
    table = pa.table({"id": pa.array(range(w * rows, (w + 1) * rows)), "generated_text": text})
    od.commit(w, table, WindowRecord("", w * rows, (w + 1) * rows, rows, rows, 0, rows, 0, rows))
del text, table
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS counter starts again from the RSS now
rss0 = status_mib("VmRSS")
t0 = time.perf_counter()
PartRoller(od, part_rows=10**12).finish()
t1 = time.perf_counter()
part = od.manifest.parts[0]
print(part.size, rss0, status_mib("VmHWM"), t1 - t0)
od.close()
"""


def roll_memory(out: Path, windows: int, window_mib: float) -> dict:
    """Roll `windows` windows of about `window_mib` MiB into one part in a fresh process: the part's bytes, the
    RSS before the roll and its peak (MiB), and its seconds."""
    cmd = [sys.executable, "-c", _ROLL_CHILD, str(out), str(windows), str(window_mib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the roll failed: {proc.stderr[-2000:]}")
    size, rss0, peak, secs = proc.stdout.split()
    return {"part_mib": int(size) / 2**20, "rss_before_mib": float(rss0), "rss_peak_mib": float(peak),
            "roll_s": float(secs)}  # fmt: skip


def commit_costs(out: Path, commits: int) -> tuple[list[float], int]:
    """Seconds of each of `commits` one-row window commits (the job's commit, then its part roll-up), and the
    manifest's size in bytes at the end."""
    import pyarrow as pa

    from batchgen.data.layout import MANIFEST_NAME
    from batchgen.data.manifest import Manifest, WindowRecord
    from batchgen.data.output_dir import OutputDir
    from batchgen.data.part_roll import PartRoller

    od = OutputDir(out)
    od.open(Manifest("fp", {}, {}, {"index": 0, "count": 1}, 1, commits, "bench"))
    roller = PartRoller(od)
    roller.open()
    table = pa.table({"id": [0], "generated_text": ["x"], "status": ["ok"]})
    times = []
    for w in range(commits):
        rec = WindowRecord("", w, w + 1, 1, 1, 0, 1, 0, 1)
        t0 = time.perf_counter()
        od.commit(w, table, rec)
        roller.roll_ready()
        times.append(time.perf_counter() - t0)
    size = (od.path / MANIFEST_NAME).stat().st_size
    od.close()
    return times, size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-rows", type=int, default=10_000)
    ap.add_argument("--large-rows", type=int, default=10_000_000)
    ap.add_argument("--runs", type=int, default=3, help="first-token runs per size (median)")
    ap.add_argument("--resume-windows", type=int, default=20, help="windows committed before the resume")
    ap.add_argument("--files", type=int, default=1000, help="files of the planning input")
    ap.add_argument("--rows-per-file", type=int, default=1_000_000)
    ap.add_argument("--commits", type=int, default=2000)
    ap.add_argument("--roll-windows", type=int, default=64, help="windows rolled into one part")
    ap.add_argument("--roll-window-mib", type=float, default=4.0, help="MiB of text per rolled window")
    ap.add_argument("--skip", nargs="*", default=[], choices=["first-token", "plan", "commits", "roll"])
    args = ap.parse_args(argv)
    print(f"load average before: {load_average()}  (cpus: {os.cpu_count()})")
    with tempfile.TemporaryDirectory(prefix="batchgen-scale-") as tmp:
        work = Path(tmp)
        if "first-token" not in args.skip:
            small = write_prompts(work / "small", args.small_rows)
            large = write_prompts(work / "large", args.large_rows)
            times: dict[str, list[float]] = {"small": [], "large": []}
            for i in range(args.runs + 1):  # the first pair warms the file cache, not counted
                for name, inp in (("small", small), ("large", large)):
                    t = first_token_s(inp, work / f"out-{name}-{i}")
                    shutil.rmtree(work / f"out-{name}-{i}", ignore_errors=True)
                    if i:
                        times[name].append(t)
            s, big = statistics.median(times["small"]), statistics.median(times["large"])
            print(f"first token, fresh: {args.small_rows:,} rows {s:.2f} s, {args.large_rows:,} rows {big:.2f} s "
                  f"(+{big - s:.2f} s; runs {times})")  # fmt: skip
            out = work / "out-resume"
            done = run_until_windows(large, out, args.resume_windows)
            s = first_token_s(small, work / "out-small-again")  # under the load of the moment
            t = first_token_s(large, out)
            print(f"first token, resume of {args.large_rows:,} rows after {done} committed windows: {t:.2f} s "
                  f"({t - s:+.2f} s against a fresh {args.small_rows:,}-row run just before: {s:.2f} s)")  # fmt: skip
            shutil.rmtree(work / "small"), shutil.rmtree(work / "large"), shutil.rmtree(out)
        if "plan" not in args.skip:
            t0 = time.perf_counter()
            inp = write_billion(work / "billion", args.files, args.rows_per_file)
            print(
                f"(wrote {args.files} files of {args.rows_per_file:,} rows in {time.perf_counter() - t0:.1f} s)"
            )
            r = plan_billion(inp, work / "out-plan")
            print(f"planning {r['rows']:,} rows in {r['files']} files ({r['windows']:,} windows, "
                  f"{r['todo']:,} to do): {r['plan_s']:.2f} s; peak RSS {r['rss_peak_mib']:.0f} MiB, "
                  f"{r['rss_peak_mib'] - r['rss_before_mib']:.0f} MiB beyond the "
                  f"{r['rss_before_mib']:.0f} MiB after imports")  # fmt: skip
        if "commits" not in args.skip:
            times_c, size = commit_costs(work / "out-commits", args.commits)
            k = min(100, len(times_c))
            first, last = statistics.mean(times_c[:k]) * 1e3, statistics.mean(times_c[-k:]) * 1e3
            print(f"commit cost: first {k} commits {first:.2f} ms each, last {k} (of {len(times_c):,}) "
                  f"{last:.2f} ms each; manifest {size / 1024:.0f} KiB at the end")  # fmt: skip
        if "roll" not in args.skip:
            r = roll_memory(work / "out-roll", args.roll_windows, args.roll_window_mib)
            print(f"part roll: {args.roll_windows} windows of {args.roll_window_mib:g} MiB of text into one part "
                  f"of {r['part_mib']:.0f} MiB in {r['roll_s']:.1f} s; peak RSS {r['rss_peak_mib'] - r['rss_before_mib']:.0f} "
                  f"MiB beyond the {r['rss_before_mib']:.0f} MiB before the roll")  # fmt: skip
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
