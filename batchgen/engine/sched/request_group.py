"""Request groups: the scheduling atom, and the one hook through which a feature enters the engine.

A group is the live sequences of one request, admitted, scheduled, preempted, swapped and resumed as one. The
scheduler schedules groups without knowing their kind; a kind says

* what it needs of the KV pool (:meth:`RequestGroup.unservable`, :meth:`~RequestGroup.allocate`, the tokens it
  may reuse from the prefix cache :meth:`~RequestGroup.lookup_tokens`) and of each step's budget
  (:meth:`~RequestGroup.plan`);
* what it needs from a step's output (:meth:`~RequestGroup.plan_outputs`: sampled rows, scored rows, pooled
  segments, prompt-logprob rows — declared on the :class:`SchedulerOutput` when the step is scheduled);
* how it absorbs its slice of the step's output (:meth:`~RequestGroup.absorb`: tokens placed and the stop
  rules applied, a beam step taken, pooled vectors folded in), returning the sequences that leave it.

Kinds: :class:`RequestGroup` (one sampled sequence, ``n = 1``), :class:`SampleGroup` (the first sample of an
``n > 1`` request: it holds seats for all ``n`` until the step that completes its prompt, which forks the other
``n - 1`` (:meth:`SampleGroup.fan_out`; they share every block, the partial last one included), each into a
one-sequence group of its own: samples are independent, so each is preempted and resumed alone),
:class:`~batchgen.engine.features.beam.BeamGroup` and :class:`~batchgen.engine.features.pooling.PoolingGroup`
(:mod:`batchgen.engine.sched.kinds` picks one per request). Prompt logprobs are an add-on every kind carries
(:mod:`batchgen.engine.features.prompt_logprobs`).

Invariant: every sequence of ``seqs`` has the group's status (waiting, running or swapped); a group holds KV
blocks for all of them while running or swapped, for none while waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from batchgen.engine.features import prompt_logprobs
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.output import GroupStep, ScheduledSeq, SchedulerOutput
from batchgen.engine.sched.sequence import Request, Sequence, SequenceStatus
from batchgen.engine.sched.stop import StopRules

if TYPE_CHECKING:
    from batchgen.engine.worker.step_input import RunnerOutput

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
        """The tokens whose cached prefix ``seq`` may reuse at admission."""
        return prompt_logprobs.cache_lookup_tokens(seq)

    def allocate(self, kv: KVCacheManager, reserve: int, wait_for_lead: bool = False) -> bool:
        """Admission: blocks for the sequence (prefix-cache hits counted as computed), keeping ``reserve``
        blocks free; False, changing nothing, when they do not fit (or, with ``wait_for_lead``, when part of
        its prefix is being computed by the step being scheduled: see ``KVCacheManager.allocate``)."""
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
            return False
        s.num_computed_tokens = num_cached
        return True

    # ------------------------------------------------------------------------------------------ a step
    def overlappable(self) -> bool:
        """Whether the group's next step may be scheduled before its current step's output is applied: not
        when a grammar mask or prompt logprobs need that output first."""
        return not self.request.params.constrained and not prompt_logprobs.wants_prompt_logprobs(self.request)

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
        return [(s, min(todo, budget))]

    def plan_outputs(
        self, entries: list[Entry], out: SchedulerOutput, kv: KVCacheManager
    ) -> list[RequestGroup]:
        """Declare on ``out`` what the group needs from the step and claim it (``out.parts``): here a token
        sampled for each sequence the step completes, and the prompt logprobs of its chunks. Returns the
        groups forked now (running, claimed too)."""
        step = self._prompt_step(entries, out)
        completed = [(row, s.seq) for row, s, _ in entries if s.completes]
        step.samples = [(seq, out.sample(row, seq)) for row, seq in completed]
        if step:
            out.parts.append((self, step))
        return [g for row, seq in completed for g in self.fan_out(seq, row, out, kv)]

    def _prompt_step(self, entries: list[Entry], out: SchedulerOutput) -> GroupStep:
        """A claim holding the prompt-logprob chunks of these entries (the add-on every kind carries)."""
        step = GroupStep()
        if prompt_logprobs.wants_prompt_logprobs(self.request):
            for _, s, offset in entries:
                job = prompt_logprobs.plan_chunk(s, offset, out)
                if job is not None:
                    step.claim(prompt_logprobs.PromptRows, job)
        return step

    def fan_out(
        self, seq: Sequence, row: int, out: SchedulerOutput, kv: KVCacheManager
    ) -> list[RequestGroup]:
        """The groups of the sequences forked from ``seq`` in the step that completes it (running; they
        sample from its row)."""
        return []

    def absorb(self, step: GroupStep, output: RunnerOutput, ctx: UpdateContext) -> Absorbed:
        """Take the group's slice of the step's output: prompt logprobs filled in; each sampled token put in
        place, its logprobs recorded and the stop rules applied (a stopped sequence leaves the group)."""
        step.fill_reads(output)
        done = Absorbed()
        for seq, i in step.samples:
            token = output.token_ids[i]
            if not ctx.place(seq, token, i):
                continue
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
            out.parts.append((group, GroupStep(samples=[(child, out.sample(row, child))])))
            groups.append(group)
        return groups
