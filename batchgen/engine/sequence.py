"""A sequence: one sample of one request, with its tokens and how far its KV cache has been computed."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from batchgen.engine.detokenizer import IncrementalDetokenizer
    from batchgen.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request of ``n`` samples. Its first sequence is created at arrival; the other ``n - 1`` are forked
    from it once its prompt is computed (they share every prompt block)."""

    request_id: str | int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    prompt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False
    num_finished: int = 0


@dataclass(eq=False)
class Sequence:
    """Invariants: ``num_computed_tokens <= len(token_ids)``; ``token_ids[:num_prompt_tokens]`` is the prompt;
    the KV of ``token_ids[:num_computed_tokens]`` is in the cache blocks the KV cache manager holds for
    ``seq_id`` (while RUNNING)."""

    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    sample_index: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    admitted_at: int = -1  # admission counter: the most recently admitted is preempted first
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
