"""The one loop that drives an engine: every caller that runs requests on an
:class:`~batchgen.engine.core.interface.Engine` (``LLM.generate`` / ``score`` / ``embed``, the job's feeder and its
replicas, the Ray generator, the throughput benchmark) goes through :class:`Driver`; only the benchmarks that
time the step itself call ``engine.step()`` directly.

A *task* (generate, score, pool, a job's windows, a replica's feed) supplies requests and consumes finished
outputs (:class:`Task`). The driver does the rest, once for all of them:

- admission and back-pressure: it takes the task's next request while fewer than ``max_in_flight`` requests
  are unfinished in the engine (None: no limit), then steps the engine;
- error rows: a request the engine cannot serve (too long, a bad adapter, a bad grammar) finishes with
  ``error`` set like any other output and is handed to the task with its step's outputs; it never raises;
- LoRA, pooling and prompt logprobs: fields of :class:`EngineRequest`, passed to the engine as they are.

Invariants:
- Every request the task supplies is added to the engine exactly once; it is *in flight* until its output is
  handed to :meth:`Task.finish` (exactly once) or :meth:`Driver.abort` aborts it.
- :meth:`Driver.steps` admits before every step and ends when the engine has nothing unfinished after
  admitting; leaving it early (``break``, an exception) aborts nothing: the caller decides, with
  :meth:`Driver.abort` (:meth:`Driver.run` aborts whatever is still in flight when it is left by an exception).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from batchgen.engine.core.interface import Engine
from batchgen.engine.core.outputs import RequestOutput
from batchgen.lora_request import LoRARequest
from batchgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it (:meth:`Engine.add_request`'s arguments)."""

    request_id: str | int
    prompt: str | Sequence[int]
    params: SamplingParams | None = None
    lora_request: LoRARequest | None = None
    """The adapter to run it under (None: the base model)."""
    pooling: Any = None
    """A prefill-only pooling request: the engine's pooling state that receives its pooled hidden state."""
    prompt_logprobs_start: int | None = None
    """Compute the prompt's logprobs from this position on (scoring)."""
    images: tuple[Any, ...] = ()
    """Image-text models: the prompt's images, placeholders already expanded
    (:class:`batchgen.multimodal.inputs.ImageItem`)."""
    addons: tuple[Any, ...] = ()
    """What the caller asks of the request's steps besides (request add-ons)."""


class Task(Protocol):
    """What a driver runs: a source of requests and a consumer of their outputs."""

    def next_request(self) -> EngineRequest | None:
        """The next request to admit; None when there is none to admit now."""
        ...

    def finish(self, outputs: list[RequestOutput]) -> None:
        """Consume the outputs of the requests that finished in one step (error rows included)."""
        ...


class Driver:
    """Runs ``task`` on ``engine`` with at most ``max_in_flight`` unfinished requests (module docstring)."""

    def __init__(self, engine: Engine, task: Task, max_in_flight: int | None = None) -> None:
        self.engine = engine
        self.task = task
        self.max_in_flight = None if max_in_flight is None else max(1, int(max_in_flight))
        self.in_flight: set[str | int] = set()

    def admit(self) -> None:
        """Add the task's requests while the engine has room for them."""
        engine, limit = self.engine, self.max_in_flight
        while limit is None or engine.num_unfinished() < limit:
            request = self.task.next_request()
            if request is None:
                return
            self.in_flight.add(request.request_id)
            engine.add_request(
                request.request_id,
                request.prompt,
                request.params,
                lora_request=request.lora_request,
                pooling=request.pooling,
                prompt_logprobs_start=request.prompt_logprobs_start,
                **({"images": request.images} if request.images else {}),
                **({"addons": request.addons} if request.addons else {}),
            )

    def steps(self) -> Iterator[list[RequestOutput]]:
        """Admit, step, hand the finished outputs to the task, and yield them; until the engine has nothing
        unfinished after admitting."""
        engine = self.engine
        while True:
            self.admit()
            if not engine.has_unfinished():
                return
            finished = engine.step()
            for out in finished:
                self.in_flight.discard(out.request_id)
            self.task.finish(finished)
            yield finished

    def run(self) -> None:
        """Run the task to its end; requests still in flight when it is left by an exception are aborted."""
        try:
            for _ in self.steps():
                pass
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort every request in flight."""
        for rid in self.in_flight:
            self.engine.abort_request(rid)
        self.in_flight.clear()


class Requests:
    """A task over requests known up front: supplied in the given order, each step's finished outputs handed
    to ``on_finished``."""

    def __init__(
        self, requests: Iterable[EngineRequest], on_finished: Callable[[list[RequestOutput]], None]
    ) -> None:
        self.queue: deque[EngineRequest] = deque(requests)
        self.on_finished = on_finished

    def next_request(self) -> EngineRequest | None:
        return self.queue.popleft() if self.queue else None

    def finish(self, outputs: list[RequestOutput]) -> None:
        self.on_finished(outputs)


def run_requests(
    engine: Engine,
    requests: Iterable[EngineRequest],
    on_finished: Callable[[list[RequestOutput]], None],
    max_in_flight: int | None = None,
) -> None:
    """Run ``requests`` on ``engine`` to their end (:class:`Requests` under a :class:`Driver`)."""
    Driver(engine, Requests(requests, on_finished), max_in_flight).run()
