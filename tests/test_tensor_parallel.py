"""Issue 15: tensor parallelism (`engine.tensor_parallel_size=N`) on the CPU with gloo.

Every case compares an engine sharded over 2 or 4 worker processes with the same engine in one process:
greedy tokens, seeded samples, prompt logprobs, preemption (recompute and swap) and prefix caching must be
identical. The job cases run the real CLI: a tensor-parallel job, and one whose worker is killed mid-run
(exit 75, one line) and then resumed (each row exactly once, the output the uninterrupted one).
Each engine start spawns worker processes (a few seconds each), so each test starts one sharded engine and
runs all its cases through it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import env_without_slurm, job_config, part_contents, wait_for_rows_done
from model_zoo import checkpoint

from batchgen import LLM, SamplingParams
from batchgen.errors import WorkerLost
from batchgen.job.run import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, run_job

PROMPTS = [[1, 5, 9, 33, 7], [4, 4, 4, 100, 200, 300, 17], list(range(10, 40)), [7] * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _same_as_one_process(path: str, tp: int, cases: list, **engine) -> LLM:
    """Run every (prompts, params) case on one process and on `tp` ranks; assert identical tokens."""
    engine = {"device": "cpu", "num_blocks": 64, **engine}
    one = LLM(path, **engine)
    want = [_tokens(one, p, s) for p, s in cases]
    sharded = LLM(path, tensor_parallel_size=tp, **engine)
    got = [_tokens(sharded, p, s) for p, s in cases]
    assert got == want
    return sharded


def test_llama_tp2_greedy_seeded_beams_logprobs_and_prefix_cache(ckpt_factory) -> None:
    """Chunked prefill too (16-token budget: the 30- and 41-token prompts take several steps)."""
    path = ckpt_factory("llama")
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=s, n=2) for s in range(4)]
    shared = [list(range(40, 80)) + [i] for i in range(3)]  # 40 shared tokens: prefix-cache hits
    beams = SamplingParams(beam_width=3, n=2, max_tokens=5)
    cases = [(PROMPTS, GREEDY), (PROMPTS, seeded), (PROMPTS, SamplingParams(temperature=1.0, max_tokens=6)),
             (shared, GREEDY), (PROMPTS, beams)]  # fmt: skip
    engine = {"block_size": 8, "max_num_batched_tokens": 16}
    sharded = _same_as_one_process(path, 2, cases, **engine)
    assert sharded.engine.stats.prompt_tokens_cached >= 80  # the second and third shared prompts hit
    lp = SamplingParams(temperature=0, max_tokens=3, logprobs=3, prompt_logprobs=2)
    one = LLM(path, device="cpu", num_blocks=64, **engine).generate(PROMPTS[:2], lp, use_tqdm=False)
    two = sharded.generate(PROMPTS[:2], lp, use_tqdm=False)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(abs(x[k] - y[k]) < 1e-4 for k in x)


def test_async_scheduling_under_tp_equals_synchronous_one_process(ckpt_factory) -> None:
    """engine.async_scheduling composes with tensor parallelism: each launched step is broadcast from the
    pipelined executor's thread; tokens equal synchronous stepping on one process."""
    path = ckpt_factory("llama")
    cases = [(PROMPTS, GREEDY), (PROMPTS, SamplingParams(temperature=0.8, seed=3, max_tokens=8, n=2))]
    one = LLM(path, device="cpu", num_blocks=64)
    want = [_tokens(one, p, s) for p, s in cases]
    sharded = LLM(path, device="cpu", num_blocks=64, tensor_parallel_size=2, async_scheduling=True)
    assert [_tokens(sharded, p, s) for p, s in cases] == want
    assert sharded.engine.stats.async_steps > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_tp(ckpt_factory, mode: str) -> None:
    """A pool of 12 blocks of 8 tokens for 6 sequences growing to ~40 tokens: preemptions on every rank."""
    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sharded = _same_as_one_process(
        ckpt_factory("llama"), 2, [(prompts, params)], num_blocks=12, block_size=8, preemption_mode=mode,
        num_swap_blocks=64, max_num_seqs=6,
    )  # fmt: skip
    stats = sharded.engine.stats
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0


def test_llama_tp4_replicates_kv_heads_and_pads_the_vocabulary(ckpt_factory) -> None:
    """4 query / 2 KV heads over 4 ranks: each rank holds one query head and a copy of its KV head;
    a vocabulary of 510 over 4 ranks is 128 rows each, the last 2 of rank 3 zero padding."""
    path = ckpt_factory("llama", vocab_size=510, seed=5)
    sharded = _same_as_one_process(path, 4, [(PROMPTS, GREEDY)])
    assert sharded.engine.model.config.num_kv_heads == 1
    assert sharded.engine.model.lm_head.out_features == 128
    # rank 0 holds about a quarter of the weights (norms and the replicated KV head are extra)
    whole = LLM(path, device="cpu", num_blocks=16).engine.runner.weights_bytes()
    assert sharded.engine.runner.weights_bytes() < 0.3 * whole


@pytest.mark.parametrize(
    "arch",
    [
        "mixtral",  # MoE: experts sharded by intermediate size, router replicated
        "qwen2_moe",  # MoE with a shared expert and a dense layer
        "gemma2",  # soft-capping, sliding windows, sandwich norms, tied embeddings
        "phi3",  # fused qkv_proj / gate_up_proj checkpoint tensors
        "qwen3",  # q/k norms
        "qwen3_moe",
        "mistral",  # sliding window
        "qwen2",  # q/k/v biases, windows on some layers
        "gemma",  # (1 + weight) norms, embedding scale, tied embeddings
        "gemma3_text",  # local/global RoPE
        "gemma3",  # the language model of a vision-language checkpoint (renamed tensors)
        "granite",  # embedding / residual / logits multipliers
    ],
)
def test_native_architectures_tp2(arch: str) -> None:
    seeded = SamplingParams(temperature=0.8, max_tokens=8, seed=3)
    _same_as_one_process(checkpoint(arch), 2, [(PROMPTS, GREEDY), (PROMPTS, seeded)])


def test_sizes_that_do_not_split_are_one_clear_error(ckpt_factory, tmp_path: Path) -> None:
    path = ckpt_factory("llama")
    with pytest.raises(ValueError, match=r"engine.tensor_parallel_size=3 .* 4 attention heads"):
        LLM(path, device="cpu", num_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"engine.tensor_parallel_size=2 needs a natively implemented"):
        LLM(path, device="cpu", num_blocks=16, tensor_parallel_size=2, model_impl="transformers")
    with pytest.raises(ValueError, match=r"engine.tensor_parallel_size=2 needs a natively implemented"):
        LLM(checkpoint("gpt2"), device="cpu", num_blocks=16, tensor_parallel_size=2)  # no native code
    with pytest.raises(ValueError, match=r"engine.tensor_parallel_size must be >= 1"):
        LLM(path, device="cpu", tensor_parallel_size=0)
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), inp)
    res = run_job(job_config(path, inp, tmp_path / "out", engine={"tensor_parallel_size": 3}),
                  handle_signals=False, print_summary=False)  # fmt: skip
    assert res.exit_code == EXIT_CONFIG
    assert "engine.tensor_parallel_size=3" in res.message


def test_a_hung_worker_times_out_instead_of_hanging(ckpt_factory, monkeypatch) -> None:
    """A worker that stops answering (SIGSTOP) without dying: the step's collective times out after
    BATCHGEN_TP_TIMEOUT_S and raises WorkerLost (the job's exit 75); shutting down kills the stopped worker."""
    monkeypatch.setenv("BATCHGEN_TP_TIMEOUT_S", "15")
    llm = LLM(ckpt_factory("llama"), device="cpu", num_blocks=64, tensor_parallel_size=2)
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    (worker,) = [
        c for c in psutil.Process().children() if "batchgen.engine.worker.tp_launch" in " ".join(c.cmdline())
    ]
    worker.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(WorkerLost, match="timed out"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 60
    llm.engine.tp_group.close()
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE


# ------------------------------------------------------------------------------------------------- jobs
JOB_PROMPTS = [f"prompt {i} " + "word " * (i % 7) for i in range(16)]
JOB_ARGS = ["engine.device=cpu", "engine.num_blocks=256", "engine.max_num_seqs=1", "sampling.max_tokens=8",
            "sampling.temperature=0.8", "data.window_rows=16", "run.checkpoint_interval_s=0.1",
            "data.shard.index=0", "data.shard.count=1", "run.progress=off"]  # fmt: skip


def _workers(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        children = psutil.Process(proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "batchgen.engine.worker.tp_launch" in " ".join(c.cmdline())]


def test_killed_worker_exits_75_then_the_rerun_resumes_exactly_once(ckpt_factory, tmp_path: Path) -> None:
    """kill -9 of rank 1 mid-run: rank 0 saves the finished rows and exits 75 with one line, no worker left
    behind; the rerun (tensor-parallel too) computes only the missing rows and the output equals an
    uninterrupted single-process run."""
    path = ckpt_factory("llama")
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": JOB_PROMPTS}), inp)
    ref = tmp_path / "ref"
    kw = {"data": {"window_rows": 16}, "engine": {"max_num_seqs": 1}, "sampling": {"max_tokens": 8}}
    assert run_job(job_config(path, inp, ref, **kw), handle_signals=False, print_summary=False).exit_code == 0

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "batchgen.cli", f"model.path={path}", f"data.input={inp}", f"data.output={out}",
           *JOB_ARGS, "engine.tensor_parallel_size=2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_without_slurm(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    saved = wait_for_rows_done(proc, out, 3)
    workers = _workers(proc)
    assert len(workers) == 1 and 3 <= saved < 16, f"{len(workers)} workers, {saved} rows saved"
    workers[0].kill()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, (stdout + stderr)[-3000:]
    text = stdout + stderr
    assert "tensor-parallel worker rank 1 was killed by signal 9" in text and "Traceback" not in text, text[
        -3000:
    ]
    assert not psutil.pid_exists(workers[0].pid) or workers[0].status() == psutil.STATUS_ZOMBIE

    rerun = subprocess.run(cmd, cwd=tmp_path, env=env_without_slurm(), capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert rerun.returncode == EXIT_OK, (rerun.stdout + rerun.stderr)[-3000:]
    assert json.loads((out / "_report.json").read_text())["run"]["rows"] <= 16 - saved
    assert part_contents(out) == part_contents(ref)


def test_job_under_torchrun_equals_the_single_process_job(ckpt_factory, tmp_path: Path) -> None:
    """Ranks started outside (torchrun): rank 0 runs the job, rank 1 serves; both exit 0 and the output is
    the single-process job's."""
    path = ckpt_factory("llama")
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": JOB_PROMPTS[:8]}), inp)
    ref = tmp_path / "ref"
    assert run_job(job_config(path, inp, ref), handle_signals=False, print_summary=False).exit_code == EXIT_OK
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "batchgen.cli", f"model.path={path}", f"data.input={inp}", f"data.output={out}", "data.window_rows=8",
           "engine.device=cpu", "engine.num_blocks=256", "engine.max_num_seqs=8", "sampling.max_tokens=6",
           "sampling.temperature=0.8", "data.shard.index=0", "data.shard.count=1", "run.progress=off",
           "engine.tensor_parallel_size=2"]  # fmt: skip
    p = subprocess.run(
        cmd, cwd=tmp_path, env=env_without_slurm(), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == EXIT_OK, (p.stdout + p.stderr)[-3000:]
    assert part_contents(out) == part_contents(ref)


@pytest.mark.parametrize("reason", ["worker-lost", ""])
def test_sbatch_script_requeues_a_lost_worker_but_not_a_full_disk(tmp_path: Path, reason: str) -> None:
    """generate.sbatch: exit 75 with `worker-lost` in $BATCHGEN_EXIT_REASON_FILE is requeued (here `scontrol`
    is a stub that records its arguments); 75 without a reason (a full disk) is not."""
    fake = tmp_path / "batchgen"
    fake.write_text(f'#!/bin/sh\nprintf "{reason}" > "$BATCHGEN_EXIT_REASON_FILE"\nexit 75\n')
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/requeued\n')
    for f in (fake, scontrol):
        f.chmod(0o755)
    env = env_without_slurm(BATCHGEN_BIN=str(fake), PATH=f"{tmp_path}:/usr/bin:/bin", SLURM_JOB_ID="42")
    sbatch = Path(__file__).parent.parent / "jobs" / "slurm" / "generate.sbatch"
    p = subprocess.run(
        ["bash", str(sbatch), "data.output=x"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    if reason:
        assert p.returncode == 0 and "batchgen exited 75 (worker-lost); requeueing 42" in p.stderr, p.stderr
        assert (tmp_path / "requeued").read_text().split() == ["requeue", "42"]
    else:
        assert p.returncode == 75 and "not requeueing" in p.stderr, p.stderr
        assert not (tmp_path / "requeued").exists()
