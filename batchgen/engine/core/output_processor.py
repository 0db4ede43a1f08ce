"""Output processing: a finished request becomes its :class:`~batchgen.engine.core.outputs.RequestOutput`.

The scheduler's update has applied the stop rules and freed every sample (:meth:`Scheduler.update`); when every
sample of a request has finished, :meth:`OutputProcessor.request_output` decodes the texts (once) and builds
the output: samples by index, or the ranked results of a kind that ranks its own (``Request.ranked``), best
first; then each of the request's add-ons completes it (:meth:`AddOn.finish`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
from batchgen.engine.sched.sequence import Request, Sequence


class OutputProcessor:
    """Request outputs for one engine. ``satisfied`` says whether a sample's output completes the constraint
    it was sampled under (None: unconstrained)."""

    def __init__(
        self, tokenizer: Any = None, satisfied: Callable[[Sequence], bool | None] = lambda seq: None
    ) -> None:
        self.tokenizer = tokenizer
        self._satisfied = satisfied

    def request_output(self, request: Request) -> RequestOutput:
        """The output of a request whose every sample finished (texts decoded here, once)."""
        outputs = (
            self._ranked_outputs(request) if request.ranked is not None else self._sample_outputs(request)
        )
        output = RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            outputs,
            request.num_cached_tokens,
            None,
            request.prompt,
        )
        for addon in request.addons:
            addon.finish(request, output)
        return output

    def _sample_outputs(self, request: Request) -> list[CompletionOutput]:
        """One output per sample, by sample index."""
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
                    constraint_satisfied=self._satisfied(s),
                )
            )
        return outputs

    def _ranked_outputs(self, request: Request) -> list[CompletionOutput]:
        """The ranked results of the request's kind, best first (``index``: the rank)."""
        assert request.ranked is not None
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
            for i, h in enumerate(request.ranked.results())
        ]


def error_output(request: Request, error: str) -> RequestOutput:
    """The output of a request that cannot be served: every sample ``finish_reason="error"``."""
    outputs = [
        CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
        for i in range(request.params.n)
    ]
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, 0, error, request.prompt)
