"""LoRA with async scheduling and structured outputs: a pipelined engine (the next step planned while the current
forward runs) gives PEFT's greedy tokens for a batch mixing adapters and base rows, and never rewrites an adapter
slot under a forward in flight; constrained decoding (choice, regex, JSON schema) under an adapter picks
the tokens PEFT's masked greedy decoding picks."""

from __future__ import annotations

import threading

import pytest
import torch
from lora_helpers import NEW, _peft_model, peft_greedy, two_adapters
from test_lora_engine import GREEDY, PROMPTS, expected, llm

from batchgen import LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def adapters(llama_ckpt):
    a, b = two_adapters(llama_ckpt)
    return LoRARequest("a", 1, a), LoRARequest("b", 2, b)


def test_async_scheduling_mixed_adapters_equal_peft(llama_ckpt, adapters):
    a, b = adapters
    loras = [a, None, b, b, a, None]
    model = llm(llama_ckpt, async_scheduling=True)
    outs = model.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == expected(llama_ckpt, loras)
    assert model.engine.stats.async_steps > 0
    assert not model.engine.lora.pins


def _order_plan_ahead_inside_forward(engine) -> list[bool]:
    """Make each forward of the engine's step thread run as: snapshot the adapter slots, let the main thread
    plan the next step (``_plan_ahead``), run the forward, compare the slots. Returns, per forward, whether the
    slots changed meanwhile (timeouts keep steps without a partner going)."""
    runner, changed = engine.runner, []
    entered, planned = threading.Event(), threading.Event()
    forward, plan_ahead = runner.forward, engine._plan_ahead

    def slots() -> list[torch.Tensor]:
        return [
            t.clone()
            for layer in runner.adapters.slots.layers.values()
            for t in (layer.weights.a, *layer.weights.b)
        ]

    def ordered_forward(fwd, fill=None):
        before = slots()
        entered.set()
        planned.wait(2.0)
        planned.clear()
        result = forward(fwd, fill)
        changed.append(any(not torch.equal(x, y) for x, y in zip(before, slots())))
        return result

    def ordered_plan_ahead(flight):
        entered.wait(2.0)
        entered.clear()
        try:
            return plan_ahead(flight)
        finally:
            planned.set()

    runner.forward = ordered_forward
    engine._plan_ahead = ordered_plan_ahead
    return changed


def test_async_slot_is_not_rewritten_under_a_forward_in_flight(llama_ckpt, adapters):
    """One slot. Request x (adapter a) stops on a stop token, found at the update of step k, while step k+1, planned
    ahead, still holds x's row on a's slot (and base row z's, so it runs); request y (adapter b, waiting for the
    slot) is admitted by the step planned during k+1's forward. b's weights go into the slot only after that
    forward, and every row equals PEFT."""
    a, b = adapters
    ref_x = peft_greedy(llama_ckpt, a.lora_path, PROMPTS[0])
    stop_at = next(i for i in range(2, NEW - 3) if ref_x[i] not in ref_x[:i])
    model = llm(llama_ckpt, async_scheduling=True, max_loras=1)
    changed = _order_plan_ahead_inside_forward(model.engine)
    stop_x = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[ref_x[stop_at]])
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    outs = model.generate(prompts, [stop_x, GREEDY, GREEDY], use_tqdm=False, lora_request=[a, b, None])
    assert outs[0].outputs[0].token_ids == ref_x[: stop_at + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == peft_greedy(llama_ckpt, b.lora_path, PROMPTS[1])
    assert outs[2].outputs[0].token_ids == peft_greedy(llama_ckpt, None, PROMPTS[4])
    mgr = model.engine.lora
    assert mgr.stats.evictions == 1 and model.engine.stats.async_steps > 0
    assert changed and not any(changed)


def _peft_masked_greedy(base: str, adapter: str | None, prompt: list[int], compiled, eos: list[int], n: int):
    """Greedy decoding of PEFT's model under xgrammar's token mask (the reference of constrained decoding)."""
    import xgrammar as xgr

    model = _peft_model(base, adapter)
    matcher = xgr.GrammarMatcher(compiled)
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
        mask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1])
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        assert matcher.accept_token(token)
        ids.append(token)
    return out


def test_structured_outputs_under_adapters_equal_peft_masked_greedy(llama_ckpt, adapters):
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")
    a, b = adapters
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"type": "string", "maxLength": 4},
        },
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(temperature=0, max_tokens=24, choice=["alpha", "beta", "gamma delta", "no"]),
        SamplingParams(temperature=0, max_tokens=24, regex=r"[a-z]{2,8}-[0-9]{1,3}"),
        SamplingParams(temperature=0, max_tokens=40, json_schema=schema),
        SamplingParams(temperature=0, max_tokens=24, regex=r"[a-z]{2,8}-[0-9]{1,3}"),
    ]
    loras = [a, b, a, None]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[1]]
    model = llm(llama_ckpt, num_blocks=128)
    outs = model.generate(prompts, params, use_tqdm=False, lora_request=loras)
    engine = model.engine
    refs = [
        _peft_masked_greedy(
            llama_ckpt, lr.lora_path if lr else None, p, engine.structured.compile(sp), engine.eos_token_ids,
            sp.max_tokens,
        )
        for p, sp, lr in zip(prompts, params, loras)
    ]  # fmt: skip
    assert refs[1] != refs[3]  # the adapter changes the constrained output
    for out, ref in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == ref  # the eos that ends the grammar included
        assert got.constraint_satisfied and got.finish_reason == "stop"
