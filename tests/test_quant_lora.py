"""LoRA adapters on a quantized base (GPTQ with act-order and zero points, block fp8, W8A8): greedy output equals
PEFT over the base's dequantized float32 weights (GPTQ, see test_gptq_awq) or transformers' own loading (fp8,
W8A8)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_helpers import PROMPTS, make_adapter, peft_greedy
from test_gptq_awq import _dequantized_checkpoint

from batchgen import LLM, LoRARequest, SamplingParams
from batchgen.models.quant import writers


@pytest.mark.parametrize("kind", ["gptq", "fp8", "w8a8"])
def test_adapter_on_a_quantized_base_equals_peft(ckpt_factory, tmp_path, kind) -> None:
    base = ckpt_factory("llama", seed=33, hidden_size=256, intermediate_size=512)
    adapter = make_adapter(base, tmp_path / "adapter", 8, ["q_proj", "v_proj", "down_proj"], 16, 1)
    if kind == "gptq":
        path = writers.write_gptq(base, tmp_path / kind, bits=4, group_size=32, desc_act=True, sym=False)
        reference = _dequantized_checkpoint(path, tmp_path / "dense", "gptq", 4, True)
    elif (
        kind == "w8a8"
    ):  # int8 inputs: the integer GEMM beside the adapter's float32 product on the same input
        pytest.importorskip(
            "compressed_tensors", reason="compressed-tensors (the quant extra) is not installed"
        )
        # the trained tiny model: a random one's nearly tied logits part under any rounding of quantized inputs
        tiny = Path(__file__).resolve().parents[1] / "batchgen/models/tiny_lm"
        adapter = make_adapter(
            str(tiny), tmp_path / "tiny-adapter", 8, ["q_proj", "v_proj", "down_proj"], 16, 1
        )
        path = reference = writers.write_compressed_w8a8(tiny, tmp_path / kind, weights="int8")
    else:
        path = reference = writers.write_block_fp8(base, tmp_path / kind, block=(32, 32))
    llm = LLM(path, enable_lora=True, max_lora_rank=16, num_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=LoRARequest("a", 1, adapter)
    )
    assert [o.outputs[0].token_ids for o in outs] == [peft_greedy(reference, adapter, p) for p in PROMPTS]
