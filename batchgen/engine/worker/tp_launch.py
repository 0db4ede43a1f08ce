"""Starting, watching and stopping the ranks of a tensor-parallel engine (``engine.tensor_parallel_size=N``).

Two ways to get N ranks:

- **spawned** (``LLM(...)``, the CLI, one Slurm task with N GPUs): the engine's process is rank 0; it opens a
  TCP rendezvous store on 127.0.0.1 and starts ranks 1..N-1 as ``python -m batchgen.engine.worker.tp_launch`` child
  processes (no re-import of the caller's ``__main__``), each on its own device (``cuda:i``; the CPU with
  gloo). Rank 0 watches them: a worker that exits makes the current step fail with
  :class:`~batchgen.errors.WorkerLost` (the job exits 75: rerun or requeue to resume); if a collective does
  not return within ``GRACE_S`` of the death, rank 0 aborts the process group so that it raises (the engine
  never exits the process itself; only the job maps ``WorkerLost`` to its exit status). Workers exit when rank 0
  does (they watch their parent) and ignore SIGINT/SIGTERM/SIGUSR1 (rank 0 decides when the job stops).
- **launched outside** (``torchrun --nproc-per-node=N batchgen ...``, or ``srun`` exporting ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): ``WORLD_SIZE`` must equal N; rank 0 runs
  the job, every other rank serves steps (the CLI sends them straight to :func:`serve_from_env`; an ``LLM``
  built on such a rank serves, then exits the process).

Either way rank 0 broadcasts the model path, dtype, implementation and engine config to the workers (they parse no
configuration of their own), every rank loads its own shard, and the KV pool size is agreed (the minimum).
Collectives time out after ``BATCHGEN_TP_TIMEOUT_S`` seconds (default 600): no rank waits forever on a
dead or stuck peer. NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from batchgen.engine.config import EngineConfig
from batchgen.engine.worker.tensor_parallel import StepChannel, TPModelRunner, serve
from batchgen.errors import WorkerLost

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "BATCHGEN_TP_TIMEOUT_S"
GRACE_S = 15.0
"""Seconds rank 0 waits, after a worker died mid-step, for the step's collective to fail by itself."""


@dataclass
class WorkerSetup:
    """What rank 0 tells every worker before loading: the same model, dtype, implementation and engine;
    ``load(device, rank, world)`` (picklable) builds the rank's model instead of ``load_model`` (a custom
    model); ``attach(model)`` (picklable) adds what the features write into the model's weights before the KV
    cache is sized, returned as the runner's :attr:`ModelRunner.adapters`."""

    model: str
    dtype: str
    implementation: str
    config: EngineConfig
    load: Callable[[torch.device, int, int], torch.nn.Module] | None = None
    attach: Callable[[torch.nn.Module], Any] | None = None


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when an outside launcher started the ranks (``RANK`` and a
    ``WORLD_SIZE`` above 1 in the environment); None otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if "RANK" not in os.environ or world <= 1:
        return None
    rank = int(os.environ["RANK"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def rank_device(device: str, index: int) -> torch.device:
    """Rank device: the CPU, or CUDA device ``base + index`` (``engine.device=cuda:base``; 0 for auto/cuda)."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"engine.device={device!r} but no CUDA device is available; use device=cpu or auto")
    base = (torch.device(device).index or 0) if device.startswith("cuda") else 0
    if base + index >= torch.cuda.device_count():
        raise ValueError(
            f"engine.tensor_parallel_size needs CUDA device {base + index}, but only "
            f"{torch.cuda.device_count()} are visible; request more GPUs (--gres=gpu:N) or lower it"
        )
    return torch.device("cuda", base + index)


def abort_process_group(channel: StepChannel) -> None:
    """Abort the step channel's group and the default process group: their pending and future collectives
    raise in their callers."""
    channel.abort()
    dist.distributed_c10d._abort_process_group()


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "600"))


def init_process_group(store: dist.Store, rank: int, world: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s()),
    )


class TPGroup:
    """Rank 0's handle on its workers: the step channel, rank 0's device, the spawned processes (none when
    launched outside) and the watchdog thread. :meth:`close` (also at interpreter exit) stops the workers."""

    def __init__(self, channel: StepChannel, device: torch.device, procs: list[subprocess.Popen]) -> None:
        self.channel = channel
        self.device = device
        self.procs = procs
        self.runner: TPModelRunner | None = None  # set by the engine; the watchdog reads `runner.in_step`
        self.closed = False
        self._lost_at: float | None = None
        self._aborted = False
        if procs:
            threading.Thread(target=self._watch, name="batchgen-tp-watchdog", daemon=True).start()
        atexit.register(self.close)  # before multiprocessing's and torch's own exit handlers run

    def _watch(self) -> None:
        """Every 0.2 s: report a worker process that exited; end a step still stuck on it ``GRACE_S`` later
        by aborting the process groups (the step then raises in the engine's thread)."""
        while not self.closed:
            time.sleep(0.2)
            runner = self.runner
            busy = runner is not None and runner.in_step
            dead = [(r, p.returncode) for r, p in enumerate(self.procs, 1) if p.poll() is not None]
            if dead and self._lost_at is None and not self.closed:
                self._lost_at = time.monotonic()
                r, code = dead[0]
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                self.channel.lost = f"tensor-parallel worker rank {r} {how}"
                logger.error("%s", self.channel.lost)
            if not busy or self._aborted or self.closed:
                continue
            if self._lost_at is not None and time.monotonic() - self._lost_at > GRACE_S:
                self._abort_step()

    def _abort_step(self) -> None:
        """A worker died and the step's collective did not fail by itself: abort the process
        groups, so the collective raises in the engine's thread (which reports :class:`WorkerLost`); never exit the
        process from here (an ``LLM`` user's process is not the job's to end)."""
        self._aborted = True
        logger.error("%s: aborting the process groups so that the step fails", self.channel.lost)
        try:
            abort_process_group(self.channel)
        except Exception as e:  # noqa: BLE001 - the step may have failed meanwhile, destroying the group
            logger.warning("aborting the tensor-parallel process group failed: %s", e)

    def close(self) -> None:
        """Tell the workers to stop, wait for them (then kill), and leave the process group. Idempotent; the
        engine cannot step afterwards."""
        global _ACTIVE
        if self.closed:
            return
        self.closed = True
        self.runner = None  # the engine's model may be freed
        atexit.unregister(self.close)
        if _ACTIVE is self:
            _ACTIVE = None
        alive = self.channel.lost is None and all(p.poll() is None for p in self.procs)
        if alive:
            try:
                self.channel.post(None)
            except Exception:  # noqa: BLE001 - best effort: the workers also stop when this process exits
                alive = False
        self.channel.lost = self.channel.lost or "the tensor-parallel engine was shut down"
        deadline = time.monotonic() + (10.0 if alive else 0.0)
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - an aborted group may already be gone
                logger.debug("destroying the process group: %s", e)


_ACTIVE: TPGroup | None = None
"""The process's tensor-parallel engine: torch.distributed has one default process group per process."""


def start(setup: WorkerSetup) -> TPGroup:
    """Rank 0: start (or join) the other ranks and post them the setup. On a worker rank of an outside
    launcher this serves steps until rank 0 is done and then exits the process. A process runs one
    tensor-parallel engine at a time: starting one shuts down the previous one's workers."""
    global _ACTIVE
    if _ACTIVE is not None:
        logger.warning("a new tensor-parallel engine starts: the previous one in this process is shut down")
        _ACTIVE.close()
    tp = setup.config.tensor_parallel_size
    outside = env_rank()
    procs: list[subprocess.Popen] = []
    if outside is not None:
        rank, world, local = outside
        if world != tp:
            raise ValueError(
                f"engine.tensor_parallel_size={tp} but the launcher started WORLD_SIZE={world} ranks; "
                "make them equal (torchrun --nproc-per-node / srun --ntasks)"
            )
        if rank != 0:
            serve_from_env()
            sys.exit(0)
        device = rank_device(setup.config.device, local)
        store = _env_store(rank, world)
    else:
        devices = [rank_device(setup.config.device, r) for r in range(tp)]  # all checked before any spawn
        device = devices[0]
        store = dist.TCPStore(
            "127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s()),
        )  # fmt: skip
        for r in range(1, tp):
            args = [str(r), str(tp), str(store.port), str(devices[r]), str(os.getpid())]
            procs.append(subprocess.Popen([sys.executable, "-m", "batchgen.engine.worker.tp_launch", *args]))
    try:
        init_process_group(store, 0, tp, device)
    except Exception as e:
        for p in procs:
            p.kill()
        raise WorkerLost(f"tensor-parallel ranks did not start: {e}") from e
    channel = StepChannel(device, datetime.timedelta(seconds=timeout_s()))
    channel.post(setup)
    _ACTIVE = TPGroup(channel, device, procs)
    return _ACTIVE


def _env_store(rank: int, world: int) -> dist.Store:
    store, _, _ = next(
        dist.rendezvous("env://", rank, world, timeout=datetime.timedelta(seconds=timeout_s()))
    )
    return store


def run_worker(store: dist.Store, rank: int, world: int, device: torch.device) -> None:
    """A worker rank: join, receive the setup, load this rank's shard, agree on the KV pool, serve steps."""
    from batchgen.attention import resolve_backend
    from batchgen.models.loader import load_model

    init_process_group(store, rank, world, device)
    channel = StepChannel(device)
    setup = channel.receive()
    assert isinstance(setup, WorkerSetup)
    cfg = setup.config
    model = setup.load(device, rank, world) if setup.load is not None else load_model(
        setup.model, dtype=setup.dtype, device=device, implementation=setup.implementation,
        tp_rank=rank, tp_size=world,
    )  # fmt: skip
    max_model_len = cfg.max_model_len or model.config.max_model_len
    backend = resolve_backend(cfg.attention_backend, device)
    adapters = setup.attach(model) if setup.attach is not None else None  # before KV sizing
    runner = TPModelRunner(model, cfg, device, backend, max_model_len, channel)
    runner.adapters = adapters
    runner.allocate_kv_cache(runner.determine_num_blocks())
    runner.allocate_swap_space(runner.determine_num_swap_blocks() if cfg.preemption_mode == "swap" else 0)
    serve(runner)
    dist.destroy_process_group()


def serve_from_env() -> int:
    """A worker rank started by torchrun / srun: serve rank 0 until it is done. Returns the exit status."""
    outside = env_rank()
    assert outside is not None
    rank, world, local = outside
    device = rank_device("cpu" if not torch.cuda.is_available() else "cuda", local)
    return _serve(lambda: _env_store(rank, world), rank, world, device)


def _serve(store_factory, rank: int, world: int, device: torch.device) -> int:
    try:
        run_worker(store_factory(), rank, world, device)
        return 0
    except Exception as e:  # noqa: BLE001 - one line; rank 0 reports the failure to the user
        if os.environ.get("BATCHGEN_DEBUG", "") not in ("", "0"):
            raise
        lines = str(e).strip().splitlines()
        sys.stderr.write(
            f"batchgen tensor-parallel rank {rank}: {type(e).__name__}: {lines[0] if lines else ''}\n"
        )
        return 1


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str]) -> int:
    """Entry of a spawned worker: ``python -m batchgen.engine.worker.tp_launch RANK WORLD PORT DEVICE PARENT_PID``."""
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    device, parent = torch.device(argv[3]), int(argv[4])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()

    def store() -> dist.Store:
        timeout = datetime.timedelta(seconds=timeout_s())
        return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)

    return _serve(store, rank, world, device)


if __name__ == "__main__":  # run the imported module's main: pickled messages name its classes
    from batchgen.engine.worker import tp_launch

    sys.exit(tp_launch.main(sys.argv[1:]))
