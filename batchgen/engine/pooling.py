"""Pooling requests in the engine: a request that carries a :class:`PoolingState` runs its prompt (prefill
only: it finishes after the one step that completes its prompt, its sampled token is discarded) and the
runner pools the final hidden states of its prompt into ``state.vector`` (float32 ``[H]``, before any head or
normalisation).

- ``last``: the hidden state of the prompt's last token, taken from the chunk that completes the prompt. Only
  that token needs a forward, so the request reuses the prefix cache fully (rows sharing an instruction prefix
  compute it once).
- ``mean`` / ``cls``: every prompt token's (the first token's) hidden state is needed, so such a request never
  reads the prefix cache (:func:`cache_lookup_tokens`); ``mean`` sums over the chunks of a chunked prefill and
  restarts when a preempted request recomputes from position 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from torch import Tensor


@dataclass
class PoolingState:
    """What a pooling request asks (``method``) and what the runner has pooled so far."""

    method: str
    vector: Tensor | None = None
    _sum: Tensor | None = None
    _count: int = 0


def cache_lookup_tokens(seq, tokens: list[int]) -> list[int]:
    """The tokens a pooling sequence may match in the prefix cache (``tokens`` unchanged otherwise)."""
    state = getattr(seq.request, "pooling", None)
    if state is None or state.method == "last":
        return tokens
    return tokens[:1]  # the manager never matches a sequence's last token: no hit


def collect(hidden: Tensor, out) -> None:
    """After a forward over ``out.seqs`` (packed ``hidden [num_batched_tokens, H]``): pool the prompt chunks of
    pooling requests into their :class:`PoolingState`."""
    offsets = itertools.accumulate((s.num_tokens for s in out.seqs), initial=0)
    for sched, off in zip(out.seqs, offsets):
        state: PoolingState | None = getattr(sched.seq.request, "pooling", None)
        if state is None:
            continue
        num_prompt = len(sched.seq.request.prompt_token_ids)
        start, n = sched.start, sched.num_tokens
        end = min(start + n, num_prompt)
        if start >= num_prompt:
            continue
        rows = hidden[off : off + end - start]
        if state.method == "cls":
            if start == 0:
                state.vector = rows[0].float().clone()
        elif state.method == "mean":
            if start == 0:
                state._sum, state._count = None, 0
            part = rows.float().sum(0)
            state._sum = part if state._sum is None else state._sum + part
            state._count += end - start
            if end == num_prompt:
                state.vector = state._sum / state._count
        elif end == num_prompt:  # last
            state.vector = rows[-1].float().clone()
