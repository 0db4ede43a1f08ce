"""Prompt logprobs: the log-probability of every prompt token (and the top-k at each position), computed in
the prefill from the logits of *all* positions of a prefill chunk, not only the last one.

Position ``i``'s logits predict token ``i + 1``; so the chunk ``[start, start + n)`` of a prompt of ``P``
tokens yields the logprobs of tokens ``start + 1 .. min(start + n, P - 1)``. Entries are written by target
position, so chunked prefill accumulates across chunks and a prefill recomputed after a preemption rewrites
the same values. Entry 0 is always ``None`` (vLLM's convention: the first token has no context).

**Prefix cache.** A token whose K/V comes from the prefix cache has no forward, so no logits. A request that
asks for the logprobs of tokens from position ``s`` on (``prompt_logprobs_start`` of ``add_request``; 1 for
``SamplingParams(prompt_logprobs=k)``, the continuation's first token for scoring) only takes prefix-cache hits
on its first ``s - 1`` tokens (:meth:`PromptLogprobsAddOn.lookup_tokens`): every token whose logprob it needs is computed.
So a plain ``prompt_logprobs`` request never *reads* the prefix cache (it still fills it for others), while a
scoring request reuses a shared context and computes only its continuation.

The feature enters the engine as a request add-on (:class:`PromptLogprobsAddOn`, which every group kind
carries): it plans each chunk's rows, limits prefix reuse, asks for synchronous steps (not planned before
the previous step's output is applied), and writes ``RequestOutput.prompt_logprobs``.

Logprobs are the ``log_softmax`` of the raw float32 logits, like ``SamplingParams.logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from batchgen.engine.sched.request_group import AddOn

if TYPE_CHECKING:
    from batchgen.engine.core.outputs import RequestOutput
    from batchgen.engine.sched.output import GroupStep, ScheduledSeq, SchedulerOutput
    from batchgen.engine.sched.sequence import Request, Sequence
    from batchgen.sampling_params import SamplingParams


@dataclass(eq=False)
class PromptLogprobsAddOn(AddOn):
    """A request's prompt logprobs: ``top_k`` per position (``SamplingParams.prompt_logprobs``; None when only
    scoring asks), wanted from position ``start`` on (None: from 1), and the entries computed so far (one per
    prompt token, entry 0 None)."""

    top_k: int | None = None
    start: int | None = None
    entries: list[dict[int, float] | None] | None = None

    @classmethod
    def wanted(cls, params: SamplingParams, start: int | None) -> list[AddOn]:
        """The add-on a request with these params (and scoring ``start``) needs: none when it asks for none."""
        if params.prompt_logprobs is None and start is None:
            return []
        return [cls(params.prompt_logprobs, start)]

    @property
    def first(self) -> int:
        """The first prompt position whose logprob is wanted."""
        return 1 if self.start is None else max(1, self.start)

    def lookup_tokens(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Only up to, not including, the first position whose logits it needs."""
        first_needed = max(0, self.first - 1)  # the position whose logits predict the first wanted token
        # KVCacheManager matches full blocks of token_ids, never the last token's: at most first_needed tokens.
        return tokens[: first_needed + 1]

    def overlappable(self) -> bool:
        return False

    def plan_chunk(self, sched: ScheduledSeq, offset: int, out: SchedulerOutput, step: GroupStep) -> None:
        job = plan_chunk(self, sched, offset, out)
        if job is not None:
            step.claim(PromptRows, job)

    def finish(self, request: Request, output: RequestOutput) -> None:
        if self.entries is None and self.top_k is None:
            return
        output.prompt_logprobs = self.entries or [None] * len(request.prompt_token_ids)


@dataclass
class PromptLogprobs:
    """The runner's result for :class:`PromptRows`: the target's logprob per row and the top-k per row."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]


@dataclass
class PromptRows:
    """Prompt logprobs of one step (a :class:`~batchgen.engine.worker.step_input.HiddenRead`): packed-token
    ``index[i]`` predicts prompt token ``targets[i]``; ``top_k`` entries (besides the target) are kept per row."""

    index: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    top_k: int = 0

    def compute(self, model: Any, hidden: Tensor) -> PromptLogprobs:
        return compute(model, hidden, self)

    def follow(self, model: Any, hidden: Tensor) -> None:
        """A tensor-parallel worker's share: the logits collectives rank 0's :meth:`compute` runs."""
        model.compute_logits(hidden[torch.tensor(self.index, dtype=torch.long, device=hidden.device)])

    @staticmethod
    def fill(jobs: list[PromptJob], result: PromptLogprobs) -> None:
        fill(jobs, result)


@dataclass
class PromptJob:
    """One prefill chunk's share of a step's prompt logprobs: rows ``base ..`` of the step's
    :class:`PromptRows` are the prompt positions ``first ..`` of the request whose add-on is ``state``."""

    state: PromptLogprobsAddOn
    prompt_token_ids: list[int]
    first: int
    num_targets: int
    base: int
    top_k: int


def plan_chunk(
    state: PromptLogprobsAddOn, sched: ScheduledSeq, offset: int, out: SchedulerOutput
) -> PromptJob | None:
    """The prompt-logprob job of one scheduled chunk (its first token at packed row ``offset``), its rows
    declared on the step ``out``; None when the chunk needs none (a decode, or a chunk before the wanted
    tokens)."""
    request = sched.seq.request
    num_prompt = len(request.prompt_token_ids)
    lo = max(sched.start, state.first - 1)
    hi = min(sched.start + sched.num_tokens, num_prompt - 1)  # positions lo .. hi-1 predict lo+1 .. hi
    if lo >= hi:
        return None
    k = state.top_k or 0
    k = max(k, 1) if state.start is not None else k  # scoring: the argmax too
    targets = request.prompt_token_ids[lo + 1 : hi + 1]
    rows = out.read(PromptRows)
    base = len(rows.index)
    rows.index.extend(range(offset + lo - sched.start, offset + hi - sched.start))
    rows.targets.extend(targets)
    rows.top_k = max(rows.top_k, k)
    return PromptJob(state, request.prompt_token_ids, lo + 1, hi - lo, base, k)


def compute(model, hidden: Tensor, rows: PromptRows) -> PromptLogprobs:
    """After a forward: the logprob of each row's target and the top-k, from ``hidden`` (the packed
    ``[num_batched_tokens, H]`` output). One logits matmul, log-softmax and top-k for all the rows."""
    h = hidden[torch.tensor(rows.index, dtype=torch.long, device=hidden.device)]
    logp = torch.log_softmax(model.compute_logits(h).float(), dim=-1)
    tgt = torch.tensor(rows.targets, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, tgt[:, None]).squeeze(1).tolist()
    k = min(rows.top_k, logp.shape[1])
    if k == 0:
        return PromptLogprobs(chosen, [], [])
    tv, ti = logp.topk(k, dim=-1)
    return PromptLogprobs(chosen, ti.tolist(), tv.tolist())


def fill(jobs: list[PromptJob], result: PromptLogprobs) -> None:
    """Write each job's logprobs (and top-k) from the runner's ``result`` into its request's add-on, by
    position (so chunks accumulate and a recomputed prefill rewrites the same values)."""
    for job in jobs:
        state, k, prompt = job.state, job.top_k, job.prompt_token_ids
        if state.entries is None:
            state.entries = [None] * len(prompt)
        dest = state.entries
        targets = prompt[job.first : job.first + job.num_targets]
        for j, t in enumerate(targets):
            r = job.base + j
            d: dict[int, float] = dict(zip(result.top_ids[r][:k], result.top_values[r][:k])) if k else {}
            d[t] = result.chosen[r]
            dest[job.first + j] = d
