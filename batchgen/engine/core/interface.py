"""The engine as the job layer sees it: a typed interface, so the job, the feeder, the report and the
benchmarks depend on these members only (and tests may pass any object that has them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.core.stats import EngineStats
from batchgen.lora_request import LoRARequest
from batchgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepInfo:
    """What a step listener is told after every engine step (the stats object is live: copy what you keep)."""

    stats: EngineStats
    finished: list[RequestOutput]
    num_scheduled_seqs: int
    num_batched_tokens: int
    step_time_s: float


StepListener = Callable[[StepInfo], None]


@runtime_checkable
class Engine(Protocol):
    """What :class:`~batchgen.engine.core.llm_engine.LLMEngine` offers its callers.

    ``step`` returns the requests that finished in it; a request that cannot be served finishes with
    ``error`` set instead of raising. ``stats`` are running totals since the engine started (take
    ``stats.snapshot()`` before and ``stats.delta(before)`` after to measure a piece of work).
    """

    tokenizer: Any
    max_model_len: int
    stats: EngineStats

    def add_request(
        self,
        request_id: str | int,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt_logprobs_start: int | None = None,
        pooling: Any = None,
        lora_request: LoRARequest | None = None,
        addons: Sequence[Any] = (),
    ) -> None:
        """Queue a request: ``prompt_logprobs_start`` (score the prompt from there), ``pooling`` (a
        prefill-only pooling request and its state), ``lora_request`` (its adapter; None: the base model),
        ``addons`` (request add-ons: what the caller asks of its steps besides)."""
        ...

    def abort_request(self, request_id: str | int) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def num_unfinished(self) -> int: ...

    def add_step_listener(self, listener: StepListener) -> None: ...
