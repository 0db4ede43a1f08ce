"""What the engine hands back for each finished request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sample of a request.

    ``finish_reason`` is ``"stop"`` (eos, a stop token or a stop string), ``"length"`` (max_tokens or the
    model's max length) or ``"error"``. ``stop_reason`` is the stop token id or stop string that ended it.
    ``logprobs[i]`` maps token id → log-probability for the i-th generated token (the sampled token plus the
    top-k asked for), or ``logprobs`` is None when not requested. For beam search, ``index`` is the beam's rank
    (0 = best) and ``cumulative_logprob`` the sum of its tokens' logprobs (None otherwise).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    constraint_satisfied: bool | None = None
    """Structured outputs (json_schema / regex / choice / grammar): True when the output is a complete instance
    of the constraint, False when max_tokens, max_model_len or a stop string cut it first (then
    finish_reason is 'length' or 'stop' with a stop_reason string, and the text must not be trusted); None
    for unconstrained requests."""


@dataclass
class RequestOutput:
    """A finished request: its prompt, its ``n`` samples, and how many prompt tokens came from the cache.

    When ``error`` is set the request failed alone (e.g. its prompt cannot fit): every output has
    ``finish_reason == "error"`` and no tokens.
    """

    request_id: str | int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    prompt: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``SamplingParams(prompt_logprobs=k)``: one entry per prompt token, ``None`` for the first, else
    ``{token_id: logprob}`` of that prompt token and the top-k at its position (vLLM's form)."""
