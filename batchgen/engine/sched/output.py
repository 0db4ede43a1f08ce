"""What the scheduler decides for one step (:class:`SchedulerOutput`) and what each request group claims of
the step's output (:class:`GroupStep`).

The scheduler fills the work (``seqs``, block moves); then every scheduled group declares what it needs from the
step through the collector methods (:meth:`SchedulerOutput.sample`, :meth:`~SchedulerOutput.score`,
:meth:`~SchedulerOutput.read`: a feature's rows of the hidden states) and keeps its claim in ``parts``.
The step builder reads the plain rows and plans from here; :meth:`Scheduler.update` hands each group its
claim back with the runner's output. Each plan is computed once, when the step is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from batchgen.engine.worker.step_input import HiddenRead, RunnerOutput

if TYPE_CHECKING:
    from batchgen.engine.sched.request_group import RequestGroup
    from batchgen.engine.sched.sequence import Sequence
    from batchgen.engine.worker.sampler import WatchedTokens

R = TypeVar("R", bound=HiddenRead)


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step: positions ``start .. start + num_tokens - 1`` are computed, reading and
    writing the KV cache through ``block_table`` (which covers at least ``start + num_tokens`` tokens)."""

    seq: Sequence
    start: int
    num_tokens: int
    block_table: list[int]
    """A copy of the sequence's table, never the KV manager's own."""
    table_unchanged: bool = False
    """The table is, entry for entry, the one the sequence had the last time it was scheduled (the decode
    fast path: it neither grew nor was copied on write, swapped or re-admitted since)."""

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens]

    @property
    def completes(self) -> bool:
        """Whether this step computes the sequence's last token (so a new token is sampled from it)."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class GroupStep:
    """A group's claim on one step's output: its sampled sequences with their index in the step's samples,
    its rows of the step's scored rows (``lo, hi``), its jobs on each of the step's hidden-state reads (the
    feature modules' jobs, by read type), and the sequences whose prompt the step completes."""

    samples: list[tuple[Sequence, int]] = field(default_factory=list)
    scores: tuple[int, int] | None = None
    reads: dict[type, list[Any]] = field(default_factory=dict)
    completed: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.samples or self.scores or self.reads or self.completed)

    def claim(self, kind: type[HiddenRead], job: Any) -> None:
        """``job`` takes its share of the step's read of type ``kind`` when the output comes back."""
        self.reads.setdefault(kind, []).append(job)

    def fill_reads(self, output: RunnerOutput) -> None:
        """Hand each read's jobs the runner's result (:meth:`HiddenRead.fill`)."""
        for kind, jobs in self.reads.items():
            result = output.reads.get(kind)
            if result is None:
                raise ValueError(f"the step returned no {kind.__name__} result for {len(jobs)} jobs")
            kind.fill(jobs, result)


@dataclass
class SchedulerOutput:
    """What runs in one step.

    ``seqs``: decodes (one token each) first, then prefill chunks — the attention kernels rely on that order.
    ``copies``: block copies ``(src, dst)`` to perform before the forward: copies on write, then the copies
    that start a newly admitted sequence's block with a cached prefix ending inside it
    (``KVCacheManager.end_schedule``).
    ``swap_out``: ``(gpu_block, cpu_block)`` copies of preempted groups; ``swap_in``: ``(cpu_block, gpu_block)``
    copies of resumed ones. The runner performs swap-outs, then swap-ins, then ``copies``, then the forward
    (a block freed by a swap-out or a preemption may be handed out again in the same step; a copy may read a
    block just swapped in).
    ``sample_seqs[i]`` gets a token sampled from the last-token logits of ``seqs[sample_rows[i]]`` (the forks
    of an ``n > 1`` request sample from their parent's row). ``score_rows``: rows of ``seqs`` whose
    last-token float32 log-softmax the runner returns instead. ``reads``: the features' reads of the packed
    hidden states (:class:`HiddenRead`, one per type), computed by the runner after the forward. ``parts``: each group with something to
    absorb from the step, and its claim.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)
    reads: dict[type, HiddenRead] = field(default_factory=dict)
    parts: list[tuple[RequestGroup, GroupStep]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    watch: dict[int, WatchedTokens] = field(default_factory=dict)
    """Sample index -> tokens whose probability of being the one drawn the runner returns
    (``RunnerOutput.watched``)."""
    plain_greedy: bool = True
    """Every sampled sequence is greedy with no penalty, banned token, seed-dependent draw or logprobs
    (:attr:`Request.plain_greedy`): the step's sampling is one argmax and needs no per-row settings."""
    plain_sampling: bool = True
    """Every sampled sequence is :attr:`Request.plain_sampling`: the sampler needs the rows' filter settings
    only (no per-row penalties, banned tokens, logprobs or seeds)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def logit_rows(self) -> list[int]:
        """Rows of ``seqs`` whose last-token logits the runner returns: ``sample_rows`` then ``score_rows``."""
        return self.sample_rows + self.score_rows

    def __bool__(self) -> bool:
        return bool(self.seqs)

    # ------------------------------------------------------------------ what the groups need from the step
    def sample(self, row: int, seq: Sequence) -> int:
        """``seq`` samples a token from row ``row``'s logits; returns its index in the step's samples."""
        self.sample_rows.append(row)
        self.sample_seqs.append(seq)
        request = seq.request
        self.plain_greedy = self.plain_greedy and request.plain_greedy
        self.plain_sampling = self.plain_sampling and request.plain_sampling
        return len(self.sample_seqs) - 1

    def watch_tokens(self, index: int, tokens: WatchedTokens) -> None:
        """The probability that sample ``index`` draws one of ``tokens`` is returned with its token."""
        self.watch[index] = tokens

    def score(self, rows: list[int]) -> tuple[int, int]:
        """These rows' log-softmax is returned; returns their range in the step's scored rows."""
        lo = len(self.score_rows)
        self.score_rows.extend(rows)
        return lo, len(self.score_rows)

    def read(self, kind: type[R]) -> R:
        """The step's read of type ``kind`` (a feature's rows of the hidden states), created empty on first use
        for the groups to append their rows to."""
        r = self.reads.get(kind)
        if r is None:
            r = self.reads[kind] = kind()
        return r  # type: ignore[return-value]
