"""Scoring: the log-likelihood of a continuation given a context (what evaluation harnesses call
``loglikelihood``), and the rolling log-likelihood of a whole text (perplexity).

Each (context, continuation) pair runs as one request over ``context + continuation`` whose prompt logprobs are
computed from the continuation's first token on (:mod:`batchgen.engine.features.prompt_logprobs`): the context may come
from the prefix cache, so many continuations of one context compute the context once. Requests are submitted
in token order (like the job's grouper) so continuations of one context run next to each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from batchgen.driver import EngineRequest, run_requests
from batchgen.engine.core.outputs import RequestOutput
from batchgen.lora_request import LoRARequest
from batchgen.sampling_params import SamplingParams


@dataclass
class Score:
    """The continuation's summed log-likelihood, its token count, whether every continuation token is the
    argmax given what precedes it (greedy), and how many context tokens came from the prefix cache."""

    loglikelihood: float
    num_tokens: int
    is_greedy: bool
    num_cached_tokens: int = 0
    token_logprobs: list[float] | None = None


def score_token_pairs(
    engine,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    use_tqdm: bool = False,
    loras: Sequence[LoRARequest | None] | None = None,
) -> list[Score]:
    """Score ``(context_ids, continuation_ids)`` pairs on ``engine`` (an :class:`LLMEngine`); input order.
    The context must have at least one token; the continuation too. ``loras``: each pair's LoRA adapter (None:
    the base model; the engine serves adapters), pairs of one adapter submitted together."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=None)
    base = engine.stats.num_requests
    loras = list(loras) if loras is not None else [None] * len(pairs)

    def key(i: int) -> tuple[int, list[int]]:
        lora = loras[i]
        return (lora.lora_int_id if lora is not None else 0), [*pairs[i][0], *pairs[i][1]]

    order = sorted(range(len(pairs)), key=key)
    requests, ids = [], {}
    for i in order:
        ctx, cont = pairs[i]
        if len(ctx) == 0 or len(cont) == 0:
            raise ValueError(f"pair {i}: context and continuation need at least one token each")
        rid = f"score-{base + i}"
        ids[rid] = i
        requests.append(
            EngineRequest(rid, [*ctx, *cont], params, lora_request=loras[i], prompt_logprobs_start=len(ctx))
        )
    results: list[Score | None] = [None] * len(pairs)

    def collect(finished: list[RequestOutput]) -> None:
        for out in finished:
            i = ids[out.request_id]
            if out.error is not None:
                raise ValueError(f"pair {i} cannot be scored: {out.error}")
            n_ctx = len(pairs[i][0])
            lps, greedy = [], True
            for tok, d in zip(out.prompt_token_ids[n_ctx:], out.prompt_logprobs[n_ctx:]):
                lps.append(d[tok])
                greedy = greedy and next(iter(d)) == tok  # the first key is the top-1 token
            results[i] = Score(math.fsum(lps), len(lps), greedy, out.num_cached_tokens, lps)
            bar.update(1)

    bar = tqdm(total=len(pairs), desc="score", disable=not use_tqdm, dynamic_ncols=True)
    try:
        run_requests(engine, requests, collect)
    finally:
        bar.close()
    return results  # type: ignore[return-value]


def split_pair(tokenizer, context: str, continuation: str, add_special_tokens: bool = True):
    """Token ids of ``(context, continuation)`` the way lm-evaluation-harness splits them: trailing spaces of
    the context move to the continuation, the pair is encoded whole, and the continuation is what follows the
    context's own encoding (so a token spanning the boundary belongs to the continuation)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=add_special_tokens)
    ctx = tokenizer.encode(context, add_special_tokens=add_special_tokens)
    return ctx, whole[len(ctx) :]


def rolling_windows(
    tokens: Sequence[int], prefix_token: int, max_seq_len: int, context_len: int = 1
) -> Iterator[tuple[list[int], list[int]]]:
    """Disjoint ``(context, continuation)`` windows covering every token of ``tokens`` exactly once, each at most
    ``max_seq_len`` tokens long; the first is conditioned on ``prefix_token`` (lm-evaluation-harness's
    ``get_rolling_token_windows`` + ``make_disjoint_window``, so rolling scores match it)."""
    tokens = list(tokens)
    if not tokens:
        return
    pred_len = max_seq_len - context_len + 1
    first = min(max_seq_len, len(tokens))
    windows = [([prefix_token, *tokens[: first - 1]], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, pred_len)
        end = predicted + n
        windows.append((tokens[max(0, end - max_seq_len - 1) : end - 1], tokens[end - n : end]))
        predicted += n
    for ctx, cont in windows:
        yield ctx[: len(ctx) - (len(cont) - 1)], cont


def rolling_loglikelihood(
    engine, texts_tokens: Sequence[Sequence[int]], prefix_token: int, max_seq_len: int, use_tqdm=False
) -> list[tuple[float, int]]:
    """``(summed log-likelihood, number of tokens)`` of each token list, every token scored (the first given
    ``prefix_token``), over windows of at most ``max_seq_len`` tokens."""
    pairs: list[tuple[list[int], list[int]]] = []
    owner: list[int] = []
    for i, toks in enumerate(texts_tokens):
        for ctx, cont in rolling_windows(toks, prefix_token, max_seq_len):
            pairs.append((ctx, cont))
            owner.append(i)
    scores = score_token_pairs(engine, pairs, use_tqdm)
    totals = [[0.0, 0] for _ in texts_tokens]
    for i, s in zip(owner, scores):
        totals[i][0] += s.loglikelihood
        totals[i][1] += s.num_tokens
    return [(float(a), int(b)) for a, b in totals]
