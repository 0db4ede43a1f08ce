"""Pooling requests inside the paged engine: they get no logit row and sample nothing; the step that completes
a pooling request's prompt finishes it from its pooled hidden state, and generation rows in the same steps
are unaffected."""

from __future__ import annotations

import pytest
import torch
import transformers
from engine_helpers import pad_decodes_on_cpu

from batchgen import SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.features.pooling import PoolingState, PoolRows

GEN = [[1, 5, 9, 33, 7], list(range(10, 40)), [4, 4, 4, 100, 200]]
# the 110-token CLS prompt is prefilled in chunks (22 + 29 + 29 + 29 tokens beside the decodes, 32-token
# budget) and ends with a one-token chunk in a step of two decodes: a decode-only step of 3 rows
POOL = [[3, 8, 21, 5, 6, 7], list(range(50, 75)), list(range(100, 210))]
METHODS = ["last", "mean", "cls"]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _engine(path: str, **kw) -> LLMEngine:
    cfg = EngineConfig(device="cpu", num_blocks=64, block_size=8, max_num_batched_tokens=32, **kw)
    return LLMEngine(path, cfg)


def _record_steps(engine: LLMEngine) -> list:
    """Every (StepInput, RunnerOutput) the engine's runner executes."""
    seen: list = []
    execute = engine.runner.execute

    def recording(step):
        out = execute(step)
        seen.append((step, out))
        return out

    engine.runner.execute = recording
    return seen


def _run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
    return done


@pytest.mark.parametrize("padded", [False, True])
def test_pooling_rows_get_no_logits_and_leave_generation_unchanged(
    llama_ckpt: str, padded, monkeypatch
) -> None:
    """``padded``: decode-only steps padded to a bucket (the CUDA-graph path's layout, here on the CPU), with
    a pooling chunk of one token among them."""
    pad_decodes_on_cpu(monkeypatch, padded)
    alone = _engine(llama_ckpt)
    for i, p in enumerate(GEN):
        alone.add_request(f"g{i}", p, GREEDY)
    want = {k: o.outputs[0].token_ids for k, o in _run(alone).items()}

    engine = _engine(llama_ckpt)
    steps = _record_steps(engine)
    states = {}
    for i, (g, p) in enumerate(zip(GEN, POOL)):
        engine.add_request(f"g{i}", g, GREEDY)
        states[f"p{i}"] = PoolingState(METHODS[i])
        engine.add_request(f"p{i}", p, pooling=states[f"p{i}"])
    done = _run(engine)
    assert {k: o.outputs[0].token_ids for k, o in done.items() if k.startswith("g")} == want
    for k in states:  # pooling requests finish with no token
        assert done[k].error is None and done[k].outputs[0].token_ids == []
    assert engine.stats.generated_tokens == sum(len(t) for t in want.values())
    # every step's logit rows are exactly its sampled generation rows
    decode_only_with_pooling = False
    for step, out in steps:
        if step.forward is not None:
            assert step.forward.last.numel() == step.sampling.num_rows == len(out.token_ids)
            fwd = step.forward
            if fwd.meta.num_decode_seqs == fwd.num_seqs and fwd.last.numel() < fwd.num_seqs:
                decode_only_with_pooling = True
    assert decode_only_with_pooling
    # the vectors are transformers' final hidden states
    ref = transformers.AutoModel.from_pretrained(llama_ckpt).eval()
    for i, p in enumerate(POOL):
        with torch.no_grad():
            h = ref(input_ids=torch.tensor([p])).last_hidden_state[0]
        want_vec = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[METHODS[i]]
        torch.testing.assert_close(states[f"p{i}"].vector, want_vec, atol=1e-4, rtol=1e-4)


def test_a_pooling_only_step_has_zero_logit_rows(llama_ckpt: str) -> None:
    engine = _engine(llama_ckpt, max_model_len=16)
    steps = _record_steps(engine)
    state = PoolingState("last")
    # a pooling prompt may fill the whole context: no token is generated after it
    engine.add_request("p", list(range(3, 19)), pooling=state)
    done = _run(engine)
    assert done["p"].error is None and state.vector is not None
    forwards = [(s, o) for s, o in steps if s.forward is not None]
    assert forwards
    for step, out in forwards:
        assert step.forward.last.numel() == 0
        assert step.sampling.num_rows == 0 and step.sampling.num_score_rows == 0
        assert out.token_ids == [] and list(out.reads) == [PoolRows]
    assert engine.stats.generated_tokens == 0
