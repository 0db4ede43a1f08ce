"""Async ("overlapped") scheduling: the engine's Python for step N+1 runs while step N's forward does.

With ``engine.async_scheduling=true`` the engine is an :class:`AsyncLLMEngine` over an
:class:`~batchgen.engine.sched.async_scheduler.AsyncScheduler`, and one :meth:`AsyncLLMEngine.step` goes:

1. step N's forward and sampling are in flight (launched by the previous call: the
   :class:`ThreadedExecutor`'s thread runs them; on CUDA the kernels are queued anyway);
2. meanwhile the scheduler plans step N+1 as if every sequence sampled in N had its token
   (:meth:`AsyncScheduler.mark_launched` appended a placeholder, whose slot is allocated but whose block is not
   hashed into the prefix cache until the token is known), and the step builder builds N+1's forward; the
   input id of each placeholder is noted as ``(flat index, row of N's samples)``;
3. N's sampled tokens come back (the only wait); :meth:`Scheduler.update` puts them in place of the
   placeholders (:meth:`AsyncScheduler.place`), applies the stop rules and finishes sequences;
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
before scheduling — no live request whose group kind needs synchronous steps
(:meth:`RequestGroup.overlappable`), nothing swapped out, and at least one free KV block per running sequence
(so the step cannot preempt). Otherwise the pipeline drains: N completes, and the next step is scheduled and
run synchronously (``EngineStats.drained_steps``). With tensor parallelism the worker thread broadcasts each launched input to the other ranks. ``n > 1`` requests run
overlapped: their samples are forked in the step that completes the prompt, from a sequence that has no
placeholder. A block completed by a placeholder is registered in the prefix cache only once its token is known
(at the update, or the sequence's next scheduling), so a prompt admitted in between cannot hit it yet; with
blocks of finished sequences freed a step later, admissions may come a step later too. So a request's
``num_cached_tokens`` (and when it was admitted) may differ from synchronous stepping; its tokens do not.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.sched.async_scheduler import AsyncScheduler, AsyncSchedulerOutput
from batchgen.engine.sched.request_group import RequestGroup
from batchgen.engine.sched.sequence import Request
from batchgen.engine.worker.executor import Executor, Runner
from batchgen.engine.worker.step_input import ForwardInput, RunnerOutput, StepInput
from batchgen.runtime.threads import ThreadMonitor


class ThreadedExecutor(Executor):
    """Runs step inputs in one background thread (torch releases the GIL inside its ops, so the engine's
    scheduling overlaps them): :meth:`submit` returns at once with the step's future output."""

    def __init__(self, runner: Runner, threads: ThreadMonitor | None = None) -> None:
        super().__init__(runner, threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batchgen-step")
        # graphs are captured in the step thread while the main thread prepares the next step
        runner.capture_error_mode = "thread_local"  # type: ignore[attr-defined]

    def submit(self, step: StepInput) -> Future[RunnerOutput]:
        return self._pool.submit(self.execute, step)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class InFlight:
    """A launched step: its schedule and its future output."""

    out: AsyncSchedulerOutput
    result: Future[RunnerOutput]


@dataclass
class Prepared:
    """A step planned while the previous one is in flight: its forward, and where its placeholders are:
    flat input index ``dst[i]`` takes the previous step's sampled token of row ``src[i]``."""

    out: AsyncSchedulerOutput
    forward: ForwardInput | None
    dst: list[int]
    src: list[int]


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


class AsyncLLMEngine(LLMEngine):
    """The engine with async scheduling: ``step`` still completes one step per call, but may return with the
    next one in flight (``has_unfinished`` is true until it is collected)."""

    scheduler_class = AsyncScheduler
    executor_class = ThreadedExecutor
    scheduler: AsyncScheduler
    executor: ThreadedExecutor

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._flights: deque[InFlight] = deque()  # launched steps not yet updated, oldest first
        self._sync_ids: set[str | int] = set()  # live requests whose kind needs synchronous steps

    def _queue(self, request: Request, group: RequestGroup) -> None:
        super()._queue(request, group)
        if not group.overlappable():
            self._sync_ids.add(request.request_id)

    def _forget(self, request: Request) -> None:
        super()._forget(request)
        self._sync_ids.discard(request.request_id)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._flights)

    def step(self) -> list[RequestOutput]:
        """Collect step N (launching it first when none is in flight), planning N+1 while N runs."""
        t0 = time.perf_counter()
        finished, self._errors = self._errors, []
        flight = self._flights.popleft() if self._flights else self._launch(self.scheduler.schedule())
        if flight is not None:
            ahead = self._plan_ahead(flight)
            output = flight.result.result()
            finished += self._update(flight.out, output)
            self._launch_ahead(ahead, output)
        elif self.scheduler.has_unfinished() and not finished:
            raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
        self._notify(finished, flight.out if flight is not None else None, t0)
        return finished

    def _launch(
        self, out: AsyncSchedulerOutput, prepared: Prepared | None = None, fill=None
    ) -> InFlight | None:
        """Build the step's input (its forward from ``prepared`` when planned ahead) and submit it; a step
        that may run pipelined advances its sequences with placeholders (:meth:`AsyncScheduler.mark_launched`).
        None when the step does nothing."""
        if not out and not (out.swap_out or out.swap_in):
            return None
        if prepared is None and out:
            self.counters.drained_steps += 1
        step = self._step_input(out, prepared.forward if prepared is not None else None, fill)
        flight = InFlight(out, self.executor.submit(step))
        if out and (prepared is not None or self._may_launch(out)):
            self.scheduler.mark_launched(out)
        return flight

    def _may_launch(self, out: AsyncSchedulerOutput) -> bool:
        """Whether a freshly scheduled step may run pipelined."""
        return not (self._sync_ids or out.swap_out or out.swap_in)

    def _plan_ahead(self, flight: InFlight) -> Prepared | None:
        """Schedule and prepare the next step while ``flight`` runs, when nothing needs its results first: it
        was launched pipelined, no request needs synchronous steps, and the step cannot preempt."""
        if not flight.out.launched or self._sync_ids or not self.scheduler.can_plan_ahead():
            return None
        nxt = self.scheduler.schedule(ahead=True)
        if not nxt:
            return None
        dst, src = self.scheduler.placeholder_rows(nxt)
        return Prepared(nxt, self.builder.prepare_inputs(nxt), dst, src)

    def _launch_ahead(self, prepared: Prepared | None, output: RunnerOutput) -> None:
        """Launch the step planned ahead, its placeholders taking ``output``'s sampled tokens (or drop it
        when every sequence in it finished meanwhile, e.g. the batch's last requests)."""
        if prepared is None:
            return
        if all(s.seq.is_finished for s in prepared.out.seqs):
            self.scheduler.cancel(prepared.out)
            return
        self.counters.async_steps += 1
        flight = self._launch(prepared.out, prepared, fill_tensors(prepared, output.sampled))
        assert flight is not None
        self._flights.append(flight)
