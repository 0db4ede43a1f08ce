"""Stop rules: when a sequence ends after a new token, and which tokens it may not sample yet.

A sequence stops, in this order of precedence, on: a stop token id (``params.stop_token_ids``), an eos token
(unless ``ignore_eos``), a stop string found in its text, then length (``max_tokens`` generated, or the
sequence reaching ``max_model_len``). Stop tokens, eos and stop strings count only once ``min_tokens`` tokens
are generated; until then eos and stop token ids are banned from sampling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchgen.engine.sched.detokenizer import find_stop
from batchgen.engine.sched.sequence import Sequence


@dataclass(frozen=True)
class StopRules:
    """The engine-wide part of the stop rules; the per-request part is in each sequence's params."""

    eos_token_ids: frozenset[int]
    max_model_len: int

    @classmethod
    def build(cls, eos_token_ids: Iterable[int], max_model_len: int) -> StopRules:
        return cls(frozenset(eos_token_ids), max_model_len)

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
            if (params.max_tokens is not None and num_out >= params.max_tokens) or (
                seq.num_tokens >= self.max_model_len
            ):
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
        if reason is None and (
            (params.max_tokens is not None and num_out >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        return reason
