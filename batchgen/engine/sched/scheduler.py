"""Continuous batching of request groups under a token budget and a sequence cap, with chunked prefill and
preemption.

The scheduling atom is a :class:`~batchgen.engine.sched.request_group.RequestGroup` (one sequence, ``n`` samples, or
the live beams of a beam search): groups are admitted, scheduled, preempted, swapped and resumed whole, and
each kind plans its own tokens under the budget. ``schedule()`` decides one step: running groups first —
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

A step's results come back in two halves around the output processor (which applies the stop rules):
``place_tokens`` appends the sampled tokens (or fills the placeholders of a launched step); ``finish`` frees the
sequences that stopped, lets each beam group absorb its step and returns the requests that finished.

The scheduler is the only user of the :class:`KVCacheManager`, and keeps the scheduling figures of
:class:`SchedulerCounters` (preemptions, swaps, prefix hits, tokens computed, copy-on-write copies, queue sizes).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.stats import SchedulerCounters
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.request_group import BeamGroup, RequestGroup, make_group
from batchgen.engine.sched.sequence import PLACEHOLDER, Request, Sequence, SequenceStatus
from batchgen.engine.sched.stop import StopRules

if TYPE_CHECKING:
    from batchgen.engine.features.lora_manager import LoRAManager


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
    ``sample_seqs[i]`` gets a token sampled from the last-token logits of ``seqs[sample_rows[i]]``; at the
    step that completes a request's prompt with ``n > 1``, its forks sample from the same row.
    ``beam_rows``: rows of ``seqs`` whose last-token log-softmax feeds beam search, grouped by beam group in
    beam order: ``beam_groups[g]`` takes the next ``len(beam_groups[g].seqs)`` of them.
    A pooling sequence (:mod:`batchgen.engine.features.pooling`) never gets a row: nothing is sampled for it, and the
    update finishes it in the step that completes its prompt (:func:`batchgen.engine.features.pooling.completed`).
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    beam_rows: list[int] = field(default_factory=list)
    beam_groups: list[BeamGroup] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    ahead: bool = False
    """Scheduled while the previous step was in flight (async scheduling)."""
    launched: bool = False
    """Launched asynchronously (:meth:`Scheduler.mark_launched`): its sequences were advanced at launch."""
    plain_greedy: bool = True
    """Every sampled sequence is greedy with no penalty, banned token, seed-dependent draw or logprobs
    (:attr:`Request.plain_greedy`): the step's sampling is one argmax and needs no per-row settings."""
    plain_sampling: bool = True
    """Every sampled sequence is :attr:`Request.plain_sampling`: the sampler needs the rows' filter settings
    only (no per-row penalties, banned tokens, logprobs or generators)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def logit_rows(self) -> list[int]:
        """Rows of ``seqs`` whose last-token logits the runner returns: ``sample_rows`` then ``beam_rows``."""
        return self.sample_rows + self.beam_rows

    def __bool__(self) -> bool:
        return bool(self.seqs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unservable(
    kv: KVCacheManager,
    max_num_seqs: int,
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    beam_width: int = 1,
) -> str | None:
    """Why a request of this size can never run in this pool (None if it can). ``max_tokens`` None: up to
    ``max_model_len``; 0: the prompt alone (a pooling request)."""
    longest = min(num_prompt_tokens + (max_model_len if max_tokens is None else max_tokens), max_model_len)
    bs = kv.block_size
    if beam_width > 1:
        if beam_width > max_num_seqs:
            return f"beam_width={beam_width} exceeds engine.max_num_seqs={max_num_seqs}"
        # The beams share the prompt; each may need its own blocks for all it generates (+ a partial copy).
        need = _cdiv(num_prompt_tokens, bs) + beam_width * (_cdiv(longest - num_prompt_tokens, bs) + 1)
        what = f"prompt ({num_prompt_tokens} tokens) plus max_tokens for {beam_width} beams"
    else:
        need = _cdiv(longest, bs)
        what = f"prompt ({num_prompt_tokens} tokens) plus max_tokens"
    if need <= kv.num_blocks:
        return None
    return (
        f"{what} needs {need} KV blocks but the pool holds "
        f"{kv.num_blocks}; raise engine.kv_cache_memory / num_blocks or lower max_tokens"
    )


def _count_reuse(stats: SchedulerCounters, request: Request, reused: int, block_size: int) -> None:
    """A request's first admission reused ``reused`` prompt tokens: ``num_cached_tokens`` counts the whole
    blocks shared from the prefix cache (as vLLM counts them), ``prompt_tokens_copied`` the rest, copied from a
    cached block."""
    request.admitted = True
    request.num_cached_tokens = reused // block_size * block_size
    stats.prompt_tokens_cached += request.num_cached_tokens
    stats.prompt_tokens_copied += reused - request.num_cached_tokens


def _plan_beam_rows(out: SchedulerOutput, beam_rows: dict[int, int]) -> None:
    """``out.beam_groups`` and their rows (``beam_rows``: seq id -> row), in beam order, group by group."""
    seen: set[int] = set()
    for s in out.seqs:
        group = s.seq.group
        if not isinstance(group, BeamGroup) or id(group) in seen or s.seq.seq_id not in beam_rows:
            continue
        seen.add(id(group))
        rows = [beam_rows.get(b.seq_id) for b in group.seqs]
        if any(r is None for r in rows):
            raise RuntimeError("a beam group was scheduled in part")
        out.beam_groups.append(group)
        out.beam_rows.extend(rows)  # type: ignore[arg-type]


class Scheduler:
    """Owns the waiting queue, the running list and the swapped queue of request groups, and the KV cache
    manager. ``running`` is in admission order; ``swapped`` holds the next group to resume first."""

    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, stop: StopRules, lora: LoRAManager | None = None
    ) -> None:
        self.config = config
        self.lora = lora  # LoRA slots: a request is admitted only once its adapter can be made resident
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
        # Async scheduling: ids of the sequences of each step scheduled ahead and not yet updated; blocks of
        # sequences finished or aborted while in one of them are freed only once its forward is done.
        self._ahead: deque[set[int]] = deque()
        self._deferred_free: list[int] = []
        self._planning_ahead = False
        self.watermark_blocks = max(1, kv.num_blocks // 100)  # free blocks admission leaves for growth

    # ----------------------------------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        """Queue a new request's first sequence, in a group of the request's kind."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(make_group(seq.request, seq, self.stop.eos_token_ids, self.stop.max_model_len))

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

    def can_plan_ahead(self) -> bool:
        """Whether a step scheduled now cannot preempt (async scheduling plans ahead only then): nothing is
        swapped out and every running sequence has a free block to grow into."""
        return not self.swapped and self.kv.num_free_blocks >= sum(len(g.seqs) for g in self.running)

    # --------------------------------------------------------------------------------------- schedule
    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """Plan the next step. ``ahead``: the previous step is still in flight (async scheduling; see
        :meth:`mark_launched`): the step's sequences are remembered until its update, so that sequences
        finishing meanwhile keep their blocks while its forward may write them."""
        out = SchedulerOutput()
        self._out = out
        self._preempted = False
        self._planning_ahead = ahead
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
        self._plan_sampling(out)
        self.stats.num_cow_copies += len(out.copies)
        out.copies += self.kv.end_schedule()  # partial-block prefix copies
        self.stats.num_swapped_out_blocks += len(out.swap_out)
        self.stats.num_swapped_in_blocks += len(out.swap_in)
        self._out = None
        self._planning_ahead = False
        if ahead and out.seqs:
            out.ahead = True
            self._ahead.append({s.seq.seq_id for s in out.seqs} | {s.seq_id for s in out.sample_seqs})
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
            if len(seqs) == 1:
                s = seqs[0]
                if s.finishing:  # async: its in-flight token is its last
                    continue
                (decodes if len(s.token_ids) - s.num_computed_tokens == 1 else prefills).append(g)
            elif g.active():
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
                table = append_one(first.seq_id, first.token_ids, first.pending_row >= 0)
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
        and blocks (above the watermark) allow. A first admission whose LoRA adapter can get no slot now is
        passed over and keeps its place."""
        slots = sum(g.seats() for g in self.running)
        held: list[RequestGroup] = []
        while self.waiting and budget > 0:
            group = self.waiting[0]
            request = group.request
            adapter = request.lora_request if request.lora_slot < 0 else None
            if adapter is not None:
                assert self.lora is not None
                if not self.lora.can_acquire(adapter.lora_int_id):
                    held.append(self.waiting.popleft())
                    continue
            seats = group.seats()
            if slots + seats > self.config.max_num_seqs and self.running:
                break
            reserve = self.watermark_blocks if self.running else 0
            if not group.allocate(self.kv, reserve, wait_for_lead=bool(out.seqs)):
                break
            self.waiting.popleft()
            if adapter is not None:  # pinned until the request ends (LLMEngine releases it)
                assert self.lora is not None
                request.lora_slot = self.lora.acquire(adapter.lora_int_id)
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
        # (Async scheduling: a placeholder token's block is hashed once the token is known.)
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, start + num_new - (seq.pending_row >= 0))

    def _plan_sampling(self, out: SchedulerOutput) -> None:
        """Which sequences sample from which rows (a group's fan-out samples from its parent's row); which
        rows feed each beam group (a group is scheduled whole, so all its beams complete together). Nothing
        is sampled from a chunk that does not complete its sequence, nor for a pooling sequence."""
        beam_rows: dict[int, int] = {}
        sample_rows, sample_seqs = out.sample_rows, out.sample_seqs
        plain = plain_sampling = True
        for row, s in enumerate(out.seqs):
            seq = s.seq
            if s.start + s.num_tokens != len(seq.token_ids) or seq.request.pooling is not None:
                continue
            request = seq.request
            if request.beam is not None:
                beam_rows[seq.seq_id] = row
                continue
            sample_rows.append(row)
            sample_seqs.append(seq)
            plain = plain and request.plain_greedy
            plain_sampling = plain_sampling and request.plain_sampling
            for group in seq.group.fan_out(seq, self.kv):  # type: ignore[union-attr]
                group.admitted_at = next(self._admissions)
                self.running.append(group)
                sample_rows.append(row)
                sample_seqs.append(group.seqs[0])
        out.plain_greedy, out.plain_sampling = plain, plain_sampling
        if beam_rows:
            _plan_beam_rows(out, beam_rows)

    def _preempt(self, group: RequestGroup) -> None:
        """Swap the group out (swap mode, CPU room, another group running) or free it for recompute."""
        if self._planning_ahead:  # the engine plans ahead only with a free block per running sequence
            raise RuntimeError("async scheduling: a step planned ahead would preempt a sequence in flight")
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
    def place_tokens(self, out: SchedulerOutput, token_ids: list[int]) -> list[tuple[Sequence, int, int]]:
        """The first half of a step's update: ``token_ids[i]`` belongs to ``out.sample_seqs[i]``; append it
        (or, for a launched step, put it in place of the placeholder). Returns ``(sequence, token, i)`` of the
        tokens placed (a launched step's token for a sequence finished meanwhile is dropped). Steps are
        updated in the order they were scheduled."""
        if out.ahead:
            self._ahead.popleft()  # its forward is done: blocks it held for finished sequences can go
        self._free_deferred()
        launched = out.launched
        if not launched:
            for s in out.seqs:
                s.seq.num_computed_tokens = s.start + s.num_tokens
        bs = self.kv.block_size
        placed: list[tuple[Sequence, int, int]] = []
        for i, (seq, token) in enumerate(zip(out.sample_seqs, token_ids)):
            tokens = seq.token_ids
            if not launched:
                tokens.append(token)
                seq.num_computed_tokens = len(tokens) - 1  # forks: computed as far as their parent
            elif seq.status is SequenceStatus.FINISHED:  # finished or aborted meanwhile: work discarded
                continue
            elif seq.pending_row >= 0:
                tokens[-1] = token
                seq.pending_row = -1
                if len(tokens) % bs == 0:  # the token completed its block: hash it now that it is known
                    self.kv.cache_resolved_block(seq.seq_id, tokens)
            else:  # finishing: it had no placeholder
                tokens.append(token)
            placed.append((seq, token, i))
        self.stats.generated_tokens += len(placed)
        return placed

    def finish(
        self, out: SchedulerOutput, stopped: list[Sequence], beam_logprobs: Tensor | None = None
    ) -> list[Request]:
        """The second half: free the ``stopped`` sequences (the output processor applied the stop rules),
        then let each beam group of ``out`` absorb its rows (``beam_logprobs``: float32
        ``[len(out.beam_rows), V]``, the log-softmax of the raw logits of ``out.beam_rows``). Returns the
        requests whose every sample finished in this step."""
        finished: list[Request] = []
        for seq in stopped:
            self._finish(seq)
            seq.request.num_finished += 1
            if seq.request.is_finished:
                finished.append(seq.request)
        if out.beam_groups:
            if beam_logprobs is None or beam_logprobs.shape[0] != len(out.beam_rows):
                raise ValueError(f"update needs beam_logprobs for the {len(out.beam_rows)} beam rows")
            offset = 0
            for group in out.beam_groups:
                m = len(group.seqs)
                self.stats.generated_tokens += group.absorb(
                    beam_logprobs[offset : offset + m], self.kv, self._release
                )
                offset += m
                if not group.seqs:
                    self.running.remove(group)
                    finished.append(group.request)
        self._record_gauges()
        return finished

    # ------------------------------------------------------------------------------ async scheduling
    def mark_launched(self, out: SchedulerOutput) -> None:
        """Async scheduling: ``out``'s forward and sampling are in flight. Advance its sequences as if it had
        run, so the next step can be scheduled before the sampled tokens are known: computed tokens move on,
        and each sampled sequence gets a :data:`PLACEHOLDER` token at the end (its slot is allocated like a
        real token's; ``pending_row`` is its row in the step's sampled tokens), except one whose token will be
        its last by length (``max_tokens``, ``max_model_len``): it is marked ``finishing`` and not scheduled
        again. Sequences finished or aborted since ``out`` was scheduled are left alone (work discarded)."""
        out.launched = True
        for s in out.seqs:
            s.seq.num_computed_tokens = s.start + s.num_tokens
        last = self.stop.max_model_len - 1  # a sequence of this many tokens ends with the token in flight
        finished = SequenceStatus.FINISHED
        for row, seq in enumerate(out.sample_seqs):
            if seq.status is finished:
                continue
            tokens = seq.token_ids
            n = len(tokens)
            seq.num_computed_tokens = n  # forks: computed as far as their parent
            max_tokens = seq.request.params.max_tokens
            if n >= last or (max_tokens is not None and n - seq.num_prompt_tokens >= max_tokens - 1):
                seq.finishing = True
            else:
                tokens.append(PLACEHOLDER)
                seq.pending_row = row

    def cancel(self, out: SchedulerOutput) -> None:
        """Async scheduling: ``out``, scheduled ahead, will not run (every sequence in it finished or was
        aborted meanwhile): forget it, and free the blocks finished sequences kept for it."""
        if out.ahead:
            self._ahead.pop()
        if not self._ahead:
            self._free_deferred()

    def _finish(self, seq: Sequence) -> None:
        """A stopped sequence leaves its group (and the group the running list with its last sequence)."""
        self._release(seq)
        group = seq.group
        assert group is not None
        group.remove(seq)
        if not group.seqs:
            self.running.remove(group)

    def _release(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self._free_blocks(seq.seq_id)

    def _free_blocks(self, seq_id: int) -> None:
        """Free the sequence's blocks now, or after the forward of a step in flight that holds it."""
        if any(seq_id in ids for ids in self._ahead):
            self._deferred_free.append(seq_id)
        else:
            self.kv.free(seq_id)

    def _free_deferred(self) -> None:
        """Free the blocks :meth:`_free_blocks` kept for a step whose forward has now run (or will not)."""
        for seq_id in self._deferred_free:
            self.kv.free(seq_id)
        self._deferred_free = []

    def _record_gauges(self) -> None:
        st = self.stats
        st.num_steps += 1
        st.running_seqs = sum(len(g.seqs) for g in self.running)
        st.waiting_seqs = sum(len(g.seqs) for g in self.waiting)
        st.swapped_seqs = sum(len(g.seqs) for g in self.swapped)
