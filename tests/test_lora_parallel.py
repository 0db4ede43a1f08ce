"""LoRA under tensor parallelism: a 2-rank engine (CPU, gloo, async scheduling) serves batches mixing adapters and
base rows with the greedy tokens of one process and of PEFT, its worker loading and evicting adapter slots (its
shard of each) as rank 0 decides."""

from __future__ import annotations

from lora_helpers import PROMPTS, adapter, peft_greedy, two_adapters

from batchgen import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _tokens(llm: LLM, loras: list) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_tp2_mixed_adapters_equal_one_process_and_peft(llama_ckpt):
    pa, pb = two_adapters(llama_ckpt)
    pc = adapter(llama_ckpt, 8, ("k_proj", "o_proj", "up_proj", "down_proj"), 16, 3)
    a, b, c = LoRARequest("a", 1, pa), LoRARequest("b", 2, pb), LoRARequest("c", 3, pc)
    # the second batch brings a third adapter into two slots: loads and evictions must reach the worker
    batches = [[a, None, b, b, a, None], [c, a, None, c, b, a]]
    want = [
        [peft_greedy(llama_ckpt, lr.lora_path if lr else None, p, 10) for p, lr in zip(PROMPTS, loras)]
        for loras in batches
    ]
    engine = dict(
        device="cpu", block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
        enable_lora=True, max_loras=2, max_lora_rank=16,
    )  # fmt: skip
    one = LLM(llama_ckpt, **engine)
    assert [_tokens(one, loras) for loras in batches] == want
    # async scheduling too: the pipelined executor's thread posts each step, its slot loads first
    sharded = LLM(llama_ckpt, tensor_parallel_size=2, async_scheduling=True, **engine)
    assert [_tokens(sharded, loras) for loras in batches] == want
    stats = sharded.engine.lora.stats
    assert stats.loads >= 3 and stats.evictions >= 1 and sharded.engine.stats.async_steps > 0
