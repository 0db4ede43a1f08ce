"""Request groups: the scheduling atom. A group is the live sequences of one request, admitted, scheduled,
preempted, swapped and resumed as one.

* :class:`RequestGroup` — one sequence (``n = 1``).
* :class:`SampleGroup` — the first sample of an ``n > 1`` request: it holds seats for all ``n`` until the step
  that completes its prompt, which forks the other ``n - 1`` (:meth:`SampleGroup.fan_out`; they share every
  block, the partial last one included), each into a one-sequence group of its own: samples are independent,
  so each is preempted and resumed alone (a pool that holds one sample at a time still serves the request).
* :class:`BeamGroup` — the live beams of a beam search. The beams decode together (a group never half-runs);
  each step :meth:`BeamGroup.absorb` hands their log-softmax rows to :class:`~batchgen.engine.features.beam.BeamSearch`
  (the arithmetic) and forks, keeps or frees beams as it decides. A group re-admitted after a recompute
  (:meth:`BeamGroup.allocate`) brings the first beam back through the prefix cache and forks every other from
  the earlier beam it shares the longest block-aligned prefix with; each beam is prefilled up to, not
  including, its last token (a forked one once its parent has computed the prefix they share), then the group
  decodes its last tokens together.

Invariant: every sequence of ``seqs`` has the group's status (waiting, running or swapped); a group holds KV
blocks for all of them while running or swapped, for none while waiting.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from batchgen.engine.features.beam import BeamSearch
from batchgen.engine.features.prompt_logprobs import cache_lookup_tokens
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.sequence import Request, Sequence, SequenceStatus

Plan = list[tuple[Sequence, int]]
"""(sequence, tokens it computes this step); sequences computing nothing are left out."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RequestGroup:
    """One sequence (the base behaviour every kind shares)."""

    def __init__(self, request: Request, seq: Sequence) -> None:
        self.request = request
        self.seqs: list[Sequence] = [seq]
        self.admitted_at = -1  # admission counter: the most recently admitted group is preempted first
        seq.group = self

    def seats(self) -> int:
        """Sequence slots the group takes once admitted, the forks its prompt will spawn included."""
        return len(self.seqs)

    def decoding(self) -> bool:
        """Every sequence that runs this step computes exactly its last token."""
        return all(len(s.token_ids) - s.num_computed_tokens == 1 for s in self.seqs if not s.finishing)

    def active(self) -> bool:
        """Some sequence has work (async scheduling: one whose in-flight token is its last has none)."""
        return any(not s.finishing for s in self.seqs)

    def plan(self, budget: int) -> Plan:
        """How many tokens each sequence computes this step, in order, under ``budget`` (here: the one
        sequence's next chunk)."""
        s = self.seqs[0]
        todo = s.num_tokens - s.num_computed_tokens
        if s.finishing or todo <= 0 or budget <= 0:
            return []
        return [(s, min(todo, budget))]

    def allocate(self, kv: KVCacheManager, reserve: int, wait_for_lead: bool = False) -> bool:
        """Admission: blocks for the sequence (prefix-cache hits counted as computed), keeping ``reserve``
        blocks free; False, changing nothing, when they do not fit (or, with ``wait_for_lead``, when part of
        its prefix is being computed by the step being scheduled: see ``KVCacheManager.allocate``)."""
        s = self.seqs[0]
        lookup = cache_lookup_tokens(s)  # prompt logprobs cap the prefix-cache hit
        root = self.request.cache_root
        num_cached = kv.allocate(
            s.seq_id, lookup, s.num_tokens, reserve_blocks=reserve, root=root, wait_for_lead=wait_for_lead
        )
        if num_cached is None:
            return False
        s.num_computed_tokens = num_cached
        return True

    def set_status(self, status: SequenceStatus) -> None:
        for s in self.seqs:
            s.status = status

    def reset(self) -> None:
        """Back to waiting after its blocks were freed (recompute): nothing computed, tokens kept."""
        for s in self.seqs:
            s.status = SequenceStatus.WAITING
            s.num_computed_tokens = 0

    def fan_out(self, seq: Sequence, kv: KVCacheManager) -> list[RequestGroup]:
        """The groups of the sequences forked from ``seq`` in the step that completes it (running; they sample
        from its row)."""
        return []

    def remove(self, seq: Sequence) -> None:
        """``seq`` stopped: it leaves the group."""
        self.seqs.remove(seq)


class SampleGroup(RequestGroup):
    """The first sample of an ``n > 1`` request (see the module docstring)."""

    def seats(self) -> int:
        return self.request.params.n if len(self.request.seqs) == 1 else len(self.seqs)

    def fan_out(self, seq: Sequence, kv: KVCacheManager) -> list[RequestGroup]:
        if len(seq.token_ids) != seq.num_prompt_tokens or len(self.request.seqs) != 1:
            return []
        groups = []
        for k in range(1, self.request.params.n):
            child = seq.fork(k)
            kv.fork(seq.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            groups.append(RequestGroup(self.request, child))
        return groups


class BeamGroup(RequestGroup):
    """The live beams of a beam-search request (``search.beams``, in beam order)."""

    def __init__(self, request: Request, seq: Sequence, search: BeamSearch) -> None:
        super().__init__(request, seq)
        self.search = search
        search.beams = self.seqs
        request.beam = search
        # Resumed beams forked from another beam of the group: (parent, shared tokens) until computed.
        self.deps: dict[int, tuple[Sequence, int]] = {}

    def seats(self) -> int:
        return self.search.num_beams if len(self.seqs) == 1 else len(self.seqs)

    def plan(self, budget: int) -> Plan:
        seqs = self.seqs
        if len(seqs) == 1:
            return super().plan(budget)
        if all(s.num_tokens - s.num_computed_tokens == 1 for s in seqs):
            return [(s, 1) for s in seqs] if budget >= len(seqs) else []  # the group decodes as a whole
        # Resuming after a recompute: prefill each beam up to its last token (held back so that the group
        # samples together), a forked beam only once its parent computes the prefix they share (in this step
        # at the latest: every layer stores the batch's K/V before attending).
        plan: Plan = []
        after: dict[int, int] = {}
        for s in seqs:
            todo = s.num_tokens - 1 - s.num_computed_tokens
            if todo <= 0:
                continue
            dep = self.deps.get(s.seq_id)
            if dep is not None and after.get(dep[0].seq_id, dep[0].num_computed_tokens) < dep[1]:
                continue
            if budget <= 0:
                break
            n = min(todo, budget)
            plan.append((s, n))
            budget -= n
            after[s.seq_id] = s.num_computed_tokens + n
        return plan

    def allocate(self, kv: KVCacheManager, reserve: int, wait_for_lead: bool = False) -> bool:
        """All beams or none: the first through the prefix cache, each other forked from the earlier beam it
        shares the longest block-aligned prefix with (short of its last token)."""
        seqs = self.seqs
        if len(seqs) == 1:
            return super().allocate(kv, reserve, wait_for_lead)
        bs = kv.block_size
        plan: list[tuple[int | None, int]] = []  # (beam to fork from, tokens shared) or (None, 0): allocate
        cost = 0
        for j, s in enumerate(seqs):
            parent, shared = None, 0
            for i in range(j):
                n = min(_common_prefix(seqs[i].token_ids, s.token_ids), s.num_tokens - 1) // bs * bs
                if n > shared:
                    parent, shared = i, n
            if parent is None:
                cost += kv.allocate_cost(s.token_ids, s.num_tokens, self.request.cache_root)
            else:
                cost += _cdiv(s.num_tokens, bs) - shared // bs
            plan.append((parent, shared))
        if cost + reserve > kv.num_free_blocks:
            return False
        done: list[Sequence] = []
        for s, (parent, shared) in zip(seqs, plan):
            if parent is None:
                num_cached = kv.allocate(s.seq_id, s.token_ids, s.num_tokens, root=self.request.cache_root)
                ok = num_cached is not None
                if ok:
                    done.append(s)
                    s.num_computed_tokens = num_cached
            else:
                kv.fork(seqs[parent].seq_id, s.seq_id, shared)
                done.append(s)
                ok = kv.append_slots(s.seq_id, s.num_tokens) is not None
                s.num_computed_tokens = shared
                self.deps[s.seq_id] = (seqs[parent], shared)
            if not ok:  # nothing was registered in the prefix cache yet: freeing undoes it all
                for d in done:
                    kv.free(d.seq_id)
                    d.num_computed_tokens = 0
                self.deps.clear()
                return False
        return True

    def reset(self) -> None:
        super().reset()
        self.deps.clear()

    def absorb(self, log_probs: Tensor, kv: KVCacheManager, free: Callable[[Sequence], None]) -> int:
        """One beam step over the beams' log-softmax rows: keep the best continuations, fork parents kept more
        than once, ``free`` the dropped ones (all of them when the search is done). Returns the tokens
        generated."""
        parents = list(self.seqs)
        request = self.request
        chosen = self.search.step(log_probs, [p.output_token_ids for p in parents])
        self.deps.clear()
        if self.search.done:
            for p in parents:
                free(p)
            self.seqs.clear()
            request.seqs = []
            request.num_finished = request.params.n
            return len(parents)
        kept: set[int] = set()
        children: list[tuple[Sequence, int]] = []
        for i, token in chosen:
            parent = parents[i]
            if parent.seq_id in kept:  # a second continuation of the same beam: fork it (before it grows)
                child = parent.fork_beam()
                child.group = self
                kv.fork(parent.seq_id, child.seq_id)
            else:
                kept.add(parent.seq_id)
                child = parent
            children.append((child, token))
        for p in parents:
            if p.seq_id not in kept:
                free(p)  # dropped: its blocks go back (those shared with survivors stay)
        for child, token in children:
            child.token_ids.append(token)
        self.seqs[:] = [c for c, _ in children]
        request.seqs = list(self.seqs)
        return len(children)


def make_group(request: Request, seq: Sequence, eos_token_ids: list[int], max_model_len: int) -> RequestGroup:
    """The group kind for a new request's first sequence."""
    params = request.params
    if params.beam_width > 1:
        search = BeamSearch.build(params, len(request.prompt_token_ids), eos_token_ids, max_model_len)
        return BeamGroup(request, seq, search)
    if params.n > 1:
        return SampleGroup(request, seq)
    return RequestGroup(request, seq)
