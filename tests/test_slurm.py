"""Scale-out on a real Slurm cluster: sbatch job arrays, requeue after SIGUSR1 and after the time-limit
warning, and Hydra sweeps through the submitit launchers (Slurm and local).

Every run here processes the same small dataset with the same settings, so each output must equal the
single-process reference run, row for row (rows are seeded per id; greedy decoding). The Slurm tests are
skipped when `sinfo` cannot reach a cluster (CI starts one with jobs/ci/start-slurm.sh). The CI cluster
declares fake GPUs, so jobs/slurm/generate.sbatch runs with its own `--gres=gpu:1`; one test uses the
CPU-cluster spelling `--gres=none` instead.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import slurm_cluster as sc
from conftest import windows_done

from batchgen.job.merge import verify, write_merged

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "jobs" / "slurm" / "generate.sbatch"
BIN_DIR = Path(sys.executable).parent
BATCHGEN = BIN_DIR / "batchgen"
ROWS = 48
WINDOW_ROWS = 4
# The signal tests' inputs: the dataset repeated, so that a run is still going when its signal lands.
TIME_LIMIT_COPIES = 16  # 768 rows, one at a time: far more than a run gets through before its warning
USR1_COPIES = 8  # 48 windows a task, the signal sent after the first one
SUBMITIT_COPIES = 3  # 18 windows a task, the signal sent after the first one
TIME_LIMIT_PASS_S = 30  # slurmctld checks time limits (and sends --signal warnings) this often
TIME_LIMIT_LEAD_S = 14  # the time-limit job starts this long before a pass: batchgen is running when warned
# What must be identical between runs (num_cached_tokens depends on what else was in the prefix cache).
COMPARE = [
    "id",
    "generated_text",
    "token_ids",
    "num_prompt_tokens",
    "num_generated_tokens",
    "finish_reason",
    "status",
    "error",
]
# sbatch options for the CI node (the script's defaults ask for 8 CPUs and 32 GB).
SBATCH_CI = ["--cpus-per-task=1", "--mem=2G"]


@dataclass
class Workload:
    """The shared dataset, checkpoint and settings, and the single-process reference run."""

    dir: Path
    input: str
    ckpt: str
    env: dict[str, str]
    reference_proc: subprocess.Popen | None = None
    _reference: pa.Table | None = field(default=None, repr=False)

    def overrides(self, output: Path, *extra: str) -> list[str]:
        return [
            f"data.input={self.input}",
            "data.id_column=key",
            f"data.output={output}",
            f"data.window_rows={WINDOW_ROWS}",
            f"model.path={self.ckpt}",
            "sampling.max_tokens=16",
            "sampling.temperature=0",
            "engine.max_model_len=256",
            "engine.num_blocks=128",
            "engine.max_num_seqs=4",
            "run.progress=log",
            "run.progress_interval_s=5",
            *extra,
        ]

    def reference(self) -> pa.Table:
        if self._reference is None:
            assert self.reference_proc is not None
            out, _ = self.reference_proc.communicate(timeout=300)
            assert self.reference_proc.returncode == 0, out
            self._reference = merged(self.dir / "reference")
        return self._reference


def merged(output: Path, rows: int = ROWS) -> pa.Table:
    """The output's rows in input order (after checking complete, duplicate-free coverage)."""
    report = verify(output)
    assert report.ok, report
    assert report.expected_rows == rows, report
    dest = output.parent / f"{output.name}.merged.parquet"
    write_merged(output, dest, report)
    return pq.read_table(dest).select(COMPARE)


def assert_same(table: pa.Table, reference: pa.Table) -> None:
    assert table.num_rows == reference.num_rows == ROWS
    for name in COMPARE:
        assert table.column(name).to_pylist() == reference.column(name).to_pylist(), name


@pytest.fixture(scope="module")
def cluster() -> None:
    reason = sc.unavailable_reason(need_accounting=True)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory, llama_ckpt: str):
    d = tmp_path_factory.mktemp("scaleout")
    systems = ["You are a terse assistant.\n", "Translate into French.\n", "Classify the sentiment.\n"]
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    prompts = [
        systems[i % 3] + f"Item {i}: " + " ".join(words[(i * j) % 6] for j in range(3 + (i * 7) % 25))
        for i in range(ROWS)
    ]
    path = d / "prompts.parquet"
    pq.write_table(pa.table({"key": [f"row-{i:03d}" for i in range(ROWS)], "prompt": prompts}), path)
    env = dict(os.environ, BATCHGEN_BIN=str(BATCHGEN), PATH=f"{BIN_DIR}:{os.environ.get('PATH', '')}")
    w = Workload(d, str(path), llama_ckpt, env)
    # The reference run starts now and runs while the first Slurm jobs do.
    w.reference_proc = subprocess.Popen(
        [str(BATCHGEN), *w.overrides(d / "reference")],
        cwd=d,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield w
    if w.reference_proc.poll() is None:
        w.reference_proc.kill()
        w.reference_proc.wait()


def wait_for_windows(shard_dir: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while windows_done(shard_dir) < n:
        assert time.monotonic() < deadline, f"{shard_dir}: fewer than {n} windows after {timeout} s"
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------ sbatch
@pytest.mark.slurm
def test_sbatch_array_covers_every_row_once_like_one_process(cluster, workload: Workload) -> None:
    out = workload.dir / "array"
    job = sc.sbatch(
        "--array=0-3",
        *SBATCH_CI,
        f"--output={workload.dir}/array-%A_%a.out",
        str(SBATCH),
        *workload.overrides(out),
        cwd=workload.dir,
        env=workload.env,
    )
    sc.wait(job, timeout=300)
    runs = sc.runs(job)
    assert sorted(r.job_id for r in runs) == [f"{job}_{i}" for i in range(4)], runs
    assert all(r.state == "COMPLETED" and r.exit_code == "0:0" for r in runs), runs
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("shard-")) == [
        f"shard-{i:05d}-of-00004" for i in range(4)
    ]
    # The console script: exit 0, complete and duplicate-free, and a merged file in input order.
    p = subprocess.run(
        [str(BIN_DIR / "batchgen-merge"), str(out), "--write", str(workload.dir / "array.parquet")],
        capture_output=True,
        text=True,
        env=workload.env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4/4 present" in p.stdout and "OK: every input row is covered exactly once" in p.stdout
    assert_same(pq.read_table(workload.dir / "array.parquet").select(COMPARE), workload.reference())


@pytest.mark.slurm
def test_sbatch_task_sent_usr1_mid_run_is_requeued_and_resumes(cluster, workload: Workload) -> None:
    """USR1 after the first committed window of task 1 — on the repeated input (48 windows a task), so that
    the signal lands mid-run however fast the engine is (on the 48-row input the 5 windows left could finish
    between the poll and the signal)."""
    out = workload.dir / "usr1"
    big = _repeated_input(workload, USR1_COPIES)
    job = sc.sbatch(
        "--array=0-1",
        "--gres=none",  # how a CPU-only cluster runs the script
        *SBATCH_CI,
        f"--output={workload.dir}/usr1-%A_%a.out",
        str(SBATCH),
        *workload.overrides(out, f"data.input={big}"),
        cwd=workload.dir,
        env=workload.env,
    )
    wait_for_windows(out / "shard-00001-of-00002", 1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job}_1"], check=True)
    sc.wait(job, timeout=600)
    text = (workload.dir / f"usr1-{job}_1.out").read_text()
    runs = sc.runs(job)
    assert [r.state for r in runs if r.job_id == f"{job}_0"] == ["COMPLETED"], runs
    assert [r.state for r in runs if r.job_id == f"{job}_1"] == ["REQUEUED", "COMPLETED"], (runs, text)
    assert "received SIGUSR1, forwarding to batchgen" in text
    assert f"batchgen exited 75 (interrupted); requeueing {job}_1" in text
    assert "(restart 1)" in text and "finished" in text
    saved = int(text.split("incomplete (stopped by SIGUSR1): ")[1].split("/")[0])
    assert 1 <= saved < USR1_COPIES * ROWS // WINDOW_ROWS // 2, text  # interrupted mid-run, windows kept
    assert_repeated(merged(out, rows=USR1_COPIES * ROWS), workload.reference(), USR1_COPIES)


def assert_repeated(table: pa.Table, reference: pa.Table, copies: int) -> None:
    """``table`` is the reference's rows ``copies`` times over, under the keys of :func:`_repeated_input`."""
    assert table.column("id").to_pylist() == [
        f"copy{c}-{k}" for c in range(copies) for k in reference.column("id").to_pylist()
    ]
    for name in COMPARE[1:]:
        assert table.column(name).to_pylist() == reference.column(name).to_pylist() * copies, name


def _last_time_limit_pass() -> dt.datetime:
    """When slurmctld last checked time limits (skips the test when its log does not say)."""
    last = sc.last_time_limit_pass()
    wait_until = time.monotonic() + 40  # a freshly started slurmctld logs its first pass within ~30 s
    while last is None and time.monotonic() < wait_until:
        time.sleep(1)
        last = sc.last_time_limit_pass()
    if last is None:
        pytest.skip("slurmctld's time-limit passes are not in its log (jobs/ci/start-slurm.sh sets debug2)")
    return last


def _repeated_input(workload: Workload, copies: int) -> Path:
    """The workload's prompts repeated ``copies`` times under new keys (greedy: a repeated prompt gets the
    reference row's output), so that a run lasts long enough to be signalled mid-run."""
    source = pq.read_table(workload.input)
    big = workload.dir / f"repeated-{copies}.parquet"
    if big.exists():
        return big
    pq.write_table(
        pa.table(
            {
                "key": [f"copy{c}-{k}" for c in range(copies) for k in source.column("key").to_pylist()],
                "prompt": source.column("prompt").to_pylist() * copies,
            }
        ),
        big,
    )
    return big


@pytest.mark.slurm
def test_sbatch_task_hit_by_its_time_limit_warning_is_requeued_and_resumes(
    cluster, workload: Workload
) -> None:
    """The time-limit warning itself (`--time=1 --signal=B:USR1@59`), sent by slurmctld.

    slurmctld sends --signal warnings only during its time-limit passes, every ~30 s; with a 59 s lead on a
    1 min limit the warning goes out at the first pass after the job starts. The job is started
    TIME_LIMIT_LEAD_S before the earliest pass it can still precede by that much (--begin), so the warning
    lands that long after the start: batchgen is running, one sequence at a time, with most of its input
    left. Once the task is requeued the test raises its limit to 15 min so that the resumed run is not warned
    again before it finishes, even on a loaded machine (a real job gets the same limit again and simply makes
    progress on every run).
    """
    last = _last_time_limit_pass()
    big = _repeated_input(workload, TIME_LIMIT_COPIES)
    warned_at = last + dt.timedelta(seconds=TIME_LIMIT_PASS_S)
    begin = warned_at - dt.timedelta(seconds=TIME_LIMIT_LEAD_S)
    while (begin - dt.datetime.now()).total_seconds() < 1:
        begin += dt.timedelta(seconds=TIME_LIMIT_PASS_S)
    out = workload.dir / "timelimit"
    log = workload.dir / "timelimit.out"
    job = sc.sbatch(
        "--time=1",
        "--signal=B:USR1@59",
        f"--begin={begin:%Y-%m-%dT%H:%M:%S}",
        *SBATCH_CI,
        f"--output={log}",
        str(SBATCH),
        # one sequence at a time: the run is still going when the warning comes
        *workload.overrides(out, "engine.max_num_seqs=1", f"data.input={big}"),
        cwd=workload.dir,
        env=workload.env,
    )
    deadline = time.monotonic() + 180
    while sc.active(job) and time.monotonic() < deadline:
        if sc.restarts(job) >= 1:
            subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=15"], check=True)
            break
        time.sleep(0.2)
    sc.wait(job, timeout=900)
    text = log.read_text()
    runs = sc.runs(job)
    assert [r.state for r in runs] == ["REQUEUED", "COMPLETED"], (runs, text)
    assert "received SIGUSR1" in text and f"requeueing {job}" in text and "(restart 1)" in text
    assert "incomplete (stopped by SIGUSR1)" in text, text  # batchgen was running when warned
    assert_repeated(merged(out, rows=TIME_LIMIT_COPIES * ROWS), workload.reference(), TIME_LIMIT_COPIES)


def test_sbatch_script_rejects_an_array_that_does_not_start_at_zero(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        SLURM_ARRAY_TASK_MIN="1",
        SLURM_ARRAY_TASK_MAX="4",
        SLURM_ARRAY_TASK_COUNT="4",
        SLURM_ARRAY_TASK_ID="2",
        SLURM_ARRAY_JOB_ID="7",
        BATCHGEN_BIN="/bin/true",
    )
    run = dict(env=env, cwd=tmp_path, capture_output=True, text=True)
    p = subprocess.run(["bash", str(SBATCH), "data.output=x"], **run)
    assert p.returncode == 2 and "use --array=0-(N-1)" in p.stderr
    p = subprocess.run(["bash", str(SBATCH), "data.output=x", "data.shard.count=5"], **run)
    assert p.returncode == 0, p.stderr


def test_sbatch_script_passes_arguments_through_unevaluated(tmp_path: Path) -> None:
    argv_dump = tmp_path / "argv.py"
    argv_dump.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    argv_dump.chmod(0o755)
    args = ["data.output=a b", "sampling.stop=['$(touch pwned)', '`id`']", "x=*"]
    p = subprocess.run(
        ["bash", str(SBATCH), *args],
        env=dict(os.environ, BATCHGEN_BIN=str(argv_dump)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == args
    assert not (tmp_path / "pwned").exists()


# --------------------------------------------------------------------------------- Hydra submitit
def sweep(workload: Workload, out: Path, launcher: list[str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(BATCHGEN),
            "-m",
            *launcher,
            "data.shard.count=2",
            "data.shard.index=range(2)",
            *workload.overrides(out, *extra),
        ],
        cwd=workload.dir,
        env=workload.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slurm
def test_submitit_slurm_sweep_over_two_shards_requeues_a_warned_task(cluster, workload: Workload) -> None:
    """USR2 is submitit's signal (the time-limit warning, --signal=USR2@signal_delay_s): its handler
    checkpoints the Hydra job, `scontrol requeue`s it and exits; the requeued task resumes from the manifest.
    On the input repeated SUBMITIT_COPIES times (18 windows a task), so that the signal lands mid-run however
    fast the engine is (on the 48-row input a task could finish between the poll and the signal, and a USR2
    after submitit's handler is gone ends the task FAILED)."""
    out = workload.dir / "submitit_slurm"
    name = f"bg-{uuid.uuid4().hex[:8]}"
    big = _repeated_input(workload, SUBMITIT_COPIES)
    proc = sweep(
        workload,
        out,
        [
            "hydra/launcher=slurm",
            f"hydra.launcher.name={name}",
            "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.mem_gb=2",
            "hydra.launcher.timeout_min=10",
        ],
        f"data.input={big}",
    )
    try:
        wait_for_windows(out / "shard-00000-of-00002", 1)
        tasks = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True)
        task0 = next(t for t in tasks.stdout.split() if t.endswith("_0"))
        subprocess.run(["scancel", "--signal=USR2", task0], check=True)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text
    runs = sc.runs(task0.split("_")[0])
    assert [r.state for r in runs if r.job_id == task0] == ["REQUEUED", "COMPLETED"], runs
    assert_repeated(merged(out, rows=SUBMITIT_COPIES * ROWS), workload.reference(), SUBMITIT_COPIES)


def test_submitit_local_sweep_over_two_shards(workload: Workload) -> None:
    out = workload.dir / "submitit_local"
    proc = sweep(workload, out, ["hydra/launcher=slurm_local", "hydra.launcher.timeout_min=10"])
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("shard-")) == [
        "shard-00000-of-00002",
        "shard-00001-of-00002",
    ]
    assert_same(merged(out), workload.reference())
