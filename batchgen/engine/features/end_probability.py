"""End probabilities: for each token a request's sequences sample, the probability, under the distribution the
token was drawn from (banned tokens, penalties and filters applied), that the draw was one of the tokens that
end the sequence (eos unless ``ignore_eos``, the stop token ids).

Whoever estimates how long outputs run (the dry run's calibration) can sum these chances where it would count
the ends it saw: the same expectation without the noise of the draw. A position's chance is the expected
number of ends there given everything before it, so a sum of chances is an unbiased estimate of the ends over
the same positions, with a variance from the differences between positions and rows alone. For a greedy
sequence the chance is the end itself, 1 or 0. A stop string is not a token: the caller may watch the tokens
that hold it whole (a one-character string: every token whose text contains it ends the sequence when drawn)
and name it in ``covered``; the ends of other stop strings are counted as seen.

The feature enters as a request add-on (:class:`EndProbability`): each of its sequences' draws is watched
(:meth:`SchedulerOutput.watch_tokens`) and what comes back (``RunnerOutput.watched``) is recorded by sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchgen.engine.sched.request_group import AddOn
from batchgen.engine.worker.sampler import WatchedTokens

if TYPE_CHECKING:
    from batchgen.engine.sched.output import SchedulerOutput
    from batchgen.engine.sched.sequence import Sequence
    from batchgen.engine.worker.step_input import RunnerOutput


@dataclass(eq=False)
class EndProbability(AddOn):
    """Watches the draws of one request's sequences for ``tokens`` (requests with the same ends may share one
    :class:`WatchedTokens`: the sampler then sums their chances in one gather).

    Invariant: ``chances[k][t]`` is the probability that sample ``k``'s output token ``t`` (from 0) ended it by
    token, one entry per token put in place, in order (NaN where the step returned none)."""

    tokens: WatchedTokens
    covered: tuple[str, ...] = ()
    """Stop strings whose ends the watched tokens stand for (their chances are in the watched probability)."""
    chances: dict[int, list[float]] = field(default_factory=dict)

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        return self.tokens.ids

    def plan_sample(self, seq: Sequence, index: int, out: SchedulerOutput) -> None:
        if self.tokens:
            out.watch_tokens(index, self.tokens)

    def sampled(self, seq: Sequence, index: int, output: RunnerOutput) -> None:
        p = output.watched.get(index) if self.tokens else 0.0
        self.chances.setdefault(seq.sample_index, []).append(math.nan if p is None else float(p))

    def of(self, sample_index: int, num_tokens: int, stop_string: str | None) -> list[float] | None:
        """Sample ``sample_index``'s chance of ending at each of its ``num_tokens`` output positions; the end by
        ``stop_string`` (the stop string that ended it, if one did), when it is not ``covered``, added at the
        last as seen. None when a position has no chance recorded."""
        c = self.chances.get(sample_index, [])
        if len(c) != num_tokens or any(math.isnan(x) for x in c):
            return None
        c = list(c)
        if stop_string is not None and stop_string not in self.covered and c:
            c[-1] += 1.0
        return c
