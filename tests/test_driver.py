"""The one engine drive loop (:mod:`batchgen.driver`), on a small fake engine: admission under
``max_in_flight``, every request once, error rows handed over like any output, LoRA passed through, in-flight
requests aborted when the task raises; and no other module of the package steps an engine itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_grouping import FakeEngine

from batchgen.driver import Driver, EngineRequest, Requests, run_requests
from batchgen.engine.core.outputs import RequestOutput
from batchgen.lora_request import LoRARequest
from batchgen.sampling_params import SamplingParams

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"


class RecordingEngine(FakeEngine):
    """The fake engine, remembering the options each request was added with; a prompt [0] fails at once."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.options: dict = {}
        self.errors: list = []

    def add_request(self, rid, prompt, params, **options) -> None:
        self.options[rid] = options
        if list(prompt) == [0]:
            self.errors.append(RequestOutput(rid, [0], [], 0, error="empty prompt"))
            return
        super().add_request(rid, prompt, params)

    def has_unfinished(self) -> bool:
        return bool(self.errors) or super().has_unfinished()

    def num_unfinished(self) -> int:
        return len(self.errors) + super().num_unfinished()

    def step(self) -> list[RequestOutput]:
        errors, self.errors = self.errors, []
        return errors + super().step()


def _requests(n: int, tokens: int = 3) -> list[EngineRequest]:
    return [EngineRequest(i, [i + 1, 2], SamplingParams(max_tokens=tokens)) for i in range(n)]


def test_every_request_runs_once_under_max_in_flight() -> None:
    engine = RecordingEngine(max_num_seqs=2)
    seen: list[RequestOutput] = []
    run_requests(engine, _requests(9), seen.extend, max_in_flight=3)
    assert sorted(o.request_id for o in seen) == list(range(9))
    assert engine.added == list(range(9))  # admitted in the task's order
    assert engine.peak_unfinished == 3


def test_error_rows_and_lora_go_through_the_driver() -> None:
    engine = RecordingEngine()
    lora = LoRARequest("a", 1, "/nowhere")
    reqs = [EngineRequest("ok", [1, 2], SamplingParams(max_tokens=1), lora_request=lora)]
    reqs.append(EngineRequest("bad", [0], SamplingParams(max_tokens=1), prompt_logprobs_start=1))
    seen: list[RequestOutput] = []
    run_requests(engine, reqs, seen.extend)
    assert {o.request_id: o.error for o in seen} == {"ok": None, "bad": "empty prompt"}
    assert engine.options["ok"] == {"lora_request": lora, "pooling": None, "prompt_logprobs_start": None}
    assert engine.options["bad"]["prompt_logprobs_start"] == 1


def test_a_failing_task_aborts_what_is_in_flight() -> None:
    engine = RecordingEngine(max_num_seqs=2)

    def fail(outputs: list[RequestOutput]) -> None:
        raise ValueError("consumer failed")

    with pytest.raises(ValueError, match="consumer failed"):
        run_requests(engine, _requests(5, tokens=1), fail, max_in_flight=4)
    assert sorted(engine.aborted) == [2, 3]  # admitted, not finished; 4 never admitted
    assert not engine.has_unfinished()


def test_leaving_steps_early_keeps_requests_for_the_next_call() -> None:
    engine = RecordingEngine(max_num_seqs=1)
    done: list[RequestOutput] = []
    driver = Driver(engine, Requests(_requests(3, tokens=2), done.extend), max_in_flight=1)
    for _ in driver.steps():
        break
    assert engine.aborted == [] and driver.in_flight == {0}
    for _ in driver.steps():
        pass
    assert [o.request_id for o in done] == [0, 1, 2] and driver.in_flight == set()


def test_only_the_driver_steps_an_engine() -> None:
    # benchmarks time the engine's own step and may call it; every product module goes through the driver
    callers = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.parts[len(PACKAGE.parts)] not in ("engine", "bench")
        and re.search(r"engine\.step\(\)", re.sub(r'""".*?"""', "", p.read_text(), flags=re.S))
    )
    assert callers == ["driver.py"]
