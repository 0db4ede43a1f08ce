"""Prompt logprobs: the log-probability of every prompt token (and the top-k at each position), computed in
the prefill from the logits of *all* positions of a prefill chunk, not only the last one.

Position ``i``'s logits predict token ``i + 1``; so the chunk ``[start, start + n)`` of a prompt of ``P``
tokens yields the logprobs of tokens ``start + 1 .. min(start + n, P - 1)``. Entries are written by target
position, so chunked prefill accumulates across chunks and a prefill recomputed after a preemption rewrites
the same values. Entry 0 is always ``None`` (vLLM's convention: the first token has no context).

**Prefix cache.** A token whose K/V comes from the prefix cache has no forward, so no logits. A request that
asks for the logprobs of tokens from position ``s`` on (``Request.prompt_logprobs_start``; 1 for
``SamplingParams(prompt_logprobs=k)``, the continuation's first token for scoring) only takes prefix-cache hits
on its first ``s - 1`` tokens (:func:`cache_lookup_tokens`): every token whose logprob it needs is computed.
So a plain ``prompt_logprobs`` request never *reads* the prefix cache (it still fills it for others), while a
scoring request reuses a shared context and computes only its continuation.

Logprobs are the ``log_softmax`` of the raw float32 logits, like ``SamplingParams.logprobs``.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from batchgen.engine import pooling
from batchgen.engine.sequence import Request, Sequence


def wants_prompt_logprobs(request: Request) -> bool:
    return request.params.prompt_logprobs is not None or request.prompt_logprobs_start is not None


def cache_lookup_tokens(seq: Sequence) -> list[int]:
    """The tokens whose cached prefix ``seq`` may reuse at admission (all of them unless it needs logprobs of
    prompt tokens: then only up to, not including, the first position whose logits it needs)."""
    request = seq.request
    if not wants_prompt_logprobs(request):
        return pooling.cache_lookup_tokens(seq, seq.token_ids)
    first_needed = max(0, _start(request) - 1)  # the position whose logits predict the first wanted token
    # KVCacheManager matches full blocks of token_ids, never the last token's: at most first_needed tokens.
    return seq.token_ids[: first_needed + 1]


def _start(request: Request) -> int:
    s = request.prompt_logprobs_start
    return 1 if s is None else max(1, s)


def rows(out) -> list[int]:
    """The rows of the step's packed hidden states whose logits :func:`collect` computes (tensor-parallel
    workers compute their shards of the same rows, in the same step)."""
    return _plan(out)[1]


def collect(model, hidden: Tensor, out) -> None:
    """After a forward: fill ``request.prompt_logprobs`` for the prefill chunks of ``out`` that need them.
    ``hidden`` is the packed ``[num_batched_tokens, H]`` output of the model for ``out.seqs``. One logits
    matmul, log-softmax and top-k for all the rows of the step."""
    jobs, index, max_k = _plan(out)
    if not jobs:
        return
    rows = hidden[torch.tensor(index, dtype=torch.long, device=hidden.device)]
    logp = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
    _fill(jobs, logp, max_k)


def _plan(out) -> tuple[list, list[int], int]:
    """(jobs: (request, first target position, targets, row offset in the gathered rows), the rows of the
    packed batch whose logits are needed, the largest top-k asked)."""
    offsets = itertools.accumulate((s.num_tokens for s in out.seqs), initial=0)
    jobs = []  # (request, first target position, targets, row offset in the gathered rows)
    index: list[int] = []
    max_k = 0
    for sched, off in zip(out.seqs, offsets):
        request = sched.seq.request
        if not wants_prompt_logprobs(request):
            continue
        num_prompt = len(request.prompt_token_ids)
        lo = max(sched.start, _start(request) - 1)
        hi = min(sched.start + sched.num_tokens, num_prompt - 1)  # positions lo .. hi-1 predict lo+1 .. hi
        if lo >= hi:
            continue  # a decode, or a chunk before the wanted tokens
        jobs.append((request, lo + 1, request.prompt_token_ids[lo + 1 : hi + 1], len(index)))
        index.extend(range(off + lo - sched.start, off + hi - sched.start))
        k = request.params.prompt_logprobs or 0
        max_k = max(max_k, max(k, 1) if request.prompt_logprobs_start is not None else k)  # scoring: argmax
    return jobs, index, max_k


def _fill(jobs: list, logp: Tensor, max_k: int) -> None:
    """Write each job's logprobs (and top-k) from ``logp`` [rows, V] into its request."""
    targets = [t for _, _, tg, _ in jobs for t in tg]
    tgt = torch.tensor(targets, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, tgt[:, None]).squeeze(1).tolist()
    max_k = min(max_k, logp.shape[1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_k > 0:
        tv, ti = logp.topk(max_k, dim=-1)
        top_vals, top_ids = tv.tolist(), ti.tolist()
    for request, first, tg, base in jobs:
        k = request.params.prompt_logprobs or 0
        k = max(k, 1) if request.prompt_logprobs_start is not None else k
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
        dest = request.prompt_logprobs
        for j, t in enumerate(tg):
            r = base + j
            d: dict[int, float] = dict(zip(top_ids[r][:k], top_vals[r][:k])) if k else {}
            d[t] = chosen[r]
            dest[first + j] = d
