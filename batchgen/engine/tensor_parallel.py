"""Tensor-parallel execution of the engine's steps: rank 0 drives, the other ranks follow.

Rank 0 runs the whole engine (scheduler, KV block manager, sampler) with a :class:`TPModelRunner`; ranks
1..N-1 run only :func:`serve` (the worker loop) over their own model shard and KV cache shard. Each step,
rank 0 prepares the batch exactly as one process would (:meth:`ModelRunner.prepare_inputs`) and posts one
pickled :class:`StepInputs` (block swaps and copies, the flat input tensors, the prompt-logprob rows) on the
:class:`StepChannel`; then every rank performs the same block moves on its KV shard and the same forward, whose
all-reduces meet in lockstep, and the LM-head shards are gathered on rank 0, which samples as before.

Invariants:
- every rank applies the same messages in the same order (the channel numbers them), so the collectives of a
  forward pair up and the KV shards hold the same blocks;
- the KV pool has the same number of blocks on every rank: the minimum of what each rank can hold;
- workers wait for messages on the rendezvous store (no timeout while rank 0 is idle between steps);
  collectives run only inside a step, under the process group's timeout.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from batchgen.attention import AttentionMetadata, ForwardContext
from batchgen.engine import prompt_logprobs
from batchgen.engine.config import EngineConfig
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.scheduler import SchedulerOutput
from batchgen.errors import WorkerLost

logger = logging.getLogger(__name__)

_IDLE_WAIT = datetime.timedelta(hours=1)


@dataclass
class ForwardInputs:
    """One packed forward: what :meth:`ModelRunner.prepare_inputs` returns, on the CPU, plus the rows whose
    prompt logprobs rank 0 computes (every rank computes their logits shards)."""

    ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    last: Tensor
    prompt_rows: list[int]

    def to(self, device: torch.device) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        m = self.meta
        meta = AttentionMetadata(
            slot_mapping=m.slot_mapping.to(device),
            num_decode_seqs=m.num_decode_seqs,
            seq_lens=m.seq_lens.to(device),
            cu_seqlens_q=m.cu_seqlens_q.to(device),
            block_tables=m.block_tables.to(device),
            max_seq_len=m.max_seq_len,
            max_query_len=m.max_query_len,
        )
        return self.ids.to(device), self.positions.to(device), meta, self.last.to(device)


@dataclass
class StepInputs:
    """One step as the workers need it: block moves (the runner's order: swap-outs, copies, swap-ins), then
    the forward (None: a step that only moves blocks)."""

    swap_out: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    forward: ForwardInputs | None


class StepChannel:
    """Numbered messages from rank 0 to every worker through the rendezvous store (`step/0`, `step/1`, ...),
    and the min-over-ranks agreement on the KV pool size."""

    def __init__(self, store: dist.Store, device: torch.device) -> None:
        self.store = dist.PrefixStore("batchgen/", store)
        self.device = device  # where collectives' tensors live (CUDA for NCCL)
        self.count = 0
        self.unread: list[str] = []  # posted keys some worker may not have read yet
        self.lost: str | None = None  # set by rank 0's watchdog when a worker process exited

    def post(self, message: object) -> None:
        if self.lost is not None:
            raise WorkerLost(self.lost)
        key = f"step/{self.count}"
        self.store.set(key, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self.unread.append(key)
        self.count += 1

    def all_read(self) -> None:
        """Called after a collective every worker has reached: every posted message was read; drop them."""
        for key in self.unread:
            self.store.delete_key(key)
        self.unread.clear()

    def receive(self) -> object:
        """The next message (blocks while rank 0 is idle; raises when rank 0's store is gone)."""
        key = f"step/{self.count}"
        while True:
            try:
                self.store.wait([key], _IDLE_WAIT)
                break
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    raise
        self.count += 1
        return pickle.loads(self.store.get(key))

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


class TPModelRunner(ModelRunner):
    """A rank's model runner under tensor parallelism (rank 0: the engine's runner, posting each step; other
    ranks: driven by :func:`serve`). Decode steps run eagerly (no padding to buckets, no CUDA graphs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        device: torch.device,
        backend: str,
        channel: StepChannel,
    ) -> None:
        super().__init__(model, config, device, backend)
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

    def execute(self, out: SchedulerOutput) -> Tensor:
        ids, pos, meta, last = self.prepare_inputs(out)
        rows = prompt_logprobs.rows(out) if self.collect_prompt_logprobs else []
        fwd = ForwardInputs(*ForwardInputs(ids, pos, meta, last, rows).to(torch.device("cpu")), rows)
        logits = self._drive(StepInputs(out.swap_out, out.copies, out.swap_in, fwd), out)
        assert logits is not None
        return logits

    def swap(self, out: SchedulerOutput) -> None:
        """A step that only moves blocks (everything runnable was preempted)."""
        self._drive(StepInputs(out.swap_out, out.copies, out.swap_in, None), out)

    def _drive(self, msg: StepInputs, out: SchedulerOutput) -> Tensor | None:
        """Rank 0: post the step, then run it here; a failed collective means a rank is gone."""
        self.in_step = True
        try:
            self.channel.post(msg)
            result = self.apply(msg, out)
            if msg.forward is not None:
                self.channel.all_read()
            return result
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
    def apply(self, msg: StepInputs, out: SchedulerOutput | None = None) -> Tensor | None:
        """Perform one step on this rank: block moves, then the forward; rank 0 gets the full logits of the
        sampled rows (and fills prompt logprobs from `out`), other ranks None."""
        ModelRunner.swap(self, msg)  # type: ignore[arg-type]  # duck-typed: the lists of a SchedulerOutput
        fwd = msg.forward
        if fwd is None:
            return None
        ids, pos, meta, last = fwd.to(self.device)
        hidden = self.model(ids, pos, ForwardContext(self.attn, meta, self.kv_cache))
        if out is not None and self.collect_prompt_logprobs:
            prompt_logprobs.collect(self.model, hidden, out)
        elif fwd.prompt_rows:
            index = torch.tensor(fwd.prompt_rows, dtype=torch.long, device=hidden.device)
            self.model.compute_logits(hidden[index])
        logits = self.model.compute_logits(hidden[last])
        return logits if self.rank == 0 else None


def serve(runner: TPModelRunner) -> None:
    """A worker's loop: apply each step rank 0 posts until it posts None (shutdown)."""
    while True:
        msg = runner.channel.receive()
        if msg is None:
            return
        assert isinstance(msg, StepInputs)
        runner.apply(msg)


def _is_dist_error(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "peer", "timed out", "timeout"))


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:160]
