"""Continuous batching of request groups under a token budget and a sequence cap, with chunked prefill and
preemption.

The scheduling atom is a :class:`~batchgen.engine.sched.request_group.RequestGroup`: groups are admitted,
scheduled, preempted, swapped and resumed whole, and the scheduler never asks their kind: each plans its own
tokens under the budget, declares what it needs from the step's output and absorbs its slice of it. ``schedule()`` decides one step: running groups first —
decoding groups before unfinished prefills — then swapped-out groups are swapped back in, then (only when
nothing is swapped out) waiting groups are admitted in arrival order while the token budget, the sequence cap
and the block pool (above a watermark) allow.

**Preemption.** When a running group cannot get its blocks for the step, the most recently admitted running
group not yet scheduled in this step (possibly itself) is preempted until it can. With
``preemption_mode="recompute"`` its blocks are freed and it goes back to the front of the waiting queue to be
recomputed (generated tokens are kept, so it resumes where it was). With ``"swap"`` its blocks are copied to
the CPU block pool (``SchedulerOutput.swap_out``) and it waits in the swapped queue; it comes back, copies
``swap_in`` performed before its next forward, as soon as its blocks (and one more per sequence) fit. A group
whose blocks do not fit in the CPU pool, or the only running group, falls back to recompute. No group is
swapped back in a step that preempted, and no new group is admitted while one is swapped out.

A step reads ``schedule() -> SchedulerOutput``, then (once the runner has executed it)
``update(scheduler_output, runner_output) -> finished requests``: each group absorbs its claim on the output
(:meth:`RequestGroup.absorb`: for a sampling group, its tokens placed and the stop rules applied), and the
sequences that left their group are freed.

The scheduler is the only user of the :class:`KVCacheManager`, and keeps the scheduling figures of
:class:`SchedulerCounters` (preemptions, swaps, prefix hits, tokens computed, copy-on-write copies, queue sizes).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.stats import SchedulerCounters
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.output import ScheduledSeq, SchedulerOutput
from batchgen.engine.sched.request_group import Admission, Entry, RequestGroup
from batchgen.engine.sched.sequence import Request, Sequence, SequenceStatus
from batchgen.engine.sched.stop import StopRules

if TYPE_CHECKING:
    from batchgen.engine.worker.step_input import RunnerOutput


class AdmissionGate(Protocol):
    """Something besides KV blocks a request holds from its first admission to its end (e.g. the slot of
    the weights it runs under). A group is admitted only when every gate is
    :meth:`ready` for its request, and :meth:`take` is called as it is; both see a request that already holds
    the gate (resumed after a preemption) as served. The engine calls :meth:`give_back` when the request ends."""

    def ready(self, request: Request) -> bool: ...

    def take(self, request: Request) -> None: ...

    def give_back(self, request: Request) -> None: ...


def _count_reuse(stats: SchedulerCounters, request: Request, reused: int, block_size: int) -> None:
    """A request's first admission reused ``reused`` prompt tokens: ``num_cached_tokens`` counts the whole
    blocks shared from the prefix cache (as vLLM counts them), ``prompt_tokens_copied`` the rest, copied from a
    cached block."""
    request.admitted = True
    request.num_cached_tokens = reused // block_size * block_size
    stats.prompt_tokens_cached += request.num_cached_tokens
    stats.prompt_tokens_copied += reused - request.num_cached_tokens


class Scheduler:
    """Owns the waiting queue, the running list and the swapped queue of request groups, and the KV cache
    manager. ``running`` is in admission order; ``swapped`` holds the next group to resume first."""

    output_class: type[SchedulerOutput] = SchedulerOutput
    """What :meth:`schedule` returns (a subclass may carry more per step)."""

    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, stop: StopRules, gates: Iterable[AdmissionGate] = ()
    ) -> None:
        self.config = config
        self.gates = list(gates)
        """What a request holds besides KV blocks (see :class:`AdmissionGate`)."""
        self.kv = kv
        self.stop = stop
        self.stats = SchedulerCounters()  # written by the scheduler alone
        self.waiting: deque[RequestGroup] = deque()
        self.running: list[RequestGroup] = []
        self.swapped: deque[RequestGroup] = deque()
        self._admissions = itertools.count()
        self._swap = config.preemption_mode == "swap" and kv.num_cpu_blocks > 0
        self._out: SchedulerOutput | None = None  # the step being planned (preemptions add swap-outs)
        self._preempted = False
        self.watermark_blocks = max(1, kv.num_blocks // 100)  # free blocks admission leaves for growth

    # ----------------------------------------------------------------------------------------- queues
    def add(self, group: RequestGroup) -> None:
        """Queue a new request's group (of the request's kind: :func:`batchgen.engine.sched.kinds.make_group`)."""
        group.set_status(SequenceStatus.WAITING)
        self.waiting.append(group)

    def abort_request(self, request: Request) -> None:
        """Abort every live sequence of the request (each group, wherever it is)."""
        groups = {id(s.group): s.group for s in request.seqs if s.group is not None and not s.is_finished}
        for group in groups.values():
            status = group.seqs[0].status
            if status is SequenceStatus.RUNNING:
                for s in group.seqs:
                    self._free_blocks(s.seq_id)
                self.running.remove(group)
            elif status is SequenceStatus.WAITING:
                self.waiting.remove(group)
            elif status is SequenceStatus.SWAPPED:
                for s in group.seqs:
                    self.kv.free(s.seq_id)
                self.swapped.remove(group)
            group.set_status(SequenceStatus.FINISHED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def running_seqs(self) -> list[Sequence]:
        """The running sequences, group by group in admission order (a new list)."""
        return [s for g in self.running for s in g.seqs]

    # --------------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plan the next step: its work, its block moves and what each scheduled group needs from it."""
        out = self.output_class()
        self._out = out
        self._preempted = False
        scheduled: set[int] = set()  # ids of the groups scheduled in this step (never preemption victims)
        budget = self._schedule_running(out, scheduled, self.config.max_num_batched_tokens)
        budget = self._swap_in(out, scheduled, budget)
        if not self.swapped:
            self._admit(out, scheduled, budget)
        num_decodes = 0
        seen_prefill = unordered = False
        for s in out.seqs:
            if s.num_tokens == 1:
                num_decodes += 1
                unordered = unordered or seen_prefill
            else:
                seen_prefill = True
        if unordered:  # a decode came after a prefill: stable sort, decodes first
            out.seqs.sort(key=lambda s: s.num_tokens != 1)
        out.num_decodes = num_decodes
        self._plan_outputs(out)
        self.stats.num_cow_copies += len(out.copies)
        out.copies += self.kv.end_schedule()  # partial-block prefix copies
        self.stats.num_swapped_out_blocks += len(out.swap_out)
        self.stats.num_swapped_in_blocks += len(out.swap_in)
        self._out = None
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> int:
        """Running groups in admission order, decoding groups first, then unfinished prefills.

        Decode fast path: a lone sequence decoding its last token into an exclusive last block with room needs
        only a counter bump in the KV manager (:meth:`KVCacheManager.append_one`, which returns a copy of its
        table); every other group takes the general path (:meth:`_schedule_group`), in the same
        order, so preemption picks the same victims."""
        decodes: list[RequestGroup] = []
        prefills: list[RequestGroup] = []
        for g in self.running:
            seqs = g.seqs
            if self._sits_out(g):
                continue
            if len(seqs) == 1:
                s = seqs[0]
                (decodes if len(s.token_ids) - s.num_computed_tokens == 1 else prefills).append(g)
            else:
                (decodes if g.decoding() else prefills).append(g)
        append_one = self.kv.append_one
        seqs_out = out.seqs
        running = SequenceStatus.RUNNING
        prompt_computed = 0
        for g in decodes:
            if budget <= 0:
                break
            first = g.seqs[0]
            if first.status is not running:  # preempted earlier in this loop
                continue
            if len(g.seqs) == 1:
                table = append_one(first.seq_id, first.token_ids, self._token_pending(first))
                if table is not None:
                    start = len(first.token_ids) - 1
                    seqs_out.append(ScheduledSeq(first, start, 1, table, True))
                    scheduled.add(id(g))
                    if start < first.num_prompt_tokens:
                        prompt_computed += 1
                    budget -= 1
                    continue
            budget = self._schedule_group(out, scheduled, g, budget)
        self.stats.prompt_tokens_computed += prompt_computed
        for g in prefills:
            if budget <= 0:
                break
            if g.seqs[0].status is not running:
                continue
            budget = self._schedule_group(out, scheduled, g, budget)
        return budget

    def _schedule_group(
        self, out: SchedulerOutput, scheduled: set[int], group: RequestGroup, budget: int
    ) -> int:
        """Schedule what the group can compute this step; returns the budget left."""
        plan = group.plan(budget)
        if not plan:
            return budget
        # A prefill in progress already holds blocks for its whole prompt.
        targets = [(s.seq_id, max(s.num_computed_tokens + n, self.kv.num_tokens(s.seq_id))) for s, n in plan]
        copies = self._grow(group, targets, scheduled)
        if copies is None:  # preempted itself
            return budget
        out.copies.extend(copies)
        for seq, num_new in plan:
            self._add(out, seq, num_new)
            budget -= num_new
        scheduled.add(id(group))
        return budget

    def _grow(
        self, group: RequestGroup, targets: list[tuple[int, int]], scheduled: set[int]
    ) -> list[tuple[int, int]] | None:
        """Give the group's sequences their slots, preempting other groups first (or the group itself: None).

        The group's whole need (new blocks and copies on write) is known before anything changes, so a group
        that preempts itself leaves no half-written state behind (a swapped-out table holds computed blocks).
        """
        kv = self.kv
        while kv.append_cost(targets) > kv.num_free_blocks:
            candidates = (g for g in self.running if id(g) not in scheduled or g is group)
            victim = max(candidates, key=lambda g: g.admitted_at)
            if victim is group and id(group) in scheduled:  # just swapped in: it waits for the next step
                return None
            self._preempt(victim)
            if victim is group:
                return None
        copies: list[tuple[int, int]] = []
        for sid, n in targets:
            c = kv.append_slots(sid, n)
            assert c is not None, "append_cost said the blocks were free"
            copies.extend(c)
        return copies

    def _swap_in(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> int:
        """Bring swapped-out groups back, oldest preemption first, while their blocks (and one more block per
        sequence for this step's tokens) fit above the watermark; none in a step that preempted. A group that
        does not fit although nothing runs (blocks other swapped groups keep on the GPU, shared with it or not,
        fill the pool) gives up its CPU copy and waits to be recomputed, so the queue can never deadlock."""
        kv = self.kv
        while self.swapped and budget > 0 and not self._preempted:
            group = self.swapped[0]
            n = len(group.seqs)
            if self.running and sum(len(g.seqs) for g in self.running) + n > self.config.max_num_seqs:
                break
            ids = [s.seq_id for s in group.seqs]
            reserve = self.watermark_blocks if self.running else 0
            if kv.swap_in_cost(ids) + n + reserve > kv.num_free_blocks:
                if self.running:
                    break
                self.swapped.popleft()
                for sid in ids:
                    kv.free(sid)
                group.reset()
                self.waiting.appendleft(group)
                continue
            copies = kv.swap_in(ids)
            assert copies is not None, "swap_in_cost said the blocks were free"
            out.swap_in.extend(copies)
            self.swapped.popleft()
            group.set_status(SequenceStatus.RUNNING)
            self.running.append(group)
            # Never a victim in the step its blocks are copied back (swap-outs run before swap-ins: its
            # copy out would read blocks not yet written).
            scheduled.add(id(group))
            budget = self._schedule_group(out, scheduled, group, budget)
        return budget

    def _admit(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> None:
        """Admit waiting groups while budget, sequence cap (seats for the forks a prompt will spawn included)
        and blocks (above the watermark) allow. A group whose request some :class:`AdmissionGate` cannot serve
        now (its adapter can get no slot), or whose prefix this step computes (:attr:`Admission.LEAD_PENDING`:
        it waits a step to share it), is passed over and keeps its place; the latter keeps its seats too (a
        later group admitted meanwhile never takes them, so later rows do not overtake it), and at most
        ``max_num_seqs`` of them are passed over per step (each costs a prefix lookup)."""
        slots = sum(g.seats() for g in self.running)
        held: list[RequestGroup] = []
        pending = 0
        while self.waiting and budget > 0:
            group = self.waiting[0]
            request = group.request
            if not all(gate.ready(request) for gate in self.gates):
                held.append(self.waiting.popleft())
                continue
            seats = group.seats()
            if slots + seats > self.config.max_num_seqs and self.running:
                break
            reserve = self.watermark_blocks if self.running else 0
            admission = group.allocate(self.kv, reserve, wait_for_lead=bool(out.seqs))
            if admission is Admission.LEAD_PENDING:  # its seats stay reserved: no later group takes them
                held.append(self.waiting.popleft())
                slots += seats
                pending += 1
                if pending >= self.config.max_num_seqs:
                    break
                continue
            if admission is Admission.NO_ROOM:
                break
            self.waiting.popleft()
            for gate in self.gates:  # held until the request ends (LLMEngine releases it)
                gate.take(request)
            group.set_status(SequenceStatus.RUNNING)
            group.admitted_at = next(self._admissions)
            if not request.admitted:
                _count_reuse(self.stats, request, group.seqs[0].num_computed_tokens, self.kv.block_size)
            self.running.append(group)
            slots += seats
            for seq, num_new in group.plan(budget):  # allocate gave it blocks for all its tokens
                self._add(out, seq, num_new)
                budget -= num_new
            scheduled.add(id(group))
        self.waiting.extendleft(reversed(held))

    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        start = seq.num_computed_tokens
        out.seqs.append(ScheduledSeq(seq, start, num_new, self.kv.block_table(seq.seq_id)))
        self.stats.prompt_tokens_computed += max(0, min(start + num_new, seq.num_prompt_tokens) - start)
        # Blocks completed by this step's tokens become prefix-cache hits for later sequences; the forward
        # stores every new token's K/V before any attention reads it, so even a sequence admitted in this
        # same step can share them.
        # (A block ending in a token not known yet is hashed once the token is known.)
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, start + num_new - self._token_pending(seq))

    def _plan_outputs(self, out: SchedulerOutput) -> None:
        """Every scheduled group, in the order of its first sequence in ``out.seqs``, declares what it needs
        from the step (its kind's :meth:`RequestGroup.plan_outputs`); groups forked now (the samples of an
        ``n > 1`` request) join the running list."""
        entries: dict[int, tuple[RequestGroup, list[Entry]]] = {}
        offset = 0
        for row, s in enumerate(out.seqs):
            group = s.seq.group
            assert group is not None
            entries.setdefault(id(group), (group, []))[1].append((row, s, offset))
            offset += s.num_tokens
        for group, mine in entries.values():
            for fork in group.plan_outputs(mine, out, self.kv):
                fork.admitted_at = next(self._admissions)
                self.running.append(fork)

    def _preempt(self, group: RequestGroup) -> None:
        """Swap the group out (swap mode, CPU room, another group running) or free it for recompute."""
        ids = [s.seq_id for s in group.seqs]
        copies = None
        if self._swap and len(self.running) > 1:
            copies = self.kv.swap_out(ids)
        self.running.remove(group)
        if copies is not None:
            assert self._out is not None
            self._out.swap_out.extend(copies)
            group.set_status(SequenceStatus.SWAPPED)
            self.swapped.appendleft(group)
        else:
            for sid in ids:
                self.kv.free(sid)
            group.reset()
            self.waiting.appendleft(group)
        self.stats.num_preemptions += 1
        self._preempted = True

    # ----------------------------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Apply one step's output: every group absorbs its claim (:meth:`RequestGroup.absorb`), and the
        sequences that left their group are freed. Returns the requests whose every sample finished in this step. Steps are updated in
        the order they were scheduled."""
        self._begin_update(out)
        finished: list[Request] = []
        for group, step in out.parts:
            done = group.absorb(step, output, self)
            self.stats.generated_tokens += done.num_tokens
            for seq in done.left:
                self._release(seq)
            if done.left and not group.seqs:
                self.running.remove(group)
            if done.finished:
                finished.append(group.request)
        self._record_gauges()
        return finished

    def _begin_update(self, out: SchedulerOutput) -> None:
        """The step's forward ran: its sequences are computed as far as it went."""
        for s in out.seqs:
            s.seq.num_computed_tokens = s.start + s.num_tokens

    def place(self, seq: Sequence, token: int, index: int) -> bool:
        """Append ``seq``'s sampled token (``index``: its row of the step's samples); True: it was placed."""
        seq.token_ids.append(token)
        seq.num_computed_tokens = len(seq.token_ids) - 1  # forks: computed as far as their parent
        return True

    # ------------------------------------------------------------------------------------------ hooks
    # Overridden by a scheduler that plans a step while the previous one is in flight.
    def _sits_out(self, group: RequestGroup) -> bool:
        """A running group with nothing to compute in the step being scheduled."""
        return False

    def _token_pending(self, seq: Sequence) -> bool:
        """Whether ``seq``'s last token is not known yet (its block is not hashed until it is)."""
        return False

    def _free_blocks(self, seq_id: int) -> None:
        """Free the sequence's blocks."""
        self.kv.free(seq_id)

    def _release(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self._free_blocks(seq.seq_id)

    def _record_gauges(self) -> None:
        st = self.stats
        st.num_steps += 1
        st.running_seqs = sum(len(g.seqs) for g in self.running)
        st.waiting_seqs = sum(len(g.seqs) for g in self.waiting)
        st.swapped_seqs = sum(len(g.seqs) for g in self.swapped)
