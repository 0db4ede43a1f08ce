"""Issue 12, faults outside our checks: one clear line, the documented exit status, nothing lost.

Real processes where they matter (exit statuses, tracebacks on stderr, signals, kill -9, a full tmpfs),
in process otherwise (an injected ENOSPC at every write the job makes, an engine that crashes).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import (
    EngineAtStep,
    env_without_slurm,
    job_config,
    part_contents,
    read_parts,
    try_mount_tmpfs,
    umount,
    wait_for_rows_done,
)

from batchgen.job.run import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, run_job

PROMPTS = [f"prompt {i} " + "word " * (i % 7) for i in range(40)]
BASE = ["engine.device=cpu", "engine.num_blocks=256", "engine.max_num_seqs=8", "sampling.max_tokens=6", "sampling.temperature=0.8",
        "run.progress=log", "run.progress_interval_s=0.2", "data.shard.index=0", "data.shard.count=1"]  # fmt: skip


@pytest.fixture(scope="module")
def inp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("faults") / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), p)
    return p


def batchgen(args: list[str], cwd: Path, timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchgen.cli", *args],
        cwd=cwd,
        env=env_without_slurm(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def one_clear_line(p: subprocess.CompletedProcess, code: int, needle: str) -> None:
    text = p.stdout + p.stderr
    assert p.returncode == code, text[-3000:]
    assert "Traceback" not in text and "Error executing job" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if needle in ln]
    assert len(lines) >= 1, text[-3000:]


def _cfg(ckpt: str, inp: Path, out: Path, **kw):
    return job_config(ckpt, inp, out, **kw)


# ------------------------------------------------------------------------------------- output directory
def test_output_under_a_regular_file_or_read_only_is_one_line_exit_2(
    llama_ckpt: str, inp: Path, tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("not a directory")
    p = batchgen([f"model.path={llama_ckpt}", f"data.input={inp}", "data.output=afile/out", *BASE], tmp_path)
    one_clear_line(p, EXIT_CONFIG, "data.output: 'afile/out' cannot be a directory: 'afile' is a file")
    ro = tmp_path / "ro"
    if try_mount_tmpfs(ro, "1m", read_only=True):
        try:
            p = batchgen(
                [f"model.path={llama_ckpt}", f"data.input={inp}", "data.output=ro/out", *BASE], tmp_path
            )
        finally:
            umount(ro)
        one_clear_line(p, EXIT_CONFIG, "cannot create the output directory 'ro/out': read-only file system")
    elif os.geteuid() != 0:
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        p = batchgen([f"model.path={llama_ckpt}", f"data.input={inp}", "data.output=ro/out", *BASE], tmp_path)
        one_clear_line(p, EXIT_CONFIG, "cannot create the output directory 'ro/out': permission denied")


def test_a_kv_cache_larger_than_the_machine_is_one_line_exit_2(
    llama_ckpt: str, inp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    too_big = 2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30 + 500
    args = [
        f"model.path={llama_ckpt}",
        f"data.input={inp}",
        "data.output=out",
        *BASE,
        "engine.num_blocks=null",
    ]
    p = batchgen([*args, f"engine.kv_cache_memory={too_big}GiB"], tmp_path)
    one_clear_line(p, EXIT_CONFIG, f"engine.kv_cache_memory={too_big}GiB")
    blocks = too_big * 2**30 // 8192  # 8 KiB per block for the tiny llama: as large in blocks
    res = run_job(_cfg(llama_ckpt, inp, tmp_path / "o1", engine={"num_blocks": blocks}), handle_signals=False)
    assert res.exit_code == EXIT_CONFIG and f"engine.num_blocks={blocks} is a KV cache of" in res.message
    # an allocation the engine cannot make (MemoryError from numpy) is the same kind of error
    import batchgen.engine.core.llm_engine as le

    def no_memory(*a, **k):
        raise MemoryError("Unable to allocate 500. GiB for an array with shape (536870912000,)")

    monkeypatch.setattr(le, "LLMEngine", no_memory)
    res = run_job(_cfg(llama_ckpt, inp, tmp_path / "o2"), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_CONFIG and res.message.startswith("not enough memory to start the engine")


# -------------------------------------------------------------------------------------------- disk full
def _enospc_after(n: int):
    calls = {"n": 0}

    def maybe_fail(*a, **k):
        calls["n"] += 1
        if calls["n"] > n:
            raise OSError(errno.ENOSPC, "No space left on device")

    return maybe_fail


@pytest.mark.parametrize("where", ["part", "manifest", "checkpoint"])
def test_disk_full_keeps_every_committed_window_and_resumes_exactly_once(
    llama_ckpt: str, inp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An injected ENOSPC: while writing the 3rd window, its commit record, or a checkpoint."""
    from batchgen.data import output_dir as od

    window = 40 if where == "checkpoint" else 8
    ref = tmp_path / "ref"
    cfg = _cfg(llama_ckpt, inp, ref, data={"window_rows": window})
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    out = tmp_path / "out"
    cfg = _cfg(llama_ckpt, inp, out, data={"window_rows": window})
    fail = _enospc_after(2)
    if where == "part":
        real = od.OutputDir._put_unit

        def put_unit(self, name, data):
            if name.startswith("_windows/part-"):  # a window's object
                fail()
            return real(self, name, data)

        monkeypatch.setattr(od.OutputDir, "_put_unit", put_unit)
    elif where == "manifest":  # the commit record of the 3rd window
        from batchgen.data.commit_log import CommitLog

        real_append = CommitLog.append
        fail = _enospc_after(3)  # open's record, then two windows

        def append(self, rec, m=None):
            fail()
            return real_append(self, rec, m)

        monkeypatch.setattr(CommitLog, "append", append)
    else:
        cfg.run.checkpoint_interval_s = 1e-9  # a checkpoint after every engine step
        real_ck = od.OutputDir.write_checkpoint
        fail = _enospc_after(1)

        def write_checkpoint(self, *a, **k):
            fail()
            return real_ck(self, *a, **k)

        monkeypatch.setattr(od.OutputDir, "write_checkpoint", write_checkpoint)
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_INTERRUPTED and res.message.startswith("disk full writing"), res.message
    assert "free space and rerun the same command to resume" in res.message and "\n" not in res.message
    m = json.loads((out / "_manifest.json").read_text())
    pieces = sorted(str(p.relative_to(out)) for p in out.glob("_windows/part-*"))
    assert pieces == sorted(w["part"] for w in m["windows"].values())  # committed windows, in no part yet
    assert not list(out.glob(".tmp-*")) and not list(out.glob("_checkpoint/.tmp-*"))
    listed = {f for p in m["partial"].values() for f in p["files"]}
    assert {p.name for p in out.glob("_checkpoint/*")} == listed
    assert m["windows"] or m["partial"]  # something was committed before the disk filled up
    monkeypatch.undo()
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    assert part_contents(out) == part_contents(ref)  # every row exactly once, as an uninterrupted run
    assert res.report["run"]["rows"] == len(PROMPTS) - m["rows_done"]  # only what was not committed


def test_disk_full_on_a_real_file_system_then_space_freed(llama_ckpt: str, inp: Path, tmp_path: Path) -> None:
    full = tmp_path / "full"
    if not try_mount_tmpfs(full, "48k"):
        pytest.skip("cannot mount a small tmpfs here (the injected-ENOSPC test covers the job's side)")
    try:
        args = [
            f"model.path={llama_ckpt}",
            f"data.input={inp}",
            "data.output=full/out",
            "data.window_rows=4",
            *BASE,
        ]
        p = batchgen(args, tmp_path)
        one_clear_line(p, EXIT_INTERRUPTED, "disk full writing full/out")
        done = len(json.loads((full / "out" / "_manifest.json").read_text())["windows"])
        assert 0 < done < 10, done
        subprocess.run(["mount", "-o", "remount,size=16m", str(full)], check=True)
        p = batchgen(args, tmp_path)
        assert p.returncode == EXIT_OK, (p.stdout + p.stderr)[-3000:]
        t = pq.read_table(full / "out")
        assert t.column("id").to_pylist() == list(range(len(PROMPTS)))
    finally:
        umount(full)
        from batchgen.job.hydra_setup import fallback_log_root

        shutil.rmtree(fallback_log_root(str(full / "out")), ignore_errors=True)  # logs of the full-disk run


# -------------------------------------------------------------------------------- signals and crashes
def test_ctrl_c_during_start_up_is_one_line_exit_75(llama_ckpt: str, inp: Path, tmp_path: Path) -> None:
    """Ctrl-C while importing (after 0.3 s), and once the job is planned (the start-up trace's ``plan`` line:
    the tokenizer and the model are loading) — a fixed delay cannot tell, since a warm start takes ~2 s."""
    env = {**env_without_slurm(), "BATCHGEN_TRACE_STARTUP": "1"}
    for when in ("0.3s", "plan"):
        out = f"out-{when}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchgen.cli", f"model.path={llama_ckpt}", f"data.input={inp}",
             f"data.output={out}", *BASE],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        head = ""
        if when == "plan":
            assert proc.stdout is not None
            for line in proc.stdout:
                head += line
                if line.startswith("batchgen-startup: plan"):
                    break
        else:
            time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=300)
        text = head + text
        assert proc.returncode == EXIT_INTERRUPTED, (when, text[-3000:])
        assert "Traceback" not in text and ("interrupted during start-up" in text or "SIGINT" in text), text


@pytest.mark.slow
def test_kill_9_loses_at_most_the_rows_since_the_last_checkpoint(
    llama_ckpt: str, inp: Path, tmp_path: Path
) -> None:
    """One window of 40 rows, checkpoints every 0.2 s: a kill -9 once rows are checkpointed keeps them; the
    resume recomputes only the others and the output is the uninterrupted one, each row exactly once."""
    # Long enough (1 sequence at a time, 48 tokens each) that checkpoints happen well before the window ends.
    over = [
        "data.window_rows=40",
        "engine.max_num_seqs=1",
        "run.checkpoint_interval_s=0.2",
        "sampling.max_tokens=48",
    ]
    ref = tmp_path / "ref"
    kw = {"data": {"window_rows": 40}, "engine": {"max_num_seqs": 1}, "sampling": {"max_tokens": 48}}
    cfg = _cfg(llama_ckpt, inp, ref, **kw)
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", f"model.path={llama_ckpt}", f"data.input={inp}", f"data.output={out}",
         *BASE, *over],
        cwd=tmp_path, env=env_without_slurm(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    saved = wait_for_rows_done(proc, out, 8)
    proc.kill()
    proc.wait(timeout=60)
    assert 8 <= saved < 40, f"no checkpoint before the job ended ({saved} rows saved)"
    cfg = _cfg(llama_ckpt, inp, out, **kw)
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    assert res.report["run"]["rows"] <= 40 - saved
    assert part_contents(out) == part_contents(ref)


def test_an_unexpected_engine_error_is_one_line_exit_1_and_keeps_finished_rows(
    llama_ckpt: str, inp: Path, tmp_path: Path
) -> None:
    from batchgen.engine.core.llm_engine import LLMEngine

    def crash() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ref = tmp_path / "ref"
    cfg = _cfg(llama_ckpt, inp, ref, data={"window_rows": 40}, engine={"max_num_seqs": 4})
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    out = tmp_path / "out"
    cfg = _cfg(llama_ckpt, inp, out, data={"window_rows": 40}, engine={"max_num_seqs": 4})
    res = run_job(
        cfg, engine=EngineAtStep(LLMEngine(llama_ckpt, cfg.engine), 30, crash), handle_signals=False
    )
    assert res.exit_code == EXIT_FAILED, res.message
    assert res.message.startswith(
        "failed: RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    saved = json.loads((out / "_manifest.json").read_text())["rows_done"]
    assert saved > 0 and "finished rows are saved" in res.message
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK and res.report["run"]["rows"] == 40 - saved
    assert part_contents(out) == part_contents(ref)


# -------------------------------------------------------------------------------------------- multirun
def test_multirun_failures_are_one_line_each_and_per_job_outputs_work(
    llama_ckpt: str, inp: Path, tmp_path: Path
) -> None:
    small = tmp_path / "small.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS[:4]}), small)
    common = [f"model.path={llama_ckpt}", f"data.input={small}", *BASE, "run.progress=off"]
    # both jobs into one output: the second finds the first's output of another configuration
    p = batchgen(["-m", *common, "data.output=same", "sampling.max_tokens=2,3"], tmp_path)
    text = p.stdout + p.stderr
    assert p.returncode == EXIT_CONFIG, text[-3000:]
    assert "Traceback" not in text and "Error executing job" not in text, text[-3000:]
    failed = [ln for ln in text.splitlines() if ln.startswith("batchgen: job ")]
    assert len(failed) == 1 and "job 1 (" in failed[0] and "exited with status 2" in failed[0], text[-3000:]
    assert "holds output of a different configuration" in failed[0]
    # the documented per-job output: one directory per job, the sweep's logs beside them
    p = batchgen(["-m", *common, "data.output=out/${hydra:job.num}", "sampling.max_tokens=2,3"], tmp_path)
    assert p.returncode == EXIT_OK, (p.stdout + p.stderr)[-3000:]
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == ["0", "1", "_logs"]
    assert read_parts(tmp_path / "out" / "1").num_rows == 4
