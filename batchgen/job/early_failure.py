"""Stopping a job that cannot succeed before it writes anything (exit 2).

While the output holds no successful row: the preflight turns the first :data:`EARLY_ROWS` rows to do into
prompts, and if every one fails (too long, a chat template that raises, a KV pool too small for them) the job
stops before the model loads (:func:`preflight`); then finished windows are held back, not committed, until a
row succeeds in the engine, and if the first :data:`EARLY_ROWS` rows the engine finishes all fail, the job stops
with an empty output (:class:`FirstSuccessGate`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from batchgen.data.prompts import PromptRow
from batchgen.errors import ConfigError
from batchgen.job.feeder import WindowWork
from batchgen.job.plan import JobPlan
from batchgen.job.tally import RowTally, error_key

EARLY_ROWS = 64
"""While the output holds no successful row: how many rows must all fail (in the preflight, or in the engine)
before the job is stopped as impossible (exit 2)."""


def preflight(works: Iterator[WindowWork], plan: JobPlan, hold: bool) -> list[WindowWork]:
    """Read windows until :data:`EARLY_ROWS` rows to do are in hand; with ``hold`` (nothing succeeded yet),
    ConfigError when every one of them fails before generation (or could never fit in a KV pool of
    ``engine.num_blocks``). Returns the windows read (they are fed first)."""
    got: list[WindowWork] = []
    rows: list[PromptRow] = []
    for work in works:
        got.append(work)
        rows += [work.rows[p] for p in work.todo_positions]
        if len(rows) >= EARLY_ROWS:
            break
    if not rows or not hold:
        return got
    failing = [msg for msg in (_failure_before_generation(r, plan) for r in rows) if msg is not None]
    if len(failing) == len(rows):
        raise ConfigError(impossible_message(len(rows), failing, "before generation"))
    return got


def _failure_before_generation(r: PromptRow, plan: JobPlan) -> str | None:
    """Why row ``r`` fails before generation: its error, or a prompt plus max_tokens that needs more KV blocks
    than ``engine.num_blocks``; None when it may succeed."""
    if r.error is not None:
        return r.error
    e = plan.cfg.engine
    if e.num_blocks is None:
        return None
    p = r.params
    longest = min(len(r.token_ids or []) + ((p.max_tokens if p else None) or plan.prompt_spec.max_model_len),
                  plan.prompt_spec.max_model_len)  # fmt: skip
    need = -(-longest // e.block_size)
    if need > e.num_blocks:
        return (
            f"prompt ({len(r.token_ids or [])} tokens) plus max_tokens needs {need} KV blocks but "
            f"engine.num_blocks={e.num_blocks}"
        )
    return None


def impossible_message(n: int, errors: list[str], when: str) -> str:
    """The one line saying that all ``n`` first rows failed ``when``, with the three commonest errors."""
    counts = collections.Counter(error_key(x) for x in errors)
    example = {}
    for x in errors:
        example.setdefault(error_key(x), x)
    top = "; ".join(f"{c} x {example[k]!r}" for k, c in counts.most_common(3))
    return (
        f"every row fails {when}: all {n} of the first rows did ({top}). The configuration makes the job "
        "impossible; fix it (engine.max_model_len, engine.num_blocks / kv_cache_memory, sampling.max_tokens, "
        "the chat template, data.prompt_column ...) and rerun — nothing was written. To write such rows as "
        "error rows anyway, set run.max_error_fraction=1"
    )


class FirstSuccessGate:
    """Finished windows go to ``commit``, except while the gate is closed (the output holds no successful row
    yet and ``run.max_error_fraction < 1``): then they are held, and committed when the first row succeeds
    (:meth:`open`). :meth:`check` stops the job (ConfigError, held windows dropped) once the first
    :data:`EARLY_ROWS` rows the engine finished — or, with ``final``, all of them — failed there."""

    def __init__(self, closed: bool, commit: Callable[[WindowWork], None], tally: RowTally) -> None:
        self.closed = closed
        self.held: list[WindowWork] = []
        self._commit = commit
        self._tally = tally

    def window_finished(self, work: WindowWork) -> None:
        if self.closed:
            self.held.append(work)
            self.check()
        else:
            self._commit(work)

    def open(self) -> None:
        """A row succeeded (or the run ends): commit what was held, and every window from now on."""
        self.closed = False
        self.release()

    def release(self) -> None:
        """Commit the windows held so far."""
        held, self.held = self.held, []
        for work in held:
            self._commit(work)

    def check(self, final: bool = False) -> None:
        t = self._tally
        if t.engine_ok == 0 and (t.engine_done >= EARLY_ROWS or (final and t.engine_done)):
            errors = t.engine_error_messages()
            self.held.clear()
            raise ConfigError(impossible_message(t.engine_done, errors, "in the engine"))
