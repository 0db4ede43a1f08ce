"""Continuous batching under a token budget and a sequence cap, with chunked prefill and preemption.

``schedule()`` decides one step: running sequences first — decodes (one token) before unfinished prefill
chunks — then waiting sequences in arrival order while the token budget, the sequence cap and the block pool
allow. When a running sequence cannot get a block, the most recently admitted running sequence that is not
yet scheduled in this step (possibly itself) is preempted: its blocks are freed and it goes back to the front
of the waiting queue to be recomputed (its generated tokens are kept, so it resumes where it was). Admission
never preempts, and keeps a watermark of free blocks (counted after prefix-cache hits) while anything runs,
so running sequences can grow without immediate preemption.

``update(output, tokens)`` applies the step's sampled tokens: appends them, applies the stop rules, finishes
sequences (freeing their blocks) and returns the requests whose every sample is finished.

The scheduler is the only user of the :class:`KVCacheManager`, and keeps the scheduling figures of
:class:`EngineStats` (preemptions, prefix hits, tokens computed, copy-on-write copies, KV usage).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_cache import KVCacheManager
from batchgen.engine.sequence import Request, Sequence, SequenceStatus
from batchgen.engine.stats import EngineStats
from batchgen.engine.stop import StopRules


@dataclass
class ScheduledSeq:
    """One sequence's work in a step: positions ``start .. start + num_tokens - 1`` are computed, reading and
    writing the KV cache through ``block_table`` (which covers at least ``start + num_tokens`` tokens)."""

    seq: Sequence
    start: int
    num_tokens: int
    block_table: list[int]

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
    ``sample_seqs[i]`` gets a token sampled from the last-token logits of ``seqs[sample_rows[i]]``; at the
    step that completes a request's prompt with ``n > 1``, its forks sample from the same row.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, stop: StopRules, stats: EngineStats) -> None:
        self.config = config
        self.kv = kv
        self.stop = stop
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self._admissions = itertools.count()
        # Free blocks admission leaves for running sequences to grow into (one place; see _admit).
        self.watermark_blocks = max(1, kv.num_blocks // 100)

    # ----------------------------------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.kv.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def unservable(self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> str | None:
        """Why a request of this size can never run in this pool (None if it can)."""
        longest = min(num_prompt_tokens + (max_tokens or max_model_len), max_model_len)
        need = _cdiv(longest, self.kv.block_size)
        if need <= self.kv.num_blocks:
            return None
        return (
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens needs {need} KV blocks but the pool holds "
            f"{self.kv.num_blocks}; raise engine.kv_cache_memory / num_blocks or lower max_tokens"
        )

    # --------------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: set[int] = set()
        budget = self._schedule_running(out, scheduled, self.config.max_num_batched_tokens)
        self._admit(out, scheduled, budget)
        out.seqs.sort(key=lambda s: s.num_tokens != 1)  # stable: decodes first
        out.num_decodes = sum(1 for s in out.seqs if s.num_tokens == 1)
        self._plan_sampling(out)
        self.stats.num_cow_copies += len(out.copies)
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> int:
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # A prefill in progress already holds blocks for its whole prompt.
            target = max(seq.num_computed_tokens + num_new, self.kv.num_tokens(seq.seq_id))
            copies = self._grow(seq, target, scheduled)
            if copies is None:  # preempted itself
                continue
            out.copies.extend(copies)
            self._add(out, seq, num_new, scheduled)
            budget -= num_new
        return budget

    def _grow(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> list[tuple[int, int]] | None:
        """Give ``seq`` slots for ``num_tokens`` tokens, preempting others (or itself: returns None)."""
        while True:
            copies = self.kv.append_slots(seq.seq_id, num_tokens)
            if copies is not None:
                return copies
            victim = max((s for s in self.running if s.seq_id not in scheduled), key=lambda s: s.admitted_at)
            self._preempt(victim)
            if victim is seq:
                return None

    def _admit(self, out: SchedulerOutput, scheduled: set[int], budget: int) -> None:
        """Admit waiting sequences while budget, sequence cap and blocks (above the watermark) allow."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            reserve = self.watermark_blocks if self.running else 0
            num_cached = self.kv.allocate(seq.seq_id, seq.token_ids, seq.num_tokens, reserve_blocks=reserve)
            if num_cached is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.admitted_at = next(self._admissions)
            seq.num_computed_tokens = num_cached
            if not seq.request.admitted:
                seq.request.admitted = True
                seq.request.num_cached_tokens = num_cached
                self.stats.prompt_tokens_cached += num_cached
            self.running.append(seq)
            num_new = min(seq.num_tokens - num_cached, budget)
            self._add(out, seq, num_new, scheduled)
            budget -= num_new

    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int, scheduled: set[int]) -> None:
        start = seq.num_computed_tokens
        out.seqs.append(ScheduledSeq(seq, start, num_new, self.kv.block_table(seq.seq_id)))
        scheduled.add(seq.seq_id)
        self.stats.prompt_tokens_computed += max(0, min(start + num_new, seq.num_prompt_tokens) - start)
        # Blocks completed by this step's tokens become prefix-cache hits for later sequences; the forward
        # stores every new token's K/V before any attention reads it, so even a sequence admitted in this
        # same step can share them.
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, start + num_new)

    def _plan_sampling(self, out: SchedulerOutput) -> None:
        """Which sequences sample from which rows; fork the other samples of an ``n > 1`` request in the
        step that completes its prompt (they share every block, the partial last one included)."""
        for row, s in enumerate(out.seqs):
            if not s.completes:
                continue
            seq = s.seq
            request = seq.request
            out.sample_rows.append(row)
            out.sample_seqs.append(seq)
            if seq.num_output_tokens == 0 and request.params.n > 1 and len(request.seqs) == 1:
                for k in range(1, request.params.n):
                    child = seq.fork(k)
                    self.kv.fork(seq.seq_id, child.seq_id)
                    child.status = SequenceStatus.RUNNING
                    child.admitted_at = next(self._admissions)
                    self.running.append(child)
                    out.sample_rows.append(row)
                    out.sample_seqs.append(child)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    # ----------------------------------------------------------------------------------------- update
    def update(
        self, out: SchedulerOutput, token_ids: list[int], logprobs: list[dict[int, float] | None]
    ) -> list[Request]:
        """Apply one step's results: ``token_ids[i]`` (and ``logprobs[i]``) belong to ``out.sample_seqs[i]``.

        Returns the requests whose every sample finished in this step.
        """
        for s in out.seqs:
            s.seq.num_computed_tokens = s.start + s.num_tokens
        finished: list[Request] = []
        for seq, token, lp in zip(out.sample_seqs, token_ids, logprobs):
            seq.num_computed_tokens = seq.num_tokens  # forks: computed as far as their parent
            seq.token_ids.append(token)
            if seq.logprobs is not None and lp is not None:
                seq.logprobs.append(lp)
            reason = self.stop.check(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                self._finish(seq)
                seq.request.num_finished += 1
                if seq.request.is_finished:
                    finished.append(seq.request)
        self.stats.generated_tokens += len(token_ids)
        self._record_gauges()
        return finished

    def _finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq.seq_id)
        self.running.remove(seq)

    def _record_gauges(self) -> None:
        st = self.stats
        st.num_steps += 1
        st.running_seqs = len(self.running)
        st.waiting_seqs = len(self.waiting)
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
