"""The executor runs a plain step input on the model runner.

:class:`Executor` runs each :class:`~batchgen.engine.worker.step_input.StepInput` through ``runner.execute`` in
this process and returns the :class:`~batchgen.engine.worker.step_input.RunnerOutput`. Tensor parallelism is the
runner's business (:class:`~batchgen.engine.worker.tensor_parallel.TPModelRunner` broadcasts each input to the
other ranks first), so it composes with any executor, including one that runs steps in a worker thread.
"""

from __future__ import annotations

from typing import Protocol

from batchgen.engine.worker.step_input import RunnerOutput, StepInput
from batchgen.runtime.threads import ThreadMonitor, set_threads


class Runner(Protocol):
    def execute(self, step: StepInput) -> RunnerOutput: ...


class Executor:
    """Runs step inputs on the runner, inline. ``threads``: the CPU thread monitor; a count it re-decides is
    set in the thread that runs the forwards, between two steps."""

    def __init__(self, runner: Runner, threads: ThreadMonitor | None = None) -> None:
        self.runner = runner
        self.threads = threads

    def execute(self, step: StepInput) -> RunnerOutput:
        if self.threads is not None and (policy := self.threads.poll()) is not None:
            set_threads(policy)
        return self.runner.execute(step)

    def close(self) -> None:
        """Stop what the executor started (nothing, inline)."""
