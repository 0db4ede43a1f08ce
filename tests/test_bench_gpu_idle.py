"""The GPU idle meter's bookkeeping (batchgen.bench.gpu_idle), on the CPU with clock-based stand-in events."""

from __future__ import annotations

import time

from batchgen.bench.gpu_idle import ForwardEvents, describe
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.sampling_params import SamplingParams


class ClockEvent:
    """torch.cuda.Event's timing interface over the host clock."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: ClockEvent) -> float:
        return (end.t - self.t) * 1e3


def test_forward_events_per_step(llama_ckpt: str) -> None:
    engine = LLMEngine(llama_ckpt, EngineConfig(device="cpu", num_blocks=64))
    meter = ForwardEvents(engine, event=ClockEvent, sync=lambda: None)
    for i in range(3):
        engine.add_request(
            i, [5 + i, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        )
    t0 = time.perf_counter()
    tokens = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = o.outputs[0].token_ids
    s = meter.summary(time.perf_counter() - t0)
    assert s["steps"] == s["forward_steps"] == 5  # one prefill step, four decode steps
    assert 0 < s["forward_ms_median"] <= s["step_ms_median"]
    assert s["idle_ms_median"] >= 0 and 0 <= s["idle_share"] < 1
    assert 0 < s["busy_share_of_run"] <= 1
    assert all(len(t) == 5 for t in tokens.values())
    assert "GPU idle per step" in describe(s)
