"""Beam search: the per-request search state, step for step the arithmetic of transformers' ``_beam_search``.

One :class:`BeamSearch` per request with ``beam_width = k > 1``. The scheduler owns the sequences; this module
only decides. Each step it takes the log-softmax of the raw (float32) logits of the ``k`` running beams —
``1`` row at the first step, which stands for ``k`` identical copies of the prompt — and returns the ``k``
continuations to keep as ``(parent beam, token)`` pairs, in order. The scheduler then forks every parent kept
more than once (:meth:`~batchgen.engine.kv.kv_cache.KVCacheManager.fork`: the beams share every block, and only
the partial last block is copied when a beam writes into it), reuses a parent kept once and frees the parents
not kept.

The arithmetic mirrors transformers 4.5x/5.x ``GenerationMixin._beam_search`` for one batch item, with the
same tensor operations in the same order (float32, ``torch.topk`` for every selection, so ties break the same
way):

* the candidates are the top ``max(2, 1 + n_stop) * k`` of ``log_softmax + running score`` over all ``k * V``
  (beam, token) pairs, where ``n_stop`` counts the tokens that end a beam (the eos ids unless ``ignore_eos``,
  plus ``stop_token_ids``); running scores start at ``[0, -1e9, ...]``;
* a candidate *hits* when its token ends a beam or the sequence reaches ``max_len``; the next running beams are
  the top ``k`` candidates after ``-1e9`` is added to those that hit;
* a hit among the first ``k`` candidates becomes a finished hypothesis scored
  ``sum_logprobs / generated_len ** length_penalty`` (``generated_len`` counts the new token, not the prompt);
  the ``k`` best finished hypotheses are kept, merged by ``torch.topk`` with the previous ones;
* ``early_stopping``: ``True`` stops when ``k`` hypotheses are finished; ``False`` stops when the best running
  beam, scored at the current length, cannot beat the worst finished one; ``"never"`` uses ``max_len`` for
  that bound when ``length_penalty > 0`` (exact); the search also stops when every candidate hits.

``min_tokens`` bans the stop tokens (``-inf``) until reached, like transformers' ``min_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.output import GroupStep, SchedulerOutput
from batchgen.engine.sched.request_group import (
    Absorbed,
    Admission,
    Entry,
    Plan,
    RequestGroup,
    UpdateContext,
    unservable,
)
from batchgen.engine.sched.sequence import Request, Sequence
from batchgen.engine.sched.stop import StopRules

if TYPE_CHECKING:
    from batchgen.engine.worker.step_input import RunnerOutput
    from batchgen.sampling_params import SamplingParams

_NEG = -1.0e9


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the stop token included), its length-penalised score and the
    plain sum of its tokens' logprobs."""

    token_ids: list[int]
    score: float
    cumulative_logprob: float
    finish_reason: str
    stop_reason: int | None = None


@dataclass
class BeamSearch:
    """Search state of one beam request (batch size 1 in transformers' terms).

    ``beams`` are the request's live sequences in beam order (the scheduler keeps it): the prompt sequence
    alone until the first step, then ``k`` sequences.
    """

    num_beams: int
    num_return: int
    length_penalty: float
    early_stopping: bool | str
    min_tokens: int
    prompt_len: int
    max_len: int
    """Longest sequence (prompt + generated): candidates reaching it finish with reason 'length'."""
    stop_ids: list[int]
    user_stop_ids: frozenset[int] = frozenset()
    beams: list[Sequence] = field(default_factory=list)
    done: bool = False

    @classmethod
    def build(cls, params: SamplingParams, prompt_len: int, stop: StopRules) -> BeamSearch:
        """A search whose beams end on the engine's stop tokens and length limit (:class:`StopRules`)."""
        return cls(
            num_beams=params.beam_width,
            num_return=params.n,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            min_tokens=params.min_tokens,
            prompt_len=prompt_len,
            max_len=stop.length_limit(params, prompt_len),
            stop_ids=stop.stop_token_ids(params),
            user_stop_ids=frozenset(params.stop_token_ids or ()),
        )

    def __post_init__(self) -> None:
        k = self.num_beams
        self.beams_to_keep = max(2, 1 + len(self.stop_ids)) * k
        self.cur_len = self.prompt_len
        self._stop = torch.tensor(self.stop_ids, dtype=torch.long)
        self._top_num_beam_mask = torch.cat(
            (torch.ones(k, dtype=torch.bool), torch.zeros(self.beams_to_keep - k, dtype=torch.bool))
        )
        self.running_beam_scores = torch.zeros((1, k), dtype=torch.float)
        self.running_beam_scores[:, 1:] = _NEG
        self.beam_scores = torch.full((1, k), fill_value=_NEG, dtype=torch.float)
        self.is_sent_finished = torch.zeros((1, k), dtype=torch.bool)
        self.is_early_stop_heuristic_unsatisfied = torch.ones((1, 1), dtype=torch.bool)
        self.finished: list[Hypothesis | None] = [None] * k

    # ------------------------------------------------------------------------------------------- step
    def step(self, log_probs: Tensor, beam_tokens: list[list[int]]) -> list[tuple[int, int]]:
        """One beam step. ``log_probs``: float32 ``[m, V]`` log-softmax of the running beams' raw logits (``m``
        is 1 at the first step, else ``k``); ``beam_tokens[i]``: generated tokens of beam ``i`` so far.

        Returns the ``k`` next running beams as ``(parent row, token)`` in order, or ``[]`` when the search is
        over (``done``; the results are in :meth:`results`).
        """
        k = self.num_beams
        m, vocab = log_probs.shape
        if m not in (1, k) or len(beam_tokens) != m:
            raise ValueError(f"beam step over {m} rows ({len(beam_tokens)} token lists) for {k} beams")
        log_probs = self._step_log_probs(log_probs)

        # b. accumulate; c. top-K continuations over all k * V (beam, token) pairs.
        scores = log_probs[None] + self.running_beam_scores[:, :, None]
        scores = torch.reshape(scores, (1, -1))
        topk_log_probs, topk_indices = torch.topk(scores, k=self.beams_to_keep)
        topk_beam = topk_indices // vocab
        topk_ids = topk_indices % vocab

        # d. which candidates end their beam (a stop token, or the length limit).
        hits = torch.isin(topk_ids, self._stop)
        if self.cur_len + 1 >= self.max_len:
            hits = torch.ones_like(hits)

        # e. the next running beams: the best k candidates that did not end.
        topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * _NEG
        next_topk_indices = torch.topk(topk_running_log_probs, k=k)[1]
        running_beam_scores = torch.take_along_dim(topk_running_log_probs, next_topk_indices, dim=1)

        # f. merge the candidates that ended among the first k into the finished hypotheses.
        cand_beam = [b if m == k else 0 for b in topk_beam[0].tolist()]  # the parent row of each candidate
        cand_token = topk_ids[0].tolist()
        self._merge_finished(topk_log_probs, hits, beam_tokens, cand_beam, cand_token)

        # g. the stopping condition of the search as a whole.
        self.running_beam_scores = running_beam_scores
        self.cur_len += 1
        if self._search_over(hits):
            self.done = True
            return []
        return [(cand_beam[c], cand_token[c]) for c in next_topk_indices[0].tolist()]

    def _step_log_probs(self, log_probs: Tensor) -> Tensor:
        """``log_probs`` as float32 ``[k, V]`` on the CPU (the first step's single row stands for ``k`` copies),
        the stop tokens banned (``-inf``) while fewer than ``min_tokens`` are generated."""
        log_probs = log_probs.detach().to("cpu", torch.float32)
        if log_probs.shape[0] == 1:
            log_probs = log_probs.expand(self.num_beams, log_probs.shape[1])
        if self.stop_ids and self.cur_len - self.prompt_len < self.min_tokens:
            log_probs = log_probs.clone()
            log_probs[:, self._stop[self._stop < log_probs.shape[1]]] = -float("inf")
        return log_probs

    def _merge_finished(
        self,
        topk_log_probs: Tensor,
        hits: Tensor,
        beam_tokens: list[list[int]],
        cand_beam: list[int],
        cand_token: list[int],
    ) -> None:
        """Step f: the candidates among the first ``k`` that hit, scored with the length penalty, merged by
        ``torch.topk`` with the finished hypotheses so far (``beam_scores``, ``is_sent_finished``,
        ``finished``). Candidate ``c`` is token ``cand_token[c]`` after row ``cand_beam[c]`` of ``beam_tokens``."""
        k = self.num_beams
        did_top_num_beams_just_finished = hits & self._top_num_beam_mask[None, :]
        penalised = topk_log_probs / ((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        beams_in_batch_are_full = torch.all(self.is_sent_finished, dim=-1, keepdim=True) & (
            self.early_stopping is True
        )
        penalised += beams_in_batch_are_full.to(torch.float32) * _NEG
        penalised += (~self.is_early_stop_heuristic_unsatisfied).to(torch.float32) * _NEG
        penalised += (~did_top_num_beams_just_finished) * _NEG
        merged_scores = torch.cat((self.beam_scores, penalised), dim=1)
        merged_is_sent_finished = torch.cat((self.is_sent_finished, did_top_num_beams_just_finished), dim=1)
        topk_merged_indices = torch.topk(merged_scores, k=k)[1]
        self.beam_scores = torch.take_along_dim(merged_scores, topk_merged_indices, dim=1)
        self.is_sent_finished = torch.take_along_dim(merged_is_sent_finished, topk_merged_indices, dim=1)

        finished_now = did_top_num_beams_just_finished[0].tolist()
        new_scores = self.beam_scores[0].tolist()
        merged: list[Hypothesis | None] = []
        for slot, idx in enumerate(topk_merged_indices[0].tolist()):
            if idx < k:
                merged.append(self.finished[idx])
            elif finished_now[idx - k]:
                c = idx - k
                token_ids = beam_tokens[cand_beam[c]] + [cand_token[c]]
                merged.append(self._hypothesis(token_ids, new_scores[slot], float(topk_log_probs[0, c])))
            else:
                merged.append(None)  # a placeholder slot (transformers keeps a not-finished row there)
        self.finished = merged

    def _hypothesis(self, token_ids: list[int], score: float, cumulative_logprob: float) -> Hypothesis:
        """A finished beam ending in ``token_ids[-1]``: a stop token ('stop') or the length limit ('length')."""
        tok = token_ids[-1]
        return Hypothesis(
            token_ids=token_ids,
            score=score,
            cumulative_logprob=cumulative_logprob,
            finish_reason="length" if tok not in self.stop_ids else "stop",
            stop_reason=tok if tok in self.user_stop_ids else None,
        )

    def _search_over(self, hits: Tensor) -> bool:
        """Step g, after ``cur_len`` moved on: no improvement possible, no open beam, or every candidate hit."""
        self._check_early_stop_heuristic()
        improvement_possible = torch.any(self.is_early_stop_heuristic_unsatisfied)
        exists_open_beam = ~(torch.all(self.is_sent_finished) & (self.early_stopping is True))
        valid_continuations = ~torch.all(hits)
        return not bool(improvement_possible & exists_open_beam & valid_continuations)

    def _check_early_stop_heuristic(self) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_hypothetical_length = self.max_len - self.prompt_len
        else:
            best_hypothetical_length = self.cur_len - self.prompt_len
        best_possible_running_score = self.running_beam_scores[:, :1] / (
            best_hypothetical_length**self.length_penalty
        )
        worst_finished_score = torch.where(
            self.is_sent_finished, torch.min(self.beam_scores, dim=1, keepdim=True)[0], _NEG
        )
        self.is_early_stop_heuristic_unsatisfied = self.is_early_stop_heuristic_unsatisfied & torch.any(
            best_possible_running_score > worst_finished_score, dim=-1, keepdim=True
        )

    # ---------------------------------------------------------------------------------------- results
    def results(self) -> list[Hypothesis]:
        """The ``num_return`` best finished hypotheses, best first (after the search is done)."""
        out = []
        for h in self.finished[: self.num_return]:
            out.append(h if h is not None else Hypothesis([], _NEG, _NEG, "length"))
        return out


# ---------------------------------------------------------------------------------------------------------------
# The request-group kind of a beam search: the scheduler's side of the search.


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fork_beam(parent: Sequence) -> Sequence:
    """A new beam of the same request: a copy of ``parent``'s tokens (computed as far); not registered in
    ``request.seqs`` (the group keeps it equal to its beams)."""
    child = Sequence(parent.request, list(parent.token_ids), parent.num_prompt_tokens)
    child.num_computed_tokens = parent.num_computed_tokens
    child.status = parent.status
    return child


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class BeamGroup(RequestGroup):
    """The live beams of a beam-search request (``search.beams``, in beam order)."""

    def __init__(self, request: Request, seq: Sequence, search: BeamSearch) -> None:
        super().__init__(request, seq)
        self.search = search
        search.beams = self.seqs
        request.ranked = search  # the request's outputs: the search's best hypotheses
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
            n = self.chunk(s, min(todo, budget))
            if n <= 0:
                continue
            plan.append((s, n))
            budget -= n
            after[s.seq_id] = s.num_computed_tokens + n
        return plan

    def allocate(self, kv: KVCacheManager, reserve: int, wait_for_lead: bool = False) -> Admission:
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
            return Admission.NO_ROOM
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
                return Admission.NO_ROOM
        return Admission.ADMITTED

    def reset(self) -> None:
        super().reset()
        self.deps.clear()

    def unservable(self, kv: KVCacheManager, max_num_seqs: int, stop: StopRules) -> str | None:
        """The beams share the prompt; each may need its own blocks for all it generates (+ a partial copy)."""
        k, n, bs = self.search.num_beams, len(self.request.prompt_token_ids), kv.block_size
        if k > max_num_seqs:
            return f"beam_width={k} exceeds engine.max_num_seqs={max_num_seqs}"
        longest = stop.length_limit(self.request.params, n)
        need = _cdiv(n, bs) + k * (_cdiv(longest - n, bs) + 1)
        return unservable(kv, need, f"prompt ({n} tokens) plus max_tokens for {k} beams")

    def overlappable(self) -> bool:
        return False  # each step forks and drops beams from the previous one's scores

    def plan_outputs(
        self, entries: list[Entry], out: SchedulerOutput, kv: KVCacheManager
    ) -> list[RequestGroup]:
        """The beams' rows are scored (their log-softmax returned), in beam order; a group is scheduled whole,
        so all its beams complete together."""
        step = self._addon_step(entries, out)
        rows = {s.seq.seq_id: row for row, s, _ in entries if s.completes}
        if rows:
            if any(b.seq_id not in rows for b in self.seqs):
                raise RuntimeError("a beam group was scheduled in part")
            step.scores = out.score([rows[b.seq_id] for b in self.seqs])
        if step:
            out.parts.append((self, step))
        return []

    def absorb(self, step: GroupStep, output: RunnerOutput, ctx: UpdateContext) -> Absorbed:
        """One beam step over the beams' log-softmax rows: keep the best continuations, fork parents kept more
        than once, drop the others (all of them when the search is done)."""
        done = super().absorb(step, output, ctx)  # the request's add-ons
        if step.scores is None:
            return done
        lo, hi = step.scores
        if output.scores is None or output.scores.shape[0] < hi:
            raise ValueError(f"update needs the scored rows {lo}:{hi} of the beam groups")
        log_probs = output.scores[lo:hi]
        parents = list(self.seqs)
        request = self.request
        chosen = self.search.step(log_probs, [p.output_token_ids for p in parents])
        self.deps.clear()
        if self.search.done:
            done.left += parents
            done.num_tokens += len(parents)
            done.finished = True
            self.seqs.clear()
            request.seqs = []
            request.num_finished = request.params.n
            return done
        kept: set[int] = set()
        children: list[tuple[Sequence, int]] = []
        for i, token in chosen:
            parent = parents[i]
            if parent.seq_id in kept:  # a second continuation of the same beam: fork it (before it grows)
                child = _fork_beam(parent)
                child.group = self
                ctx.kv.fork(parent.seq_id, child.seq_id)
            else:
                kept.add(parent.seq_id)
                child = parent
            children.append((child, token))
        done.left += [p for p in parents if p.seq_id not in kept]  # their blocks go (shared ones stay)
        for child, token in children:
            child.token_ids.append(token)
        self.seqs[:] = [c for c, _ in children]
        request.seqs = list(self.seqs)
        done.num_tokens += len(children)
        return done
