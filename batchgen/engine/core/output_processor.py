"""Output processing: a step's sampled tokens become finished requests.

After the scheduler has put each sampled token in place (:meth:`Scheduler.place_tokens`), the
:class:`OutputProcessor` records its logprobs, applies the stop rules (:class:`~batchgen.engine.sched.stop.StopRules`,
the one implementation: stop ids, eos, stop strings through the incremental detokenizer, length) and names
the sequences that finish, with their finish reason; the scheduler then frees them
(:meth:`Scheduler.finish`). When every sample of a request has finished, :meth:`request_output` decodes the
texts (once) and builds the :class:`~batchgen.engine.core.outputs.RequestOutput`: samples by index, or the best
beams of a beam search, best first.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from torch import Tensor

from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
from batchgen.engine.features.structured import StructuredOutputs
from batchgen.engine.sched.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.sched.sequence import Request, Sequence
from batchgen.engine.sched.stop import StopRules

Placed = tuple[Sequence, int, int]
"""A sampled token put in place: (sequence, token id, row of the step's sampled tokens)."""


class OutputProcessor:
    """Stop rules, logprobs and detokenisation for one engine. ``structured`` returns the engine's
    structured-output state (None while no constrained request was seen)."""

    def __init__(
        self,
        stop: StopRules,
        tokenizer: Any = None,
        structured: Callable[[], StructuredOutputs | None] = lambda: None,
    ) -> None:
        self.stop = stop
        self.tokenizer = tokenizer
        self._structured = structured

    def update(
        self,
        scheduler: Scheduler,
        out: SchedulerOutput,
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
        beam_logprobs: Tensor | None = None,
        pooled: Seq[Sequence] = (),
    ) -> list[Request]:
        """Apply one step's sampled tokens: put in place by the scheduler, stop rules here, stopped sequences
        freed and beam steps taken by the scheduler. ``pooled``: pooling sequences whose prompt the step
        completed, finished here too (``finish_reason="stop"``, no token). Returns the requests whose every
        sample finished."""
        placed = scheduler.place_tokens(out, token_ids)
        stopped = self.process(placed, logprobs)
        for seq in pooled:
            seq.finish_reason = "stop"
            stopped.append(seq)
        return scheduler.finish(out, stopped, beam_logprobs)

    def process(self, placed: list[Placed], logprobs: list[dict[int, float] | None]) -> list[Sequence]:
        """Record each placed token's logprobs and apply the stop rules; returns the sequences that finished
        (``finish_reason`` and ``stop_reason`` set), in row order."""
        check = self.stop.check
        finished: list[Sequence] = []
        for seq, token, row in placed:
            lp = logprobs[row]
            if seq.logprobs is not None and lp is not None:
                seq.logprobs.append(lp)
            reason = check(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                finished.append(seq)
        return finished

    def request_output(self, request: Request) -> RequestOutput:
        """The output of a request whose every sample finished (texts decoded here, once)."""
        outputs = self._beam_outputs(request) if request.beam is not None else self._sample_outputs(request)
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            outputs,
            request.num_cached_tokens,
            None,
            request.prompt,
            _prompt_logprobs(request),
        )

    def _sample_outputs(self, request: Request) -> list[CompletionOutput]:
        """One output per sample, by sample index."""
        structured = self._structured()
        outputs = []
        for s in sorted(request.seqs, key=lambda s: s.sample_index):
            if not isinstance(s.stop_reason, str):  # a stop string already cut the text
                s.text = self.tokenizer.decode(
                    s.output_token_ids, skip_special_tokens=s.params.skip_special_tokens
                )
            outputs.append(
                CompletionOutput(
                    s.sample_index,
                    s.text,
                    s.output_token_ids,
                    s.finish_reason or "length",
                    s.logprobs,
                    s.stop_reason,
                    constraint_satisfied=structured.satisfied(s) if structured is not None else None,
                )
            )
        return outputs

    def _beam_outputs(self, request: Request) -> list[CompletionOutput]:
        """The ``n`` best finished beams of a beam-search request, best first."""
        assert request.beam is not None
        skip = request.params.skip_special_tokens
        return [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.token_ids, skip_special_tokens=skip),
                token_ids=h.token_ids,
                finish_reason=h.finish_reason,
                stop_reason=h.stop_reason,
                cumulative_logprob=h.cumulative_logprob,
            )
            for i, h in enumerate(request.beam.results())
        ]


def error_output(request: Request, error: str) -> RequestOutput:
    """The output of a request that cannot be served: every sample ``finish_reason="error"``."""
    outputs = [
        CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
        for i in range(request.params.n)
    ]
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, 0, error, request.prompt)


def _prompt_logprobs(request: Request) -> list[dict[int, float] | None] | None:
    if request.prompt_logprobs is None and request.params.prompt_logprobs is None:
        return None
    return request.prompt_logprobs or [None] * len(request.prompt_token_ids)
