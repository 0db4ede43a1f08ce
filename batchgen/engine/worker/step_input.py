"""The plain-data messages of one step: what the executor runs (:class:`StepInput`) and what it returns
(:class:`RunnerOutput`).

A step input is built once per step from the scheduler's output (:mod:`batchgen.engine.worker.step_builder`) and
holds no live engine objects (no sequences, requests or KV manager): block moves as lists of block ids, the
flat forward tensors, the rows of the logits to sample, to score (their log-softmax returned), and the
features' reads of the hidden states (:class:`HiddenRead`).
So the same input can run in this process, in the pipelined executor's thread, or be broadcast to every
tensor-parallel rank (the :class:`ForwardInput` and :class:`BlockMoves` parts: sampling runs on rank 0 only).

Invariants: ``forward.last`` indexes the packed tokens, one entry per logit row: the ``sampling.num_rows``
sampled rows, then ``sampling.num_score_rows`` scored rows; the runner performs ``moves`` in the order
swap-outs, swap-ins, copies on write, then applies ``loads`` (adapters into their slots), before the forward.
Slot loads travel with the steps, in step order: a slot is only written between two steps' forwards, so a step
in flight (pipelined) never sees its slots change, and every tensor-parallel rank loads the same slots
at the same point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from batchgen.attention import AttentionMetadata
from batchgen.engine.worker.sampler import SamplingRow, SamplingTensors, WatchedTokens


@dataclass
class BlockMoves:
    """KV block copies before the forward: ``swap_out`` ``(gpu, cpu)``, ``copies`` ``(src, dst)`` (copy on
    write, in list order), ``swap_in`` ``(cpu, gpu)``."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.copies or self.swap_in)


class HiddenRead(Protocol):
    """A feature's rows of one step's packed hidden states, read after the forward (plain data, declared by
    the request groups when the step is scheduled: :meth:`SchedulerOutput.read`). Rank 0 runs
    :meth:`compute` (its result goes back in ``RunnerOutput.reads``), every other tensor-parallel rank
    :meth:`follow` (the same collectives); the groups' claims are handed the result by :meth:`fill`."""

    def compute(self, model: Any, hidden: Tensor) -> Any: ...

    def follow(self, model: Any, hidden: Tensor) -> None: ...

    @staticmethod
    def fill(jobs: list, result: Any) -> None: ...


class RowMask(Protocol):
    """A mask over the sampled rows' logits, applied in place before sampling (a feature's constraint on
    which tokens a row may sample)."""

    def apply(self, logits: Tensor) -> None: ...


class SlotLoad(Protocol):
    """A write into the model's adapter slots before a step's forward, in step order, on every rank (the
    adapter feature's). ``slots``: the runner's :attr:`ModelRunner.adapters`."""

    def apply(self, slots: Any) -> None: ...

    def for_workers(self) -> SlotLoad:
        """The load as tensor-parallel workers receive it (without rank 0's parsed copy)."""
        ...


@dataclass
class ForwardInput:
    """One packed forward (decodes first, then prefill chunks) and the rows of its hidden states whose
    logits are needed (``last``), and the features' reads of its hidden states (``reads``, in order)."""

    ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    last: Tensor
    num_seqs: int
    reads: dict[type, HiddenRead] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    """The model's per-token inputs features add (keywords of its ``ForwardContext``: each token's adapter
    slot); each value has ``.to(device)``."""

    def to(self, device: torch.device) -> ForwardInput:
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
        ids, pos, last = self.ids.to(device), self.positions.to(device), self.last.to(device)
        context = {k: v.to(device) for k, v in self.context.items()}
        return ForwardInput(ids, pos, meta, last, self.num_seqs, self.reads, context)


@dataclass
class SamplingInput:
    """How the first ``num_rows`` logit rows are sampled (``rows`` None: plain rows, ``settings`` None: all
    greedy), the row mask applied first, and how many scored rows follow them (their log-softmax is
    returned, not sampled). ``release``: row keys whose generators the sampler drops first (seeded sequences
    that are done). ``watch``: sampled rows whose probability of drawing one of the given tokens is returned
    (:class:`~batchgen.engine.worker.sampler.Sampler`'s watched tokens)."""

    num_rows: int = 0
    rows: list[SamplingRow] | None = None
    settings: SamplingTensors | None = None
    mask: RowMask | None = None
    num_score_rows: int = 0
    release: list[int] = field(default_factory=list)
    watch: dict[int, WatchedTokens] = field(default_factory=dict)


@dataclass
class StepInput:
    """One step. ``fill``: ``(index, tokens)`` device tensors: the input ids at ``index`` are placeholders
    for the previous step's sampled ``tokens`` (a step planned while that one ran), written in before the forward.
    ``loads``: adapters written into their slots first (in list order)."""

    moves: BlockMoves
    forward: ForwardInput | None = None
    sampling: SamplingInput = field(default_factory=SamplingInput)
    fill: tuple[Tensor, Tensor] | None = None
    loads: list[SlotLoad] = field(default_factory=list)


@dataclass
class RunnerOutput:
    """What one step produced: ``token_ids[i]`` / ``logprobs[i]`` of sampled row i (``sampled``: the same
    tokens as a device tensor, for the next step's placeholders), ``scores``: the float32 log-softmax of the
    scored rows (``[num_score_rows, V]`` on the CPU), each :class:`HiddenRead`'s result by its type,
    ``watched``: sampled row -> the probability its draw was one of its watched tokens."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    sampled: Tensor | None = None
    scores: Tensor | None = None
    reads: dict[type, Any] = field(default_factory=dict)
    watched: dict[int, float] = field(default_factory=dict)
