"""Continuous batching under a token budget and a sequence cap, with chunked prefill, preemption and beam search.

``schedule()`` decides one step over *units*: a unit is one sequence, or every live beam of a beam-search
request (scheduled, preempted and resumed together: a beam group never half-runs). Running units come first —
decodes (one token per sequence) before unfinished prefill chunks — then swapped-out units are swapped back in,
then (only when nothing is swapped out) waiting units are admitted in arrival order while the token budget, the
sequence cap and the block pool allow.

**Preemption.** When a running unit cannot get its blocks for the step, the most recently admitted running
unit that is not yet scheduled in this step (possibly itself) is preempted until it can. With
``preemption_mode="recompute"`` its blocks are freed and it goes back to the front of the waiting queue to be
recomputed (generated tokens are kept, so it resumes where it was). With ``"swap"`` its blocks are copied to
the CPU block pool (``SchedulerOutput.swap_out``) and it waits in the swapped queue; it comes back, copies
``swap_in`` performed before its next forward, as soon as its blocks (and one more per sequence) fit. A unit
whose blocks do not fit in the CPU pool, or the only running unit, falls back to recompute. No unit is swapped
back in a step that preempted, and no new unit is admitted while one is swapped out.

**Beam groups.** A beam request starts as its prompt sequence; the step that completes the prompt samples
``k`` beams by forking it (:mod:`batchgen.engine.beam` picks, ``update`` forks survivors, frees dropped beams).
A group resumed after a recompute is re-admitted as a whole: the first beam through the prefix cache, every
other beam forked from the earlier beam it shares the longest block-aligned prefix with (so the beams share
their common history again); each beam is prefilled up to, not including, its last token — a forked beam once
its parent has computed the shared prefix — and the group then decodes its last tokens together.

A step's results come back in two halves around the output processor (which applies the stop rules):
``place_tokens`` appends the sampled tokens (or fills the placeholders of a launched step); ``finish`` frees the
sequences that stopped, runs one beam step per beam group and returns the requests that finished.

The scheduler is the only user of the :class:`KVCacheManager`, and keeps the scheduling figures of
:class:`EngineStats` (preemptions, swaps, prefix hits, tokens computed, copy-on-write copies, KV usage).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from batchgen.engine.beam import BeamSearch
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_cache import KVCacheManager
from batchgen.engine.prompt_logprobs import cache_lookup_tokens
from batchgen.engine.sequence import PLACEHOLDER, Request, Sequence, SequenceStatus
from batchgen.engine.stats import EngineStats
from batchgen.engine.stop import StopRules

if TYPE_CHECKING:
    from batchgen.engine.lora_manager import LoRAManager


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step: positions ``start .. start + num_tokens - 1`` are computed, reading and
    writing the KV cache through ``block_table`` (which covers at least ``start + num_tokens`` tokens)."""

    seq: Sequence
    start: int
    num_tokens: int
    block_table: list[int]
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
    ``copies``: copy-on-write block copies ``(src, dst)`` to perform before the forward.
    ``swap_out``: ``(gpu_block, cpu_block)`` copies of preempted units; ``swap_in``: ``(cpu_block, gpu_block)``
    copies of resumed ones. The runner performs swap-outs, then ``copies``, then swap-ins, then the forward
    (a block freed by a swap-out or a preemption may be handed out again in the same step).
    ``sample_seqs[i]`` gets a token sampled from the last-token logits of ``seqs[sample_rows[i]]``; at the
    step that completes a request's prompt with ``n > 1``, its forks sample from the same row.
    ``beam_rows``: rows of ``seqs`` whose last-token log-softmax feeds beam search, grouped by beam group in
    beam order: ``beam_groups[g]`` takes the next ``len(beam_groups[g].beams)`` of them.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    beam_rows: list[int] = field(default_factory=list)
    beam_groups: list[BeamSearch] = field(default_factory=list)
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


Unit = list[Sequence]
"""Sequences scheduled and preempted together: one sequence, or the live beams of a beam request."""


class Scheduler:
    """Owns the waiting queue, the running list, the swapped queue and the KV cache manager."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        stop: StopRules,
        stats: EngineStats,
        lora: LoRAManager | None = None,
    ) -> None:
        self.config = config
        self.lora = lora  # LoRA slots: a request is admitted only once its adapter can be made resident
        self.kv = kv
        self.stop = stop
        self.stats = stats
        self.waiting: deque[Sequence] = deque()  # the beams of a group waiting to resume are contiguous
        self.running: list[Sequence] = []  # admission order
        self.swapped: deque[Unit] = deque()  # swapped-out units, next to resume first
        self._admissions = itertools.count()
        self._swap = config.preemption_mode == "swap" and kv.num_cpu_blocks > 0
        # Resumed beams forked from another beam of their group: (parent, shared tokens) until computed.
        self._deps: dict[int, tuple[Sequence, int]] = {}
        self._out: SchedulerOutput | None = None  # the step being planned (preemptions add swap-outs)
        self._preempted = False
        # Async scheduling: ids of the sequences of each step scheduled ahead (while the previous one was in
        # flight) and not yet updated; blocks of sequences finished or aborted while in one of them are freed
        # only once its forward is done (the next update).
        self._ahead: deque[set[int]] = deque()
        self._deferred_free: list[int] = []
        self._planning_ahead = False
        # Free blocks admission leaves for running sequences to grow into (one place; see _admit).
        self.watermark_blocks = max(1, kv.num_blocks // 100)

    # ----------------------------------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        request = seq.request
        if request.params.beam_width > 1 and request.beam is None:
            request.beam = BeamSearch.build(
                request.params,
                len(request.prompt_token_ids),
                self.stop.eos_token_ids,
                self.stop.max_model_len,
            )
            request.beam.beams = [seq]
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._free_blocks(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.kv.free(seq.seq_id)
            self.swapped = deque(u for u in self.swapped if all(s is not seq for s in u))
        seq.status = SequenceStatus.FINISHED
        self._deps.pop(seq.seq_id, None)

    def abort_request(self, request: Request) -> None:
        """Abort every live sequence of the request (all beams of a beam group)."""
        seqs = request.beam.beams if request.beam is not None else request.seqs
        for seq in list(seqs):
            if not seq.is_finished:
                self.abort(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def can_plan_ahead(self) -> bool:
        """Whether a step scheduled now cannot preempt (async scheduling plans ahead only then): nothing is
        swapped out and every running sequence has a free block to grow into."""
        return not self.swapped and self.kv.num_free_blocks >= len(self.running)

    def unservable(
        self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, beam_width: int = 1
    ) -> str | None:
        """Why a request of this size can never run in this pool (None if it can)."""
        longest = min(num_prompt_tokens + (max_tokens or max_model_len), max_model_len)
        bs = self.kv.block_size
        if beam_width > 1:
            if beam_width > self.config.max_num_seqs:
                return f"beam_width={beam_width} exceeds engine.max_num_seqs={self.config.max_num_seqs}"
            # The beams share the prompt; each may need its own blocks for all it generates (+ a partial copy).
            need = _cdiv(num_prompt_tokens, bs) + beam_width * (_cdiv(longest - num_prompt_tokens, bs) + 1)
            what = f"prompt ({num_prompt_tokens} tokens) plus max_tokens for {beam_width} beams"
        else:
            need = _cdiv(longest, bs)
            what = f"prompt ({num_prompt_tokens} tokens) plus max_tokens"
        if need <= self.kv.num_blocks:
            return None
        return (
            f"{what} needs {need} KV blocks but the pool holds "
            f"{self.kv.num_blocks}; raise engine.kv_cache_memory / num_blocks or lower max_tokens"
        )

    @staticmethod
    def _unit(seq: Sequence) -> Unit:
        beam = seq.request.beam
        return beam.beams if beam is not None else [seq]

    def _running_units(self) -> list[Unit]:
        units: list[Unit] = []
        seen: set[int] = set()
        for s in self.running:
            beam = s.request.beam
            if beam is None:
                units.append([s])
            elif id(beam) not in seen:
                seen.add(id(beam))
                units.append(beam.beams)
        return units

    def _seq_slots(self) -> int:
        """Running sequences plus the forks that running prompts will add when they complete."""
        n = len(self.running)
        for s in self.running:
            if len(s.token_ids) == s.num_prompt_tokens:
                request = s.request
                if request.beam is not None:
                    if len(request.beam.beams) == 1:
                        n += request.beam.num_beams - 1
                elif request.params.n > 1 and len(request.seqs) == 1:
                    n += request.params.n - 1
        return n

    # --------------------------------------------------------------------------------------- schedule
    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """Plan the next step. ``ahead``: the previous step is still in flight (async scheduling; see
        :meth:`mark_launched`): the step's sequences are remembered until its update, so that sequences
        finishing meanwhile keep their blocks while its forward may write them."""
        out = SchedulerOutput()
        self._out = out
        self._preempted = False
        self._planning_ahead = ahead
        scheduled: set[int] = set()
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
        self.stats.num_swapped_out_blocks += len(out.swap_out)
        self.stats.num_swapped_in_blocks += len(out.swap_in)
        self._out = None
        self._planning_ahead = False
        if ahead and out.seqs:
            out.ahead = True
            self._ahead.append({s.seq.seq_id for s in out.seqs} | {s.seq_id for s in out.sample_seqs})
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> int:
        """Running units in admission order, decodes first, then unfinished prefills.

        Decode fast path: a lone sequence decoding its last token into an exclusive last block with room needs
        only an O(1) counter bump in the KV manager (:meth:`KVCacheManager.append_one`) and its live block
        table (no copy); every other unit takes the general path (:meth:`_schedule_unit`), in the same order,
        so preemption picks the same victims."""
        decodes: list[Sequence | Unit] = []
        prefills: list[Sequence | Unit] = []
        seen: set[int] = set()
        for s in self.running:
            beam = s.request.beam
            if beam is None:
                if s.finishing:  # async: its in-flight token is its last
                    continue
                (decodes if len(s.token_ids) - s.num_computed_tokens == 1 else prefills).append(s)
            elif id(beam) not in seen:
                seen.add(id(beam))
                unit = beam.beams
                if all(len(b.token_ids) - b.num_computed_tokens == 1 for b in unit):
                    decodes.append(unit)
                else:
                    prefills.append(unit)
        append_one = self.kv.append_one
        seqs = out.seqs
        add_scheduled = scheduled.add
        running = SequenceStatus.RUNNING
        prompt_computed = 0
        for item in decodes:
            if budget <= 0:
                break
            if isinstance(item, Sequence):
                if item.status is not running:  # preempted earlier in this loop
                    continue
                table = append_one(item.seq_id, item.token_ids, item.pending_row >= 0)
                if table is not None:
                    start = len(item.token_ids) - 1
                    seqs.append(ScheduledSeq(item, start, 1, table, True))
                    add_scheduled(item.seq_id)
                    if start < item.num_prompt_tokens:
                        prompt_computed += 1
                    budget -= 1
                    continue
                item = [item]
            elif item[0].status is not running:
                continue
            budget = self._schedule_unit(out, scheduled, item, budget)
        self.stats.prompt_tokens_computed += prompt_computed
        for item in prefills:
            if budget <= 0:
                break
            unit = [item] if isinstance(item, Sequence) else item
            if unit[0].status is not running:
                continue
            budget = self._schedule_unit(out, scheduled, unit, budget)
        return budget

    def _plan_unit(self, unit: Unit, budget: int) -> list[tuple[Sequence, int]]:
        """How many tokens each sequence of the unit computes this step (sequences with 0 are left out)."""
        if len(unit) == 1:
            seq = unit[0]
            return [(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))]
        if all(s.num_tokens - s.num_computed_tokens == 1 for s in unit):
            return [(s, 1) for s in unit] if budget >= len(unit) else []  # the group decodes as a whole
        # A beam group resuming after a recompute: prefill each beam up to its last token (held back so that
        # the group samples together), a forked beam only once its parent computes the prefix they share (in
        # this step at the latest: every layer stores the batch's K/V before attending).
        plan: list[tuple[Sequence, int]] = []
        after: dict[int, int] = {}
        for s in unit:
            todo = s.num_tokens - 1 - s.num_computed_tokens
            if todo <= 0:
                continue
            dep = self._deps.get(s.seq_id)
            if dep is not None and after.get(dep[0].seq_id, dep[0].num_computed_tokens) < dep[1]:
                continue
            if budget <= 0:
                break
            n = min(todo, budget)
            plan.append((s, n))
            budget -= n
            after[s.seq_id] = s.num_computed_tokens + n
        return plan

    def _schedule_unit(self, out: SchedulerOutput, scheduled: set[int], unit: Unit, budget: int) -> int:
        """Schedule what the unit can compute this step; returns the budget left."""
        plan = self._plan_unit(unit, budget)
        if not plan:
            return budget
        # A prefill in progress already holds blocks for its whole prompt.
        targets = [(s, max(s.num_computed_tokens + n, self.kv.num_tokens(s.seq_id))) for s, n in plan]
        copies = self._grow(unit, targets, scheduled)
        if copies is None:  # preempted itself
            return budget
        out.copies.extend(copies)
        for seq, num_new in plan:
            self._add(out, seq, num_new, scheduled)
            budget -= num_new
        scheduled.update(s.seq_id for s in unit)  # a group is never split by a preemption
        return budget

    def _grow(
        self, unit: Unit, targets: list[tuple[Sequence, int]], scheduled: set[int]
    ) -> list[tuple[int, int]] | None:
        """Give the unit's sequences their slots, preempting other units first (or the unit itself: None).

        The unit's whole need (new blocks and copies on write) is known before anything changes, so a unit
        that preempts itself leaves no half-written state behind (a swapped-out table holds computed blocks).
        """
        kv = self.kv
        ids = [(s.seq_id, n) for s, n in targets]
        while kv.append_cost(ids) > kv.num_free_blocks:
            victim = max((s for s in self.running if s.seq_id not in scheduled), key=lambda s: s.admitted_at)
            victim_unit = self._unit(victim)
            self._preempt(victim_unit)
            if victim in unit:
                return None
        copies: list[tuple[int, int]] = []
        for sid, n in ids:
            c = kv.append_slots(sid, n)
            assert c is not None, "append_cost said the blocks were free"
            copies.extend(c)
        return copies

    def _swap_in(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> int:
        """Bring swapped-out units back, oldest preemption first, while their blocks (and one more block per
        sequence for this step's tokens) fit above the watermark; none in a step that preempted. A unit that
        does not fit although nothing runs (blocks other swapped units keep on the GPU, shared with it or not,
        fill the pool) gives up its CPU copy and waits to be recomputed, so the queue can never deadlock."""
        kv = self.kv
        while self.swapped and budget > 0 and not self._preempted:
            unit = self.swapped[0]
            if len(self.running) + len(unit) > self.config.max_num_seqs and self.running:
                break
            ids = [s.seq_id for s in unit]
            reserve = self.watermark_blocks if self.running else 0
            if kv.swap_in_cost(ids) + len(unit) + reserve > kv.num_free_blocks:
                if self.running:
                    break
                self.swapped.popleft()
                for s in unit:
                    kv.free(s.seq_id)
                    s.status = SequenceStatus.WAITING
                    s.num_computed_tokens = 0
                    self._deps.pop(s.seq_id, None)
                self.waiting.extendleft(reversed(unit))
                continue
            copies = kv.swap_in(ids)
            assert copies is not None, "swap_in_cost said the blocks were free"
            out.swap_in.extend(copies)
            self.swapped.popleft()
            for s in unit:
                s.status = SequenceStatus.RUNNING
                self.running.append(s)
            budget = self._schedule_unit(out, scheduled, unit, budget)
            scheduled.update(ids)  # never a victim in the step its blocks are copied back
        return budget

    def _admit(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> None:
        """Admit waiting units while budget, sequence cap and blocks (above the watermark) allow."""
        slots = self._seq_slots()
        held: list[Sequence] = []  # first admissions whose adapter has no slot now: they keep their place
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            request = seq.request
            if request.lora_request is not None and request.lora_slot < 0:
                assert self.lora is not None
                if not self.lora.can_acquire(request.lora_request.lora_int_id):
                    held.append(self.waiting.popleft())
                    continue
            beam = request.beam
            if beam is not None and len(beam.beams) > 1:
                if slots + len(beam.beams) > self.config.max_num_seqs and self.running:
                    break
                left = self._admit_beam_group(out, scheduled, beam.beams, budget)
                if left is None:
                    break
                slots += len(beam.beams)
                budget = left
                continue
            # Seats for the forks the prompt will spawn (n > 1 samples, beams), so they never overflow the cap.
            if beam is not None:
                seats = beam.num_beams
            elif request.params.n > 1 and len(request.seqs) == 1 and seq.num_output_tokens == 0:
                seats = request.params.n
            else:
                seats = 1
            if slots + seats > self.config.max_num_seqs and self.running:
                break
            reserve = self.watermark_blocks if self.running else 0
            lookup = cache_lookup_tokens(seq)  # prompt logprobs cap the prefix-cache hit
            num_cached = self.kv.allocate(
                seq.seq_id, lookup, seq.num_tokens, reserve_blocks=reserve, root=request.cache_root
            )
            if num_cached is None:
                break
            self.waiting.popleft()
            if request.lora_request is not None and request.lora_slot < 0:
                assert self.lora is not None  # pinned until the request ends (LLMEngine releases it)
                request.lora_slot = self.lora.acquire(request.lora_request.lora_int_id)
            seq.status = SequenceStatus.RUNNING
            seq.admitted_at = next(self._admissions)
            seq.num_computed_tokens = num_cached
            if not request.admitted:
                request.admitted = True
                request.num_cached_tokens = num_cached
                self.stats.prompt_tokens_cached += num_cached
            self.running.append(seq)
            slots += seats
            num_new = min(seq.num_tokens - num_cached, budget)
            self._add(out, seq, num_new, scheduled)
            budget -= num_new
        self.waiting.extendleft(reversed(held))

    def _admit_beam_group(
        self, out: SchedulerOutput, scheduled: set[int], unit: Unit, budget: int
    ) -> int | None:
        """Re-admit a beam group preempted by recompute, all beams or none; returns the budget left or None."""
        k = len(unit)
        if any(self.waiting[i] is not unit[i] for i in range(k)):
            raise RuntimeError("the beams of a group waiting to resume are not together in the waiting queue")
        kv = self.kv
        bs = kv.block_size
        plan: list[tuple[int | None, int]] = []  # (beam to fork from, tokens shared) or (None, 0): allocate
        cost = 0
        for j, s in enumerate(unit):
            parent, shared = None, 0
            for i in range(j):
                n = min(_common_prefix(unit[i].token_ids, s.token_ids), s.num_tokens - 1) // bs * bs
                if n > shared:
                    parent, shared = i, n
            if parent is None:
                cost += kv.allocate_cost(s.token_ids, s.num_tokens, s.request.cache_root)
            else:
                cost += _cdiv(s.num_tokens, bs) - shared // bs
            plan.append((parent, shared))
        reserve = self.watermark_blocks if self.running else 0
        if cost + reserve > kv.num_free_blocks:
            return None
        done: list[Sequence] = []
        ok = True
        for s, (parent, shared) in zip(unit, plan):
            if parent is None:
                num_cached = kv.allocate(s.seq_id, s.token_ids, s.num_tokens, root=s.request.cache_root)
                if num_cached is None:
                    ok = False
                    break
                done.append(s)
                s.num_computed_tokens = num_cached
            else:
                kv.fork(unit[parent].seq_id, s.seq_id, shared)
                done.append(s)
                if kv.append_slots(s.seq_id, s.num_tokens) is None:
                    ok = False
                    break
                s.num_computed_tokens = shared
                self._deps[s.seq_id] = (unit[parent], shared)
        if not ok:  # nothing was registered in the prefix cache yet: freeing undoes it all
            for s in done:
                kv.free(s.seq_id)
                s.num_computed_tokens = 0
                self._deps.pop(s.seq_id, None)
            return None
        for _ in range(k):
            self.waiting.popleft()
        t = next(self._admissions)
        for s in unit:
            s.status = SequenceStatus.RUNNING
            s.admitted_at = t
            self.running.append(s)
        budget = self._schedule_unit(out, scheduled, unit, budget)
        scheduled.update(s.seq_id for s in unit)
        return budget

    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int, scheduled: set[int]) -> None:
        start = seq.num_computed_tokens
        out.seqs.append(ScheduledSeq(seq, start, num_new, self.kv.block_table(seq.seq_id)))
        scheduled.add(seq.seq_id)
        self.stats.prompt_tokens_computed += max(0, min(start + num_new, seq.num_prompt_tokens) - start)
        # Blocks completed by this step's tokens become prefix-cache hits for later sequences; the forward
        # stores every new token's K/V before any attention reads it, so even a sequence admitted in this
        # same step can share them.
        # (Async scheduling: a placeholder token's block is hashed once the token is known.)
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, start + num_new - (seq.pending_row >= 0))

    def _plan_sampling(self, out: SchedulerOutput) -> None:
        """Which sequences sample from which rows; fork the other samples of an ``n > 1`` request in the
        step that completes its prompt (they share every block, the partial last one included); which rows
        feed each beam group (a group is scheduled whole, so all its beams complete together)."""
        beam_rows: dict[int, int] = {}
        sample_rows, sample_seqs = out.sample_rows, out.sample_seqs
        plain = plain_sampling = True
        for row, s in enumerate(out.seqs):
            seq = s.seq
            if s.start + s.num_tokens != len(seq.token_ids):  # does not complete: nothing sampled
                continue
            request = seq.request
            if request.beam is not None:
                beam_rows[seq.seq_id] = row
                continue
            sample_rows.append(row)
            sample_seqs.append(seq)
            plain = plain and request.plain_greedy
            plain_sampling = plain_sampling and request.plain_sampling
            if (
                request.params.n > 1
                and len(seq.token_ids) == seq.num_prompt_tokens
                and len(request.seqs) == 1
            ):
                for k in range(1, request.params.n):
                    child = seq.fork(k)
                    self.kv.fork(seq.seq_id, child.seq_id)
                    child.status = SequenceStatus.RUNNING
                    child.admitted_at = next(self._admissions)
                    self.running.append(child)
                    sample_rows.append(row)
                    sample_seqs.append(child)
        out.plain_greedy, out.plain_sampling = plain, plain_sampling
        if beam_rows:
            seen: set[int] = set()
            for s in out.seqs:
                beam = s.seq.request.beam
                if beam is None or id(beam) in seen or s.seq.seq_id not in beam_rows:
                    continue
                seen.add(id(beam))
                rows = [beam_rows.get(b.seq_id) for b in beam.beams]
                if any(r is None for r in rows):
                    raise RuntimeError("a beam group was scheduled in part")
                out.beam_groups.append(beam)
                out.beam_rows.extend(rows)  # type: ignore[arg-type]

    def _preempt(self, unit: Unit) -> None:
        """Swap the unit out (swap mode, CPU room, another unit running) or free it for recompute."""
        if self._planning_ahead:  # the engine plans ahead only with a free block per running sequence
            raise RuntimeError("async scheduling: a step planned ahead would preempt a sequence in flight")
        copies = None
        if self._swap and any(s not in unit for s in self.running):
            copies = self.kv.swap_out([s.seq_id for s in unit])
        if copies is not None:
            assert self._out is not None
            self._out.swap_out.extend(copies)
            for s in unit:
                self.running.remove(s)
                s.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(unit)
        else:
            for s in unit:
                self.kv.free(s.seq_id)
                self.running.remove(s)
                s.status = SequenceStatus.WAITING
                s.num_computed_tokens = 0
                self._deps.pop(s.seq_id, None)
            self.waiting.extendleft(reversed(unit))
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
                    self._cache_resolved_block(seq)
            else:  # finishing: it had no placeholder
                tokens.append(token)
            placed.append((seq, token, i))
        self.stats.generated_tokens += len(placed)
        return placed

    def finish(
        self, out: SchedulerOutput, stopped: list[Sequence], beam_logprobs: Tensor | None = None
    ) -> list[Request]:
        """The second half: free the ``stopped`` sequences (the output processor applied the stop rules),
        then run one beam step per beam group of ``out`` (``beam_logprobs``: float32 ``[len(out.beam_rows),
        V]``, the log-softmax of the raw logits of ``out.beam_rows``). Returns the requests whose every
        sample finished in this step."""
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
            for beam in out.beam_groups:
                m = len(beam.beams)
                self._beam_step(beam, beam_logprobs[offset : offset + m], finished)
                offset += m
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

    def _cache_resolved_block(self, seq: Sequence) -> None:
        """A placeholder that completed its block just became a known token: register the block in the prefix
        cache if it is allocated (the step scheduled meanwhile computes it); the deferred half of
        :meth:`_add`'s hashing."""
        n = len(seq.token_ids)
        kv = self.kv
        if kv.enable_prefix_caching and kv.num_tokens(seq.seq_id) >= n:
            kv.cache_full_blocks(seq.seq_id, seq.token_ids, n)

    def _beam_step(self, beam: BeamSearch, log_probs: Tensor, finished: list[Request]) -> None:
        """One beam step: keep the best continuations, fork parents kept more than once, free dropped ones."""
        parents = beam.beams
        request = parents[0].request
        chosen = beam.step(log_probs, [p.output_token_ids for p in parents])
        for p in parents:
            self._deps.pop(p.seq_id, None)
        if beam.done:
            for p in parents:
                self._finish(p)
            beam.beams = []
            request.seqs = []
            request.num_finished = request.params.n
            finished.append(request)
            self.stats.generated_tokens += len(parents)
            return
        kept: set[int] = set()
        children: list[tuple[Sequence, int]] = []
        for i, token in chosen:
            parent = parents[i]
            if parent.seq_id in kept:  # a second continuation of the same beam: fork it (before it grows)
                child = parent.fork_beam()
                self.kv.fork(parent.seq_id, child.seq_id)
                self.running.append(child)
            else:
                kept.add(parent.seq_id)
                child = parent
            children.append((child, token))
        for p in parents:
            if p.seq_id not in kept:
                self._finish(p)  # dropped: its blocks go back (those shared with survivors stay)
        for child, token in children:
            child.token_ids.append(token)
        beam.beams = [c for c, _ in children]
        request.seqs = list(beam.beams)
        self.stats.generated_tokens += len(children)

    def _finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self._free_blocks(seq.seq_id)
        self.running.remove(seq)

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
        st.running_seqs = len(self.running)
        st.waiting_seqs = len(self.waiting)
        st.swapped_seqs = sum(len(u) for u in self.swapped)
        st.peak_running_seqs = max(st.peak_running_seqs, st.running_seqs)
        kvs = self.kv.stats()
        st.kv_blocks_used = kvs.blocks_used
        st.kv_usage = kvs.blocks_used / self.kv.num_blocks
        st.peak_kv_usage = max(st.peak_kv_usage, st.kv_usage)
        st.kv_utilization = kvs.kv_utilization
        st.kv_fragmentation = kvs.internal_fragmentation
        if kvs.blocks_used:
            st.min_kv_utilization = min(st.min_kv_utilization, kvs.kv_utilization)
            st.peak_kv_fragmentation = max(st.peak_kv_fragmentation, kvs.internal_fragmentation)
