"""Pooling requests in the engine: a request added with a :class:`PoolingState` runs its prompt (prefill
only: the step that completes its prompt gives it no logit row and samples nothing; the update finishes it)
and its final hidden states are pooled into ``state.vector`` (float32 ``[H]``, before any head or
normalisation).

The request's group kind is :class:`PoolingGroup`. When a step is scheduled, the group declares each chunk's
segment (:func:`plan_segment`: row ranges of the packed batch and how to reduce each, plain
:class:`PoolRows`, a read of the hidden states carried by the step's ``ForwardInput``); the runner
reduces them (:func:`compute`) into ``RunnerOutput.reads[PoolRows]``; the group absorbs them into the request's state (:func:`fill`) and finishes the
sequence in the step that completes its prompt.

- ``last``: the hidden state of the prompt's last token, from the chunk that completes the prompt. Only that
  token needs a forward, so the request reuses the prefix cache fully (rows sharing an instruction prefix
  compute it once).
- ``mean`` / ``cls``: every prompt token's (the first token's) hidden state is needed, so such a request never
  reads the prefix cache (:meth:`PoolingGroup.lookup_tokens`); ``mean`` sums over the chunks of a chunked prefill and
  restarts when a preempted request recomputes from position 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.output import GroupStep, ScheduledSeq, SchedulerOutput
from batchgen.engine.sched.request_group import Absorbed, Entry, RequestGroup, UpdateContext, unservable
from batchgen.engine.sched.sequence import Request, Sequence
from batchgen.engine.sched.stop import StopRules

if TYPE_CHECKING:
    from batchgen.engine.worker.step_input import RunnerOutput


@dataclass
class PoolingState:
    """What a pooling request asks (``method``) and what has been pooled so far."""

    method: str
    vector: Tensor | None = None
    _sum: Tensor | None = None
    _count: int = 0


@dataclass
class PoolRows:
    """Pooling of one step (a :class:`~batchgen.engine.worker.step_input.HiddenRead`): segment i is the packed
    rows ``starts[i]:ends[i]``, reduced by ``ops[i]``: ``first``, ``last`` or ``sum``."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)

    def compute(self, model: Any, hidden: Tensor) -> Tensor:
        return compute(hidden, self)

    def follow(self, model: Any, hidden: Tensor) -> None:
        """A tensor-parallel worker has nothing to do: rank 0 reduces its own (whole) hidden states."""

    @staticmethod
    def fill(jobs: list[PoolJob], pooled: Tensor) -> None:
        fill(jobs, pooled)


@dataclass
class PoolJob:
    """Segment ``index`` of the step's :class:`PoolRows` belongs to ``state``: ``restart`` (a chunk from
    position 0), ``done`` (the chunk completes the prompt), ``num_tokens`` rows."""

    state: PoolingState
    index: int
    num_tokens: int
    restart: bool
    done: bool


class PoolingGroup(RequestGroup):
    """A pooling request's one sequence: prefill only, no logit row; finished by the step that completes its
    prompt, its pooled segments folded into ``state``."""

    def __init__(self, request: Request, seq: Sequence, state: PoolingState) -> None:
        super().__init__(request, seq)
        self.state = state

    def unservable(self, kv: KVCacheManager, max_num_seqs: int, stop: StopRules) -> str | None:
        n = len(self.request.prompt_token_ids)
        return unservable(kv, -(-n // kv.block_size), f"prompt ({n} tokens)")

    def overlappable(self) -> bool:
        return False

    def lookup_tokens(self, seq: Sequence) -> list[int]:
        """``mean`` / ``cls`` need every prompt token's hidden state: no prefix-cache hit."""
        if self.state.method == "last":
            return seq.token_ids
        return seq.token_ids[:1]  # the manager never matches a sequence's last token: no hit

    def plan_outputs(
        self, entries: list[Entry], out: SchedulerOutput, kv: KVCacheManager
    ) -> list[RequestGroup]:
        step = GroupStep()
        for _, s, offset in entries:
            job = plan_segment(self.state, s, offset, out)
            if job is not None:
                step.claim(PoolRows, job)
            if s.completes:
                step.completed.append(s.seq)
        if step:
            out.parts.append((self, step))
        return []

    def absorb(self, step: GroupStep, output: RunnerOutput, ctx: UpdateContext) -> Absorbed:
        step.fill_reads(output)
        done = Absorbed()
        for seq in step.completed:
            seq.finish_reason = "stop"
            self.leave(seq, done)
        return done


def plan_segment(
    state: PoolingState, sched: ScheduledSeq, offset: int, out: SchedulerOutput
) -> PoolJob | None:
    """The pooling job of one scheduled chunk of a pooling request (its first token at packed row ``offset``),
    its segment declared on the step ``out``; None when the chunk adds nothing to the pooled vector."""
    num_prompt = len(sched.seq.request.prompt_token_ids)
    start = sched.start
    end = min(start + sched.num_tokens, num_prompt)
    if start >= num_prompt:
        return None
    done = end == num_prompt
    if state.method == "cls":
        if start != 0:
            return None
        op, lo, hi = "first", offset, offset + 1
    elif state.method == "mean":
        op, lo, hi = "sum", offset, offset + end - start
    else:  # last
        if not done:
            return None
        op, lo, hi = "last", offset + end - start - 1, offset + end - start
    rows = out.read(PoolRows)
    rows.starts.append(lo)
    rows.ends.append(hi)
    rows.ops.append(op)
    return PoolJob(state, len(rows.ops) - 1, end - start, start == 0, done)


def compute(hidden: Tensor, rows: PoolRows) -> Tensor:
    """After a forward: ``[len(rows.ops), H]`` float32 on the CPU, each segment of the packed ``hidden``
    reduced (``first`` / ``last`` row, or the ``sum`` of its rows)."""
    out = []
    for lo, hi, op in zip(rows.starts, rows.ends, rows.ops):
        seg = hidden[lo:hi].float()
        out.append(seg.sum(0) if op == "sum" else seg[0])
    return torch.stack(out).cpu()


def fill(jobs: list[PoolJob], pooled: Tensor) -> None:
    """Fold the runner's ``pooled`` segments into the jobs' states."""
    for job in jobs:
        state, v = job.state, pooled[job.index]
        if state.method != "mean":
            state.vector = v
            continue
        if job.restart:
            state._sum, state._count = None, 0
        state._sum = v if state._sum is None else state._sum + v
        state._count += job.num_tokens
        if job.done:
            state.vector = state._sum / state._count
