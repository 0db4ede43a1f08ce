"""Async scheduling's scheduler: step N+1 is scheduled while step N's forward runs.

:class:`AsyncScheduler` is the :class:`Scheduler` with its hooks filled in (the engine side is
:class:`~batchgen.engine.core.async_engine.AsyncLLMEngine`):

* :meth:`AsyncScheduler.mark_launched` — step N is in flight: its sequences advance as if it had run; each
  sampled sequence gets a :data:`PLACEHOLDER` token at the end (its slot allocated like a real token's, its
  block not hashed into the prefix cache until the token is known), except one whose token will be its last
  by length (:meth:`StopRules.last_by_length`), which sits out every later step;
* ``schedule(ahead=True)`` — N+1 is planned while N runs: its sequences are remembered until its update, so
  that a sequence finished or aborted meanwhile keeps its blocks while N+1's forward may write them (they are
  freed at N+1's update, or when it is cancelled); it must not preempt (the engine plans ahead only when
  :meth:`can_plan_ahead`);
* :meth:`place` — a launched step's token replaces its placeholder (and a token for a sequence finished
  meanwhile is dropped).

Invariants: steps are updated in the order they were scheduled, each exactly once; the sampled tokens, finish
reasons and texts are those of synchronous stepping.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from batchgen.engine.sched.output import SchedulerOutput
from batchgen.engine.sched.request_group import RequestGroup
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.sched.sequence import Sequence, SequenceStatus

PLACEHOLDER = -1
"""The token id standing for a sampled token not yet known; never fed to the model."""


@dataclass
class AsyncSchedulerOutput(SchedulerOutput):
    """A step of the async scheduler: whether it was planned ahead and launched ahead."""

    ahead: bool = False
    """Scheduled while the previous step was in flight."""
    launched: bool = False
    """Launched asynchronously: its sequences were advanced at launch."""


class AsyncScheduler(Scheduler):
    """A scheduler that can plan a step while the previous one is in flight."""

    output_class = AsyncSchedulerOutput

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the sequence ids of each step scheduled ahead and not yet updated, oldest first
        self._ahead: deque[set[int]] = deque()
        self._deferred_free: list[int] = []  # blocks kept for a step in flight
        self._pending: dict[int, int] = {}  # seq id -> its placeholder's row of the launched step's samples
        self._finishing: set[int] = set()  # seq ids whose in-flight token is their last
        self._planning_ahead = False
        self._placing_launched = False

    def can_plan_ahead(self) -> bool:
        """Whether a step scheduled now cannot preempt: nothing is swapped out and every running sequence has
        a free block to grow into."""
        return not self.swapped and self.kv.num_free_blocks >= sum(len(g.seqs) for g in self.running)

    def is_finishing(self, seq: Sequence) -> bool:
        """Whether ``seq``'s in-flight token is its last (it is not scheduled again)."""
        return seq.seq_id in self._finishing

    def schedule(self, ahead: bool = False) -> AsyncSchedulerOutput:
        """Plan the next step; ``ahead``: the previous step is still in flight."""
        self._planning_ahead = ahead
        try:
            out = super().schedule()
            assert isinstance(out, AsyncSchedulerOutput)
        finally:
            self._planning_ahead = False
        if ahead and out.seqs:
            out.ahead = True
            self._ahead.append({s.seq.seq_id for s in out.seqs} | {s.seq_id for s in out.sample_seqs})
        return out

    def mark_launched(self, out: AsyncSchedulerOutput) -> None:
        """``out``'s forward and sampling are in flight: advance its sequences as if it had run (see the module
        docstring). Sequences finished or aborted since ``out`` was scheduled are left alone."""
        out.launched = True
        for s in out.seqs:
            s.seq.num_computed_tokens = s.start + s.num_tokens
        for row, seq in enumerate(out.sample_seqs):
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.num_computed_tokens = seq.num_tokens  # forks: computed as far as their parent
            if self.stop.last_by_length(seq):
                self._finishing.add(seq.seq_id)
            else:
                seq.token_ids.append(PLACEHOLDER)
                self._pending[seq.seq_id] = row

    def placeholder_rows(self, out: SchedulerOutput) -> tuple[list[int], list[int]]:
        """``(dst, src)``: flat input ``dst[i]`` of ``out`` is the placeholder of the previous step's sampled
        row ``src[i]``. A placeholder is always a decode's one token, and decodes come first, one flat input
        per sequence, so a decode's row in ``out.seqs`` is its flat input index."""
        dst, src = [], []
        for j, s in enumerate(out.seqs[: out.num_decodes]):
            row = self._pending.get(s.seq.seq_id)
            if row is not None:
                dst.append(j)
                src.append(row)
        return dst, src

    def cancel(self, out: AsyncSchedulerOutput) -> None:
        """``out``, scheduled ahead, will not run (every sequence in it finished or was aborted meanwhile):
        forget it, and free the blocks finished sequences kept for it."""
        if out.ahead:
            self._ahead.pop()
        if not self._ahead:
            self._free_deferred()

    # ------------------------------------------------------------------------------- the hooks filled
    def _begin_update(self, out: AsyncSchedulerOutput) -> None:  # type: ignore[override]
        if out.ahead:
            self._ahead.popleft()  # its forward is done: blocks it held for finished sequences can go
        self._free_deferred()
        self._placing_launched = out.launched
        if not out.launched:
            super()._begin_update(out)

    def place(self, seq: Sequence, token: int, index: int) -> bool:
        if not self._placing_launched:
            return super().place(seq, token, index)
        if seq.status is SequenceStatus.FINISHED:  # finished or aborted meanwhile: work discarded
            return False
        tokens = seq.token_ids
        if self._pending.pop(seq.seq_id, None) is not None:
            tokens[-1] = token
            if len(tokens) % self.kv.block_size == 0:  # the token completed its block: hash it now
                self.kv.cache_resolved_block(seq.seq_id, tokens)
        else:  # its last token: it had no placeholder
            self._finishing.discard(seq.seq_id)
            tokens.append(token)
        return True

    def _sits_out(self, group: RequestGroup) -> bool:
        return all(s.seq_id in self._finishing for s in group.seqs)

    def _token_pending(self, seq: Sequence) -> bool:
        return seq.seq_id in self._pending

    def _preempt(self, group: RequestGroup) -> None:
        if self._planning_ahead:  # the engine plans ahead only with a free block per running sequence
            raise RuntimeError("async scheduling: a step planned ahead would preempt a sequence in flight")
        super()._preempt(group)

    def _free_blocks(self, seq_id: int) -> None:
        """Free the sequence's blocks now, or after the forward of a step in flight that holds it."""
        self._pending.pop(seq_id, None)
        self._finishing.discard(seq_id)
        if any(seq_id in ids for ids in self._ahead):
            self._deferred_free.append(seq_id)
        else:
            self.kv.free(seq_id)

    def _free_deferred(self) -> None:
        for seq_id in self._deferred_free:
            self.kv.free(seq_id)
        self._deferred_free = []
