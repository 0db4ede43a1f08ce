"""GPU idle time per engine step: CUDA events around each step's forward against the step's wall time.

:class:`ForwardEvents` wraps one engine's runner (measurement only): an event is recorded on the current
stream when ``prepare_inputs`` returns (the step's device work — block copies aside — is enqueued after it:
the forward, or its CUDA-graph replay, and the logits) and another when ``execute`` returns. ``start →
end`` elapsed time is the device time of the forward as the stream ran it; the step's wall time comes from the
engine's step listener (:attr:`StepInfo.step_time_s`). Per step, ``idle = wall - forward``: the time the
device waited on Python (scheduling, input preparation, sampling, stop checks). Events are read once, at
:meth:`summary` (one synchronize), so measuring adds no host-device sync to the steps.

The throughput benchmark installs it on batchgen's engine on CUDA (``gpu_idle`` in its results); the event
and sync functions are injectable so the bookkeeping is tested on the CPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


class ForwardEvents:
    """Per-step (wall seconds, forward event pair) of one engine, from installation on."""

    def __init__(
        self,
        engine: Any,
        event: Callable[[], Any] | None = None,
        sync: Callable[[], None] | None = None,
    ) -> None:
        if event is None or sync is None:
            import torch

            event = event or (lambda: torch.cuda.Event(enable_timing=True))
            sync = sync or torch.cuda.synchronize
        self._event, self._sync = event, sync
        self.steps: list[tuple[float, tuple[Any, Any] | None]] = []
        self._start: Any = None
        self._pair: tuple[Any, Any] | None = None
        runner, builder = engine.runner, engine.builder
        prepare, execute = builder.prepare_inputs, runner.execute

        def timed_prepare(out: Any) -> Any:
            inputs = prepare(out)
            self._start = self._record()
            return inputs

        def timed_execute(out: Any) -> Any:
            logits = execute(out)
            if self._start is not None:
                self._pair = (self._start, self._record())
                self._start = None
            return logits

        builder.prepare_inputs = timed_prepare
        runner.execute = timed_execute
        engine.add_step_listener(self._on_step)

    def _record(self) -> Any:
        ev = self._event()
        ev.record()
        return ev

    def _on_step(self, info: Any) -> None:
        self.steps.append((info.step_time_s, self._pair))
        self._pair = None

    def summary(self, run_wall_s: float | None = None) -> dict[str, Any]:
        """Medians per step of forward steps (ms) and shares: ``idle_share`` = 1 - forward / step time summed
        over forward steps; ``busy_share_of_run`` = forward time / the whole run's wall time (job pipeline
        work between steps included) when ``run_wall_s`` is given."""
        self._sync()
        walls = [w for w, p in self.steps if p is not None]
        fwd = [p[0].elapsed_time(p[1]) / 1e3 for _, p in self.steps if p is not None]
        if not fwd:
            return {"steps": len(self.steps), "forward_steps": 0}
        idle = [w - f for w, f in zip(walls, fwd)]
        out = {
            "steps": len(self.steps),
            "forward_steps": len(fwd),
            "step_ms_median": 1e3 * statistics.median(walls),
            "forward_ms_median": 1e3 * statistics.median(fwd),
            "idle_ms_median": 1e3 * statistics.median(idle),
            "idle_share": 1.0 - sum(fwd) / sum(walls),
            "forward_s_total": sum(fwd),
            "step_s_total": sum(walls),
        }
        if run_wall_s:
            out["busy_share_of_run"] = sum(fwd) / run_wall_s
        return out


def describe(s: dict[str, Any]) -> str:
    """One line for the benchmark's settings list."""
    if not s.get("forward_steps"):
        return f"GPU idle: no forward steps measured ({s.get('steps', 0)} steps)"
    text = (
        f"GPU idle per step (CUDA events around the forward vs step wall, medians over "
        f"{s['forward_steps']} steps): step {s['step_ms_median']:.2f} ms, forward {s['forward_ms_median']:.2f} "
        f"ms, idle {s['idle_ms_median']:.2f} ms ({100 * s['idle_share']:.0f}% of step time)"
    )
    if "busy_share_of_run" in s:
        text += f"; device busy {100 * s['busy_share_of_run']:.0f}% of the run's wall time"
    return text
