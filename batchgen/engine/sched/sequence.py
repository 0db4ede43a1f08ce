"""A request and its sequences: one sequence per sample, with its tokens and how far its KV cache is computed."""

from __future__ import annotations

import enum
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchgen.engine.sched.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from batchgen.engine.sched.request_group import AddOn, RankedResults, RequestGroup
    from batchgen.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks in CPU memory
    FINISHED = "finished"


def sample_seed(seed: int, sample_index: int) -> int:
    """A stable 63-bit seed for sample ``sample_index`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(eq=False)
class Request:
    """A request of ``params.n`` samples. Its first sequence is created at arrival; the other ``n - 1`` are
    forked from it by the scheduler in the step that completes its prompt (they share every prompt block).

    A request whose kind ranks its own results (``ranked`` set by its group) reports those, best first, instead
    of one output per sequence; its sequences are then the kind's live candidates.

    ``tokenizer`` is what a new sequence of this request needs for stop strings (its detokenizer)."""

    request_id: str | int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    tokenizer: Any = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False
    num_finished: int = 0
    ranked: RankedResults | None = None
    """Set by a kind whose outputs are ranked results rather than its sequences (None: one output per
    sample)."""
    addons: list[AddOn] = field(default_factory=list)
    """What the request asks of its steps besides its kind's own work (each feature's state)."""
    adapter: Any = None
    """The weights the request runs under besides the model's (the adapter feature's key; None: the base
    model)."""
    adapter_slot: int = -1
    """The slot holding those weights while the request pins it (-1: not pinned)."""
    cache_root: bytes | None = None
    """Root of the request's prefix-cache hash chain: the key of its weights (None: the base model's), so
    the same prompt under two sets of weights shares no block."""
    plain_greedy: bool = field(init=False)
    """Greedy with no penalties, min_tokens or logprobs: sampling is a bare argmax (no per-row settings)."""
    plain_sampling: bool = field(init=False)
    """No penalties, min_tokens, logprobs or seed (greedy or not): the sampler needs only the per-row filter
    settings (:class:`~batchgen.engine.worker.sampler.SamplingBatch`), no per-row state."""
    simple_stop: bool = field(init=False)
    """No stop token ids, stop strings or min_tokens: only eos and length can stop it (the update fast path)."""

    def __post_init__(self) -> None:
        p = self.params
        self.simple_stop = not p.stop_token_ids and not p.stop and p.min_tokens == 0
        self.plain_greedy = p.greedy and not p.needs_penalties and p.logprobs is None and p.min_tokens == 0
        self.plain_sampling = self.plain_greedy or (
            not p.needs_penalties and p.logprobs is None and p.min_tokens == 0 and p.seed is None
        )

    def new_sequence(self, token_ids: list[int], sample_index: int) -> Sequence:
        """Create and register sample ``sample_index`` of this request, holding ``token_ids``."""
        params = self.params
        seq = Sequence(self, token_ids, len(self.prompt_token_ids), sample_index=sample_index)
        if params.seed is not None:
            seq.seed = sample_seed(params.seed, sample_index)
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens
            )
        if params.logprobs is not None:
            seq.logprobs = []
        self.seqs.append(seq)
        return seq

    @property
    def is_finished(self) -> bool:
        return self.num_finished >= self.params.n


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
    seed: int | None = None
    """A seeded request's per-sample seed: the sampler draws this sequence's tokens from a generator of its
    own, seeded with it (keyed by ``seq_id``)."""
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    group: RequestGroup | None = None
    """The scheduling group it belongs to (:mod:`batchgen.engine.sched.request_group`)."""

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

    def fork(self, sample_index: int) -> Sequence:
        """A new sample of the same request holding a copy of this sequence's tokens (computed as far)."""
        child = self.request.new_sequence(list(self.token_ids), sample_index)
        child.num_computed_tokens = self.num_computed_tokens
        return child
