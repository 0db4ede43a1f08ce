"""Continuous batching under a token budget and a sequence cap, with chunked prefill and preemption.

Each step: running sequences are scheduled first — decodes (one token) before unfinished prefill chunks —
then waiting sequences are admitted in arrival order while the token budget, the sequence cap and the block
pool allow. When a running sequence cannot get a block, the most recently admitted running sequence that is
not yet scheduled in this step (possibly itself) is preempted: its blocks are freed and it goes back to the
front of the waiting queue to be recomputed (its generated tokens are kept, so it resumes where it was).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_cache import KVCacheManager
from batchgen.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work, in batch order: decodes (one new token each) first, then prefill chunks.

    ``copies`` are copy-on-write block copies (src, dst) to perform before the forward.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Owns the waiting queue and the running list; talks to the KV cache manager for blocks."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self._admissions = itertools.count()
        self.num_preemptions = 0
        self.prompt_tokens_cached = 0  # prompt tokens served from the prefix cache at first admission
        # Keep a few blocks free at admission so running sequences can grow without immediate preemption.
        self.watermark_blocks = max(1, kv.num_blocks // 100)

    # ----------------------------------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Register a forked sequence whose blocks the KV cache manager already holds."""
        seq.status = SequenceStatus.RUNNING
        seq.admitted_at = next(self._admissions)
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and drop it from the running list."""
        seq.status = SequenceStatus.FINISHED
        self.kv.free(seq.seq_id)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.kv.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.kv.block_size)

    # --------------------------------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

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
            while True:
                copies = self.kv.append_slots(seq.seq_id, target)
                if copies is not None:
                    break
                victim = self._pick_victim(scheduled)
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            batch.copies.extend(copies)
            self._schedule(batch, seq, num_new, scheduled)
            budget -= num_new

        # Admit waiting sequences (never by preempting running ones).
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            need = self.blocks_needed(seq.num_tokens)
            if self.running and self.kv.num_free_blocks - need < self.watermark_blocks:
                break
            num_cached = self.kv.allocate(seq.seq_id, seq.token_ids, seq.num_tokens)
            if num_cached is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.admitted_at = next(self._admissions)
            seq.num_computed_tokens = num_cached
            if not seq.request.admitted:
                seq.request.admitted = True
                seq.request.num_cached_tokens = num_cached
                self.prompt_tokens_cached += num_cached
            self.running.append(seq)
            num_new = min(seq.num_tokens - num_cached, budget)
            self._schedule(batch, seq, num_new, scheduled)
            budget -= num_new

        # Decodes first in the batch (the attention kernels rely on it).
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
        batch.seqs = [batch.seqs[i] for i in order]
        batch.num_new_tokens = [batch.num_new_tokens[i] for i in order]
        return batch

    def _schedule(self, batch: ScheduledBatch, seq: Sequence, num_new: int, scheduled: set[int]) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        scheduled.add(seq.seq_id)
        # Blocks completed by this step's tokens become prefix-cache hits for later sequences; the forward
        # stores every new token's K/V before any attention reads it, so even a sequence admitted in this
        # same step can share them.
        self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new)

    def _pick_victim(self, scheduled: set[int]) -> Sequence:
        candidates = [s for s in self.running if s.seq_id not in scheduled]
        return max(candidates, key=lambda s: s.admitted_at)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
