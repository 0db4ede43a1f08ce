"""Tensor-parallel execution of the engine's steps: rank 0 drives, the other ranks follow.

Rank 0 runs the whole engine (scheduler, KV block manager, sampler) with a :class:`TPModelRunner`; ranks
1..N-1 run only :func:`serve` (the worker loop) over their own model shard and KV cache shard. Each step,
rank 0's runner broadcasts the plain part of the step's :class:`~batchgen.engine.worker.step_input.StepInput`
(:class:`StepMessage`: the block moves, the adapter slot loads and the forward with its per-token inputs, on
the CPU, tokens of the previous step already filled in) to every
worker with ``torch.distributed.broadcast_object_list`` over a gloo group of its own (:class:`StepChannel`);
then every rank performs the same block moves on its KV shard and the same forward, whose all-reduces meet in
lockstep, and the LM-head shards are gathered on rank 0, which samples as one process would. The runner is
called by the executor, inline or from the pipelined executor's thread, so pipelining composes.

Invariants:
- every rank applies the same messages in the same order (one broadcast per step, in step order), so the
  collectives of a forward pair up, the KV shards hold the same blocks and the adapter slots the same
  adapters (each rank its shard, read by the worker itself);
- the KV pool has the same number of blocks on every rank: the minimum of what each rank can hold;
- workers wait for the next message under a long idle timeout (``IDLE_WAIT``: rank 0 may be idle between
  steps for long); rank 0's broadcasts and the collectives inside a step fail after
  ``BATCHGEN_TP_TIMEOUT_S``.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from batchgen.attention import ForwardContext
from batchgen.engine.config import EngineConfig
from batchgen.engine.worker.model_runner import ModelRunner
from batchgen.engine.worker.step_input import BlockMoves, ForwardInput, RunnerOutput, SlotLoad, StepInput
from batchgen.errors import WorkerLost

logger = logging.getLogger(__name__)

IDLE_WAIT = datetime.timedelta(days=30)
"""How long a worker waits for rank 0's next step (rank 0 may sit idle between ``generate`` calls)."""


@dataclass
class StepMessage:
    """One step as the workers need it: block moves, adapter slot loads (without rank 0's parsed copies), then
    the forward (None: a step that only moves blocks)."""

    moves: BlockMoves
    forward: ForwardInput | None
    loads: list[SlotLoad] = field(default_factory=list)


class StepChannel:
    """Rank 0's messages to every worker: one ``broadcast_object_list`` each over a gloo group created for
    them (so they work beside NCCL); and the min-over-ranks agreement on the KV pool size. Every rank builds
    its channel right after joining the process group; a worker waits for the next step up to ``IDLE_WAIT``,
    rank 0 sends under ``send_timeout`` (the collectives' timeout: a stuck worker fails the step)."""

    def __init__(self, device: torch.device, send_timeout: datetime.timedelta | None = None) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
        if send_timeout is not None:  # rank 0: a broadcast to a stuck worker fails like a collective
            dist.distributed_c10d._set_pg_timeout(send_timeout, self.group)
        self.device = device  # where collectives' tensors live (CUDA for NCCL)
        self.lost: str | None = None  # set by rank 0's watchdog when a worker process exited

    def post(self, message: object) -> None:
        if self.lost is not None:
            raise WorkerLost(self.lost)
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> object:
        """The next message (blocks while rank 0 is idle; raises when rank 0 is gone)."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def abort(self) -> None:
        """Abort the step group: a pending broadcast raises in its caller."""
        dist.distributed_c10d._abort_process_group(self.group)


class TPModelRunner(ModelRunner):
    """A rank's model runner under tensor parallelism (rank 0: the engine's runner, posting each step; other
    ranks: driven by :func:`serve`). Decode steps run eagerly (no padding to buckets, no CUDA graphs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        device: torch.device,
        backend: str,
        max_model_len: int,
        channel: StepChannel,
    ) -> None:
        super().__init__(model, config, device, backend, max_model_len)
        self.use_cuda_graphs = self.pad_decodes = False
        self.channel = channel
        self.rank = model.config.tp_rank
        self.in_step = False  # rank 0: inside a step's collectives (the launcher's watchdog reads it)

    def determine_num_blocks(self) -> int:
        """The smallest pool any rank can hold (each sizes its own from its memory and weights shard)."""
        try:
            return self.channel.min_over_ranks(super().determine_num_blocks())
        except RuntimeError as e:
            if self.rank != 0 or not _is_dist_error(e):
                raise
            raise RuntimeError(f"{self._why_lost(e)} while starting (its own message is above)") from e

    def execute(self, step: StepInput) -> RunnerOutput:
        """Rank 0: broadcast the step (placeholders filled in first, on this rank's device), then run it here;
        a failed collective means a rank is gone."""
        fwd = step.forward
        if fwd is not None and step.fill is not None:
            fwd.ids[step.fill[0]] = step.fill[1]
            step = replace(step, fill=None)
        loads = [load.for_workers() for load in step.loads]
        msg = StepMessage(step.moves, fwd.to(torch.device("cpu")) if fwd is not None else None, loads)
        self.in_step = True
        try:
            self.channel.post(msg)
            return super().execute(step)
        except RuntimeError as e:
            if isinstance(e, WorkerLost) or not _is_dist_error(e):
                raise
            self.channel.lost = self._why_lost(e)  # no more steps; shutdown does not wait for the workers
            raise WorkerLost(self.channel.lost) from e
        finally:
            self.in_step = False

    def _why_lost(self, e: BaseException) -> str:
        """The watchdog's account of the failure (which worker exited, how) when it has one within 3 s."""
        deadline = time.monotonic() + 3.0
        while self.channel.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.channel.lost is not None:
            return self.channel.lost
        return f"a tensor-parallel collective failed or timed out (BATCHGEN_TP_TIMEOUT_S): {_first_line(e)}"

    @torch.inference_mode()
    def follow(self, msg: StepMessage) -> None:
        """A worker's share of one step: the block moves, then the forward and the logits collectives rank 0
        runs (each read of the hidden states first, then the sampled rows, as :meth:`ModelRunner.forward` does)."""
        self.apply_moves(msg.moves)
        self.apply_loads(msg.loads)
        fwd = msg.forward
        if fwd is None:
            return
        fwd = fwd.to(self.device)
        ctx = ForwardContext(self.attn, fwd.meta, self.kv_cache, **fwd.context)
        hidden = self.model(fwd.ids, fwd.positions, ctx)
        for read in fwd.reads.values():
            read.follow(self.model, hidden)
        if fwd.last.numel():  # as rank 0: a step may have no logit rows (reads of the hidden states only)
            self.model.compute_logits(hidden[fwd.last])


def serve(runner: TPModelRunner) -> None:
    """A worker's loop: apply each step rank 0 posts until it posts None (shutdown)."""
    while True:
        msg = runner.channel.receive()
        if msg is None:
            return
        assert isinstance(msg, StepMessage)
        runner.follow(msg)


def _is_dist_error(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "peer", "timed out", "timeout", "abort"))


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:160]
