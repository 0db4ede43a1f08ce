"""Request groups: the scheduling atom, and the one hook through which a feature enters the engine.

A group is the live sequences of one request, admitted, scheduled, preempted, swapped and resumed as one. The
scheduler schedules groups without knowing their kind; a kind says

* what it needs of the KV pool (:meth:`RequestGroup.unservable`, :meth:`~RequestGroup.allocate`, the tokens it
  may reuse from the prefix cache :meth:`~RequestGroup.lookup_tokens`) and of each step's budget
  (:meth:`~RequestGroup.plan`);
* what it needs from a step's output (:meth:`~RequestGroup.plan_outputs`: sampled rows, scored rows, reads of
  the hidden states — declared on the :class:`SchedulerOutput` when the step is scheduled);
* how it absorbs its slice of the step's output (:meth:`~RequestGroup.absorb`), returning the sequences that
  leave it.

The base kinds live here: :class:`RequestGroup` (one sampled sequence, ``n = 1``) and :class:`SampleGroup`
(the first sample of an ``n > 1`` request: it holds seats for all ``n`` until the step that completes its
prompt, which forks the other ``n - 1`` (:meth:`SampleGroup.fan_out`; they share every block, the partial
last one included), each into a one-sequence group of its own: samples are independent, so each is preempted
and resumed alone). Other kinds subclass :class:`RequestGroup` in their feature's module;
:func:`batchgen.engine.sched.kinds.make_group` picks one per request.

Besides its kind, a request may carry :class:`AddOn` s (``Request.addons``): what it asks of every step on
top of its kind's own work (rows read from a chunk's hidden states, a limit on prefix reuse, where a chunk
may end, a need for synchronous steps, a field of its output). Every kind runs them through the same calls.

Invariant: every sequence of ``seqs`` has the group's status (waiting, running or swapped); a group holds KV
blocks for all of them while running or swapped, for none while waiting.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from batchgen.engine.kv.kv_cache import LEAD_PENDING, KVCacheManager
from batchgen.engine.sched.output import GroupStep, ScheduledSeq, SchedulerOutput
from batchgen.engine.sched.sequence import Request, Sequence, SequenceStatus
from batchgen.engine.sched.stop import StopRules

if TYPE_CHECKING:
    from batchgen.engine.core.outputs import RequestOutput
    from batchgen.engine.worker.step_input import RunnerOutput


class Admission(enum.Enum):
    """:meth:`RequestGroup.allocate`'s answer. ``NO_ROOM``: the pool cannot hold the group now (nothing behind it
    is admitted either, so it keeps its turn); ``LEAD_PENDING``: part of its prefix is being computed by the step
    being scheduled, worth a step's wait (groups behind it that do not share that prefix may go first)."""

    ADMITTED = "admitted"
    NO_ROOM = "no room"
    LEAD_PENDING = "lead pending"


Plan = list[tuple[Sequence, int]]
"""(sequence, tokens it computes this step); sequences computing nothing are left out."""

Entry = tuple[int, ScheduledSeq, int]
"""One of a group's scheduled sequences in a step: (row in the step's ``seqs``, its work, the offset of its first
token in the packed batch)."""


class UpdateContext(Protocol):
    """What a group's :meth:`RequestGroup.absorb` uses of the scheduler."""

    stop: StopRules
    kv: KVCacheManager

    def place(self, seq: Sequence, token: int, index: int) -> bool:
        """Put ``seq``'s sampled token in place (``index``: its row of the step's samples); False when the
        token is dropped (the sequence finished meanwhile)."""
        ...


@dataclass
class Absorbed:
    """What absorbing a step did: the sequences that left the group (to be freed), the tokens generated,
    whether the request finished."""

    left: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0
    finished: bool = False


class AddOn:
    """What a request asks of its steps besides its kind's own work (``Request.addons``); a feature subclasses
    it and overrides what it needs. Every kind calls these hooks for every add-on of its request."""

    def lookup_tokens(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """The part of ``tokens`` (a prefix of ``seq``'s) whose cached prefix ``seq`` may reuse at admission."""
        return tokens

    def overlappable(self) -> bool:
        """Whether the request's next step may be scheduled before its current step's output is applied."""
        return True

    def chunk(self, seq: Sequence, num_new: int) -> int:
        """How many of the ``num_new`` tokens planned for ``seq`` (from ``seq.num_computed_tokens`` on) its
        chunk may take this step: at most ``num_new``; 0 puts it off to a step with more budget."""
        return num_new

    def plan_chunk(self, sched: ScheduledSeq, offset: int, out: SchedulerOutput, step: GroupStep) -> None:
        """One scheduled chunk of the request (its first token at packed row ``offset``): declare on ``out``
        what it needs from the step and claim it on ``step`` (filled in by :meth:`GroupStep.fill_reads`)."""

    def plan_sample(self, seq: Sequence, index: int, out: SchedulerOutput) -> None:
        """``seq`` samples the step's sample ``index``: declare on ``out`` what the add-on needs of the draw."""

    def sampled(self, seq: Sequence, index: int, output: RunnerOutput) -> None:
        """``seq``'s sample ``index`` came back in ``output`` and was put in place (before the stop rules)."""

    def finish(self, request: Request, output: RequestOutput) -> None:
        """Complete the finished request's output with the add-on's part."""


class RankedResults(Protocol):
    """Set as ``Request.ranked`` by a kind whose outputs are ranked results rather than its sequences."""

    def results(self) -> list[Any]:
        """The finished results, best first: each with ``token_ids``, ``finish_reason``, ``stop_reason`` and
        ``cumulative_logprob``."""
        ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unservable(kv: KVCacheManager, need: int, what: str) -> str | None:
    """Why a request needing ``need`` blocks (``what`` says for what) can never run in this pool."""
    if need <= kv.num_blocks:
        return None
    return (
        f"{what} needs {need} KV blocks but the pool holds "
        f"{kv.num_blocks}; raise engine.kv_cache_memory / num_blocks or lower max_tokens"
    )


class RequestGroup:
    """One sampled sequence (the base behaviour every kind shares)."""

    def __init__(self, request: Request, seq: Sequence) -> None:
        self.request = request
        self.seqs: list[Sequence] = [seq]
        self.admitted_at = -1  # admission counter: the most recently admitted group is preempted first
        seq.group = self

    # ------------------------------------------------------------------------------------------- memory
    def unservable(self, kv: KVCacheManager, max_num_seqs: int, stop: StopRules) -> str | None:
        """Why this request can never run in this pool (None if it can): its longest sequence's blocks."""
        n = len(self.request.prompt_token_ids)
        need = _cdiv(stop.length_limit(self.request.params, n), kv.block_size)
        return unservable(kv, need, f"prompt ({n} tokens) plus max_tokens")

    def seats(self) -> int:
        """Sequence slots the group takes once admitted, the forks its prompt will spawn included."""
        return len(self.seqs)

    def lookup_tokens(self, seq: Sequence) -> list[int]:
        """The tokens whose cached prefix ``seq`` may reuse at admission (as its add-ons allow)."""
        tokens = seq.token_ids
        for addon in self.request.addons:
            tokens = addon.lookup_tokens(seq, tokens)
        return tokens

    def allocate(self, kv: KVCacheManager, reserve: int, wait_for_lead: bool = False) -> Admission:
        """Admission: blocks for the sequence (prefix-cache hits counted as computed), keeping ``reserve``
        blocks free. Changing nothing: ``NO_ROOM`` when they do not fit, ``LEAD_PENDING`` (with
        ``wait_for_lead``) when part of its prefix is being computed by the step being scheduled (see
        ``KVCacheManager.allocate``)."""
        s = self.seqs[0]
        root = self.request.cache_root
        num_cached = kv.allocate(
            s.seq_id,
            self.lookup_tokens(s),
            s.num_tokens,
            reserve_blocks=reserve,
            root=root,
            wait_for_lead=wait_for_lead,
        )
        if num_cached is None:
            return Admission.NO_ROOM
        if num_cached == LEAD_PENDING:
            return Admission.LEAD_PENDING
        s.num_computed_tokens = num_cached
        return Admission.ADMITTED

    # ------------------------------------------------------------------------------------------ a step
    def overlappable(self) -> bool:
        """Whether the group's next step may be scheduled before its current step's output is applied: not
        when one of its add-ons needs that output first."""
        return all(addon.overlappable() for addon in self.request.addons)

    def decoding(self) -> bool:
        """Every sequence that runs this step computes exactly its last token."""
        return all(len(s.token_ids) - s.num_computed_tokens == 1 for s in self.seqs)

    def plan(self, budget: int) -> Plan:
        """How many tokens each sequence computes this step, in order, under ``budget`` (here: the one
        sequence's next chunk)."""
        s = self.seqs[0]
        todo = s.num_tokens - s.num_computed_tokens
        if todo <= 0 or budget <= 0:
            return []
        n = self.chunk(s, min(todo, budget))
        return [(s, n)] if n > 0 else []

    def chunk(self, seq: Sequence, num_new: int) -> int:
        """``num_new`` tokens of ``seq`` as far as the request's add-ons let one chunk take them."""
        for addon in self.request.addons:
            num_new = addon.chunk(seq, num_new)
        return num_new

    def plan_outputs(
        self, entries: list[Entry], out: SchedulerOutput, kv: KVCacheManager
    ) -> list[RequestGroup]:
        """Declare on ``out`` what the group needs from the step and claim it (``out.parts``): here a token
        sampled for each sequence the step completes, and what its add-ons need of its chunks. Returns the
        groups forked now (running, claimed too)."""
        step = self._addon_step(entries, out)
        completed = [(row, s.seq) for row, s, _ in entries if s.completes]
        step.samples = [(seq, self.sample(out, row, seq)) for row, seq in completed]
        if step:
            out.parts.append((self, step))
        return [g for row, seq in completed for g in self.fan_out(seq, row, out, kv)]

    def sample(self, out: SchedulerOutput, row: int, seq: Sequence) -> int:
        """``seq`` samples from row ``row``'s logits (the request's add-ons told); its index in the samples."""
        index = out.sample(row, seq)
        for addon in self.request.addons:
            addon.plan_sample(seq, index, out)
        return index

    def _addon_step(self, entries: list[Entry], out: SchedulerOutput) -> GroupStep:
        """A claim holding what the request's add-ons need of these entries (every kind carries them)."""
        step = GroupStep()
        for addon in self.request.addons:
            for _, s, offset in entries:
                addon.plan_chunk(s, offset, out, step)
        return step

    def fan_out(
        self, seq: Sequence, row: int, out: SchedulerOutput, kv: KVCacheManager
    ) -> list[RequestGroup]:
        """The groups of the sequences forked from ``seq`` in the step that completes it (running; they
        sample from its row)."""
        return []

    def absorb(self, step: GroupStep, output: RunnerOutput, ctx: UpdateContext) -> Absorbed:
        """Take the group's slice of the step's output: the add-ons' reads filled in; each sampled token put in
        place, its logprobs recorded and the stop rules applied (a stopped sequence leaves the group)."""
        step.fill_reads(output)
        done = Absorbed()
        for seq, i in step.samples:
            token = output.token_ids[i]
            if not ctx.place(seq, token, i):
                continue
            for addon in self.request.addons:
                addon.sampled(seq, i, output)
            done.num_tokens += 1
            lp = output.logprobs[i]
            if seq.logprobs is not None and lp is not None:
                seq.logprobs.append(lp)
            reason = ctx.stop.check(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                self.leave(seq, done)
        return done

    def leave(self, seq: Sequence, done: Absorbed) -> None:
        """``seq`` finished: it leaves the group, and counts as one of the request's finished samples."""
        self.seqs.remove(seq)
        done.left.append(seq)
        self.request.num_finished += 1
        done.finished = done.finished or self.request.is_finished

    # ------------------------------------------------------------------------------------------- queues
    def set_status(self, status: SequenceStatus) -> None:
        for s in self.seqs:
            s.status = status

    def reset(self) -> None:
        """Back to waiting after its blocks were freed (recompute): nothing computed, tokens kept."""
        for s in self.seqs:
            s.status = SequenceStatus.WAITING
            s.num_computed_tokens = 0


class SampleGroup(RequestGroup):
    """The first sample of an ``n > 1`` request (see the module docstring)."""

    def seats(self) -> int:
        return self.request.params.n if len(self.request.seqs) == 1 else len(self.seqs)

    def fan_out(
        self, seq: Sequence, row: int, out: SchedulerOutput, kv: KVCacheManager
    ) -> list[RequestGroup]:
        if len(seq.token_ids) != seq.num_prompt_tokens or len(self.request.seqs) != 1:
            return []
        groups: list[RequestGroup] = []
        for k in range(1, self.request.params.n):
            child = seq.fork(k)
            kv.fork(seq.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            group = RequestGroup(self.request, child)
            out.parts.append((group, GroupStep(samples=[(child, group.sample(out, row, child))])))
            groups.append(group)
        return groups
