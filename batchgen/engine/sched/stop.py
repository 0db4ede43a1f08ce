"""Stop rules, in one place: when a sequence ends after a new token, and which tokens it may not sample yet.

A sequence stops, in this order of precedence, on: a stop token id (``params.stop_token_ids``), an eos token
(unless ``ignore_eos``), a stop string found in its text, then length (:meth:`StopRules.length_limit`:
``max_tokens`` generated, or the sequence reaching ``max_model_len``). Stop tokens, eos and stop strings count
only once ``min_tokens`` tokens are generated; until then eos and stop token ids are banned from sampling.
A kind that ends its sequences itself uses the same stop tokens (:meth:`StopRules.stop_token_ids`) and length
limit; a step planned before the previous one's tokens are known asks whether a sequence's next token will be its last
by length (:meth:`StopRules.last_by_length`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchgen.engine.sched.detokenizer import find_stop
from batchgen.engine.sched.sequence import Sequence

if TYPE_CHECKING:
    from batchgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopRules:
    """The engine-wide part of the stop rules; the per-request part is in each sequence's params."""

    eos_token_ids: frozenset[int]
    max_model_len: int

    @classmethod
    def build(cls, eos_token_ids: Iterable[int], max_model_len: int) -> StopRules:
        return cls(frozenset(eos_token_ids), max_model_len)

    def length_limit(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """The longest a sequence may grow (prompt included): ``max_tokens`` generated, or ``max_model_len``."""
        if params.max_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, num_prompt_tokens + params.max_tokens)

    def stop_token_ids(self, params: SamplingParams) -> list[int]:
        """The tokens that end a sequence (once ``min_tokens`` are out): the stop ids, and eos unless
        ``ignore_eos``."""
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        return sorted(stop)

    def last_by_length(self, seq: Sequence) -> bool:
        """Whether the token sampled next for ``seq`` (not yet appended) will be its last by length."""
        return seq.num_tokens + 1 >= self.length_limit(seq.params, seq.num_prompt_tokens)

    def banned_token_ids(self, seq: Sequence) -> list[int]:
        """Tokens ``seq`` may not sample now: eos and stop ids while fewer than ``min_tokens`` are out."""
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            return []
        return sorted(self.eos_token_ids) + list(params.stop_token_ids or [])

    def check(self, seq: Sequence, token: int) -> str | None:
        """Apply the rules after ``token`` was appended to ``seq``; return the finish reason or None.

        Sets ``seq.stop_reason`` (the stop token id or stop string) and, for a stop string, ``seq.text``
        (cut at the stop string). Feeds the token to the sequence's detokenizer when it has one.
        """
        params = seq.params
        num_out = seq.num_output_tokens
        if seq.request.simple_stop:  # no stop ids, stop strings or min_tokens: eos and length only
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return "stop"
            if seq.num_tokens >= self.length_limit(params, seq.num_prompt_tokens):
                return "length"
            return None
        may_stop = num_out >= params.min_tokens
        reason: str | None = None
        if may_stop and params.stop_token_ids and token in params.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            reason, seq.stop_reason = "stop", None
        if seq.detokenizer is not None:
            new_text = seq.detokenizer.append(token)
            if reason is None and may_stop:
                hit = find_stop(
                    seq.detokenizer.text, len(new_text), params.stop, params.include_stop_str_in_output
                )
                if hit is not None:
                    seq.text, idx = hit
                    reason, seq.stop_reason = "stop", params.stop[idx]
        if reason is None and seq.num_tokens >= self.length_limit(params, seq.num_prompt_tokens):
            reason = "length"
        return reason
