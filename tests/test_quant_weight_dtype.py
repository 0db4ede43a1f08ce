"""bfloat16 / float16 checkpoints held in their dtype and computed in float32 on the CPU: greedy output equal
token for token to transformers loading the same checkpoint with `dtype=float32` (which widens the same
rounded weights: the same arithmetic), the projections held narrow (half float32's bytes)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy, make_llm

from batchgen import SamplingParams
from batchgen.models.packed_linear import PackedLinear

PROMPTS = [[1, 17, 33, 90, 5], [1, 201, 7, 7, 300, 41, 12, 9, 3], [1, 64]]
NEW = 12


@pytest.mark.parametrize("arch, dtype", [("llama", torch.bfloat16), ("qwen2", torch.float16)])
def test_narrow_checkpoint_greedy_equals_transformers_float32(ckpt_factory, arch, dtype) -> None:
    path = ckpt_factory(arch, seed=21, dtype=dtype, tie_word_embeddings=arch == "qwen2")
    llm = make_llm(path)  # dtype="auto": the checkpoint's
    model = llm.engine.model
    assert (model.config.weight_dtype, model.config.dtype) == (dtype, torch.float32)
    projections = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert projections and all(m.weight.dtype == dtype for m in projections)
    assert llm.engine.runner.dtype == torch.float32  # the KV cache and activations
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == hf_greedy(path, PROMPTS, NEW)


def test_float32_checkpoint_held_in_bfloat16(ckpt_factory) -> None:
    """`dtype="bfloat16"` on a float32 checkpoint rounds the weights once at load: the result is transformers'
    float32 model on those rounded weights."""
    from transformers import AutoModelForCausalLM

    path = ckpt_factory("llama", seed=22)
    llm = make_llm(path, dtype="bfloat16")
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    hf = hf.float().eval()
    want = []
    with torch.inference_mode():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    assert got == want
