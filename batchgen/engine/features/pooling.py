"""Pooling requests in the engine: a request that carries a :class:`PoolingState` runs its prompt (prefill
only: the step that completes its prompt gives it no logit row and samples nothing; the update finishes it)
and its final hidden states are pooled into ``state.vector`` (float32 ``[H]``, before any head or
normalisation).

Per step, like prompt logprobs: :func:`plan` turns the scheduler's output into plain :class:`PoolRows` (row
ranges of the packed batch and how to reduce each) carried by the step's ``ForwardInput``; the runner reduces
them (:func:`compute`) into ``RunnerOutput.pooled``; the engine's update folds them into the requests'
states (:func:`fill`) before the output processor finishes the requests.

- ``last``: the hidden state of the prompt's last token, from the chunk that completes the prompt. Only that
  token needs a forward, so the request reuses the prefix cache fully (rows sharing an instruction prefix
  compute it once).
- ``mean`` / ``cls``: every prompt token's (the first token's) hidden state is needed, so such a request never
  reads the prefix cache (:func:`cache_lookup_tokens`); ``mean`` sums over the chunks of a chunked prefill and
  restarts when a preempted request recomputes from position 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from batchgen.engine.worker.step_input import PoolRows


@dataclass
class PoolingState:
    """What a pooling request asks (``method``) and what has been pooled so far."""

    method: str
    vector: Tensor | None = None
    _sum: Tensor | None = None
    _count: int = 0


def cache_lookup_tokens(seq, tokens: list[int]) -> list[int]:
    """The tokens a pooling sequence may match in the prefix cache (``tokens`` unchanged otherwise)."""
    state = getattr(seq.request, "pooling", None)
    if state is None or state.method == "last":
        return tokens
    return tokens[:1]  # the manager never matches a sequence's last token: no hit


@dataclass
class PoolJob:
    """Segment ``index`` of the step's :class:`PoolRows` belongs to ``state``: ``restart`` (a chunk from
    position 0), ``done`` (the chunk completes the prompt), ``num_tokens`` rows."""

    state: PoolingState
    index: int
    num_tokens: int
    restart: bool
    done: bool


def plan(out) -> tuple[list[PoolJob], PoolRows | None]:
    """The pooling jobs of the step ``out`` (kept by the engine) and the row ranges the runner reduces for
    them (None when the step has none)."""
    offsets = itertools.accumulate((s.num_tokens for s in out.seqs), initial=0)
    jobs: list[PoolJob] = []
    rows = PoolRows([], [], [])
    for sched, off in zip(out.seqs, offsets):
        state: PoolingState | None = getattr(sched.seq.request, "pooling", None)
        if state is None:
            continue
        num_prompt = len(sched.seq.request.prompt_token_ids)
        start = sched.start
        end = min(start + sched.num_tokens, num_prompt)
        if start >= num_prompt:
            continue
        done = end == num_prompt
        if state.method == "cls":
            if start != 0:
                continue
            op, lo, hi = "first", off, off + 1
        elif state.method == "mean":
            op, lo, hi = "sum", off, off + end - start
        else:  # last
            if not done:
                continue
            op, lo, hi = "last", off + end - start - 1, off + end - start
        jobs.append(PoolJob(state, len(rows.ops), end - start, start == 0, done))
        rows.starts.append(lo)
        rows.ends.append(hi)
        rows.ops.append(op)
    return (jobs, rows) if jobs else ([], None)


def completed(out) -> list:
    """The pooling sequences whose prompt the step ``out`` completes (the update finishes them)."""
    return [s.seq for s in out.seqs if s.seq.request.pooling is not None and s.completes]


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
