"""The request-group kind of each request: the one place that maps a request to the feature that runs it."""

from __future__ import annotations

from batchgen.engine.features.beam import BeamGroup, BeamSearch
from batchgen.engine.features.pooling import PoolingGroup, PoolingState
from batchgen.engine.sched.request_group import RequestGroup, SampleGroup
from batchgen.engine.sched.sequence import Request, Sequence
from batchgen.engine.sched.stop import StopRules


def make_group(
    request: Request, seq: Sequence, stop: StopRules, pooling: PoolingState | None = None
) -> RequestGroup:
    """The group of a new request's first sequence: pooling (into ``pooling``), beam search, ``n > 1``
    samples, or one sample."""
    params = request.params
    if pooling is not None:
        return PoolingGroup(request, seq, pooling)
    if params.beam_width > 1:
        return BeamGroup(request, seq, BeamSearch.build(params, len(request.prompt_token_ids), stop))
    if params.n > 1:
        return SampleGroup(request, seq)
    return RequestGroup(request, seq)
