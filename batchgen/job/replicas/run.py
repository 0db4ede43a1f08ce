"""A job over several engine replicas (``engine.data_parallel_size > 1`` or ``run.executor=ray``): the same
plan, output directory, gate, writer and report as the one-engine job (:mod:`batchgen.job.run`), with the
engine loop replaced by a :class:`~batchgen.job.replicas.coordinator.Coordinator` over replica processes or actors.

Only this process writes the output: parts, checkpoints and manifest are committed exactly as with one engine,
so resume, exactly-once and the layout do not depend on how many replicas ran, or where.

Replica resources: on the CPU, each local replica gets ``cores // N`` torch threads (N =
``engine.data_parallel_size``); on CUDA, local replica i gets the devices ``[i*T, (i+1)*T)`` of the visible
ones (T = ``engine.tensor_parallel_size``) through ``CUDA_VISIBLE_DEVICES``; a Ray actor requests T GPUs (Ray
assigns them), or its thread count in CPUs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from batchgen.errors import ConfigError
from batchgen.job.config import JobConfig
from batchgen.job.feeder import ReadAhead, WindowWork
from batchgen.job.replicas.coordinator import Coordinator
from batchgen.job.replicas.replica import ReplicaSetup
from batchgen.job.result import JobResult

logger = logging.getLogger("batchgen.job")


def uses_replicas(cfg: JobConfig) -> bool:
    """Whether the job runs its engines as replicas (else one engine in the job's own process)."""
    return cfg.engine.data_parallel_size > 1 or cfg.run.executor != "local"


def replica_threads(cfg: JobConfig) -> int | None:
    """The torch threads each replica computes with on the CPU: its share of the cores, ``cores // N``; None
    on CUDA, or for a job without replicas (its engine follows the thread policy of
    :mod:`batchgen.runtime.threads`)."""
    if not uses_replicas(cfg) or _uses_cuda(cfg.engine.device):
        return None
    return max(1, _cpu_count() // cfg.engine.data_parallel_size)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _uses_cuda(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def replica_setups(cfg: JobConfig, model_path: str) -> list[ReplicaSetup]:
    """One setup per replica (see the module docstring for devices and threads); ConfigError when this
    machine has too few GPUs for local replicas."""
    e = cfg.engine
    n, tp = e.data_parallel_size, e.tensor_parallel_size
    engine = dataclasses.replace(e, data_parallel_size=1)
    cuda = _uses_cuda(e.device)
    local = cfg.run.executor == "local"
    gpus: list[str] = []
    if cuda and local:
        if e.device not in ("auto", "cuda"):
            raise ConfigError(
                f"engine.device={e.device} names one device, but engine.data_parallel_size={n} replicas each "
                "need their own: use engine.device=cuda (replicas take the visible devices in turn)"
            )
        gpus = _visible_gpus()
        if len(gpus) < n * tp:
            raise ConfigError(
                f"engine.data_parallel_size={n} x engine.tensor_parallel_size={tp} needs {n * tp} GPUs; "
                f"{len(gpus)} are visible: lower engine.data_parallel_size"
            )
        engine = dataclasses.replace(engine, device="cuda")
    threads = replica_threads(cfg)
    max_in_flight = max(1, 2 * e.max_num_seqs // cfg.sampling.n)
    setups = []
    for i in range(n):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])} if gpus else {}
        setups.append(ReplicaSetup(i, model_path, engine, cfg.model.dtype, cfg.model.implementation,
                                   max_in_flight, threads, env))  # fmt: skip
    return setups


def make_executor(cfg: JobConfig) -> Any:
    if cfg.run.executor == "ray":
        from batchgen.job.replicas.ray_actors import RayReplicas

        return RayReplicas(cfg.run.ray_address)
    from batchgen.job.replicas.local import LocalReplicas

    return LocalReplicas()


def run_replicas(job: Any, works: Any, first: list[WindowWork], tokenizer: Any, retry_rows: int) -> JobResult:
    """The rest of ``run_job`` for a job over replicas: ``job`` is its ``_Job`` (plan, manifest, writer and
    gate set up; the first windows read by the preflight in ``first``, the others to come from ``works``)."""
    plan, m, writer, gate, stop = job.plan, job.manifest, job.writer, job.gate, job.stop
    if job.engine is not None:
        raise ConfigError("a job over engine replicas starts its own engines: pass no engine to run_job")
    cfg = plan.cfg
    ahead = ReadAhead(works)
    next_window = job.window_source(first, ahead)

    def on_ready(max_model_len: int) -> None:
        plan.prompt_spec.max_model_len = max_model_len

    def on_step() -> None:
        job.progress.update(0, stats=coord.stats)
        if job.metrics is not None:
            job._update_metrics()
        if gate.closed:
            gate.check()
        elif writer.checkpoint_due():
            writer.checkpoint(list(coord.active.values()))

    setups = replica_setups(cfg, plan.model_path)
    _warn_idle_replicas(m.num_windows - len(m.windows), len(setups))
    coord = Coordinator(make_executor(cfg), setups, next_window, tokenizer, stop,
                        cfg.run.max_replica_restarts, job.on_output, on_step, on_ready)  # fmt: skip
    job.in_flight = coord  # what a stop or an error saves: the finished rows of its unfinished windows
    job.engine = coord  # the engines' stats and tokenizer, as the report and the examples read them
    try:
        logger.info(
            "starting %d engine replica(s) (%s executor%s)", len(setups), cfg.run.executor,
            f", {setups[0].threads} CPU thread(s) each" if setups[0].threads else "",
        )  # fmt: skip
        coord.start()
        t_run = time.monotonic()
        job.start_progress(initial=m.rows_done - retry_rows)
        for work in coord.run():
            gate.window_finished(work)
        if stop.requested:
            job.save_finished_rows()
        elif gate.held:
            gate.check(final=True)
            gate.release()
    finally:
        coord.close()
        ahead.close()
    return _finish(job, coord, t_run)


def _warn_idle_replicas(left: int, replicas: int) -> None:
    if left < replicas:
        logger.warning(
            "%d window(s) to do for %d replicas: %d replica(s) will have nothing to do (windows are the unit "
            "handed out; a new output with a smaller data.window_rows spreads the rows wider)",
            left, replicas, replicas - left,
        )  # fmt: skip


def _finish(job: Any, coord: Coordinator, t_run: float) -> JobResult:
    """The job's report and result, with the replicas' own figures."""
    job.end_progress()
    wall = time.monotonic() - t_run
    status = "complete" if job.manifest.complete else "incomplete"
    extra = {
        "startup_s": round(t_run - job.t_start, 3),
        "executor": job.plan.cfg.run.executor,
        "replicas": coord.replica_report(wall),
        "replica_restarts": coord.restarts,
    }
    return job.conclude(job.report(status, wall, extra, coord.stats))
