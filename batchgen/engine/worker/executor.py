"""Executors run plain step inputs on the model runner: in process (inline), or pipelined (async scheduling).

:class:`Executor` runs each :class:`~batchgen.engine.worker.step_input.StepInput` through ``runner.execute`` and
returns a future :class:`~batchgen.engine.worker.step_input.RunnerOutput`: inline (the future is done when
``submit`` returns), or in one worker thread (``pipelined``). Tensor parallelism is the runner's business
(:class:`~batchgen.engine.worker.tensor_parallel.TPModelRunner` broadcasts each input to the other ranks first), so
it composes with both.

Async ("overlapped") scheduling: the engine's Python for step N+1 runs while step N's forward does.

With ``engine.async_scheduling=true`` one :meth:`LLMEngine.step` goes:

1. step N's forward and sampling are in flight (launched by the previous call: the pipelined
   :class:`Executor`'s thread runs them; on CUDA the kernels are queued anyway);
2. meanwhile the scheduler plans step N+1 as if every sequence sampled in N had its token
   (:meth:`Scheduler.mark_launched` appended a :data:`~batchgen.engine.sched.sequence.PLACEHOLDER`, whose slot is
   allocated but whose block is not hashed into the prefix cache until the token is known), and the runner
   builds N+1's inputs; the input id of each placeholder is noted as ``(flat index, row of N's samples)``;
3. N's sampled tokens come back (the only wait); :meth:`Scheduler.update` puts them in place of the
   placeholders, applies the stop rules and finishes sequences;
4. N+1 is launched: its sampling rows are built (they see N's tokens: penalties, ``min_tokens``), its
   placeholder inputs are written from N's sampled-token tensor on the device (no host round trip), and
   the forward and sampling start (an :class:`InFlight` in the engine's queue). The call returns N's finished
   requests.

Invariants: steps are updated in the order they were scheduled, each exactly once; a sequence finished (stop
token, eos, stop string) or aborted while a step scheduled for it is in flight keeps its blocks until that
step's forward is done, and that step's token for it is dropped; a sequence whose in-flight token is its last
by length (``max_tokens``, ``max_model_len``) is not scheduled again. So the token ids, finish reasons and
texts are those of synchronous stepping, for greedy and seeded sampling (unseeded random rows share one
generator, whose draws depend on the batch in both modes); logprobs agree to float32 rounding (a step's batch
may hold rows of just-finished sequences, or admit a request a step later, and the matmuls' summation order
varies with the batch, as it does between any two batch compositions in synchronous stepping).

On CUDA the worker thread queues the kernels and then waits for the sampled tokens (the copy to the host in
the sampler), so the main thread never blocks on the device until it needs the tokens; a CUDA graph captured
during async scheduling is captured in ``thread_local`` error mode (the main thread keeps preparing). This
path is written for the GPU but measured only on the CPU so far.

Scope: the next step is only planned ahead when nothing in the engine needs the previous step's results
before scheduling — no live beam-search, structured-output or prompt-logprobs request, nothing swapped out,
and at least one free KV block per running sequence (so the step cannot preempt). Otherwise the pipeline
drains: N completes, and the next step is scheduled and run synchronously (``EngineStats.drained_steps``).
With tensor parallelism the worker thread broadcasts each launched input to the other ranks. ``n > 1`` requests run
overlapped: their samples are forked in the step that completes the prompt, from a sequence that has no
placeholder. A block completed by a placeholder is registered in the prefix cache only once its token is known
(at the update, or the sequence's next scheduling), so a prompt admitted in between cannot hit it yet; with
blocks of finished sequences freed a step later, admissions may come a step later too. So a request's
``num_cached_tokens`` (and when it was admitted) may differ from synchronous stepping; its tokens do not.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from batchgen.engine.sched.output import SchedulerOutput
from batchgen.engine.worker.step_input import ForwardInput, RunnerOutput, StepInput
from batchgen.runtime.threads import ThreadMonitor, set_threads


class Runner(Protocol):
    def execute(self, step: StepInput) -> RunnerOutput: ...


class Executor:
    """Runs step inputs on the runner: inline, or (``pipelined``) in one background thread
    (torch releases the GIL inside its ops, so the engine's scheduling overlaps them). ``threads``: the CPU
    thread monitor; a count it re-decides is set in the thread that runs the forwards, between two steps."""

    def __init__(
        self,
        runner: Runner,
        pipelined: bool = False,
        threads: ThreadMonitor | None = None,
    ) -> None:
        self.runner = runner
        self.pipelined = pipelined
        self.threads = threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgen-step") if pipelined else None

    def submit(self, step: StepInput) -> Future[RunnerOutput]:
        if self._pool is not None:
            return self._pool.submit(self._run, step)
        future: Future[RunnerOutput] = Future()
        try:
            future.set_result(self._run(step))
        except BaseException as e:  # re-raised by result(), in the caller, like the thread's
            future.set_exception(e)
        return future

    def _run(self, step: StepInput) -> RunnerOutput:
        if self.threads is not None and (policy := self.threads.poll()) is not None:
            set_threads(policy)
        return self.runner.execute(step)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclass
class InFlight:
    """A launched step: its schedule and its future output."""

    out: SchedulerOutput
    result: Future[RunnerOutput]


@dataclass
class Prepared:
    """A step planned while the previous one is in flight: its forward, and where its placeholders are:
    flat input index ``dst[i]`` takes the previous step's sampled token of row ``src[i]``."""

    out: SchedulerOutput
    forward: ForwardInput | None
    dst: list[int]
    src: list[int]


def placeholder_rows(out: SchedulerOutput) -> tuple[list[int], list[int]]:
    """``(dst, src)`` of :class:`Prepared`: a placeholder is always a decode's one token, and decodes come
    first, one flat input per sequence, so a decode's row in ``out.seqs`` is its flat input index."""
    rows = [s.seq.pending_row for s in out.seqs[: out.num_decodes]]
    dst = [j for j, row in enumerate(rows) if row >= 0]
    return dst, [rows[j] for j in dst]


def fill_tensors(prepared: Prepared, sampled: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """``(index, tokens)`` of :attr:`StepInput.fill`: the previous step's sampled tokens gathered on their
    device."""
    if not prepared.dst:
        return None
    if sampled is None:
        raise RuntimeError("async scheduling: the previous step returned no sampled-token tensor")
    device = sampled.device
    dst = torch.tensor(prepared.dst, dtype=torch.long, device=device)
    src = torch.tensor(prepared.src, dtype=torch.long, device=device)
    return dst, sampled[src]
