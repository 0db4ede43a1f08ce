"""Swap-to-CPU preemption: output identical to recompute under a pool small enough to force many preemptions,
swap counters in the stats, fallback to recompute when the CPU pool is full, and the block copies themselves."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.stats import EngineStats
from batchgen.engine.kv.swap import BlockSwapper
from batchgen.engine.worker.model_runner import copy_runs

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def make_prompts(lengths: list[int], seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def test_swap_mode_equals_recompute_under_heavy_preemption(llama_ckpt: str) -> None:
    prompts = make_prompts([1, BS - 1, BS, BS + 1, 3 * BS + 5] * 3, seed=31)
    ref = LLM(llama_ckpt, num_blocks=512, block_size=BS).generate(prompts, GREEDY, use_tqdm=False)
    runs = {}
    # 20 blocks of 16 tokens for 15 sequences of up to ~100 tokens: many preemptions. The last engine's CPU
    # pool holds only a few sequences, so some preemptions fall back to recompute.
    for name, opts in {
        "recompute": dict(preemption_mode="recompute"),
        "swap": dict(preemption_mode="swap", swap_space="64MiB"),
        "swap-small-cpu": dict(preemption_mode="swap", num_swap_blocks=8),
    }.items():
        llm = LLM(llama_ckpt, num_blocks=20, block_size=BS, max_num_seqs=16, **opts)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref], name
        runs[name] = llm.engine
    assert runs["recompute"].stats.num_preemptions > 5
    assert runs["recompute"].stats.num_swapped_out_blocks == 0
    for name in ("swap", "swap-small-cpu"):
        st = runs[name].stats
        assert st.num_preemptions > 5 and st.num_swapped_out_blocks > 0, name
        assert st.num_swapped_in_blocks > 0 and st.swapped_seqs == 0, name
        kv = runs[name].scheduler.kv.stats()
        assert kv.blocks_used == 0 and kv.cpu_blocks_used == 0 and kv.num_swapped_seqs == 0
    # Swapping saves the recomputation of prompts and outputs.
    assert runs["swap"].stats.prompt_tokens_computed < runs["recompute"].stats.prompt_tokens_computed
    assert runs["swap"].scheduler.kv.num_cpu_blocks == (64 << 20) // runs["swap"].runner.bytes_per_block


def test_swap_with_prefix_cache_and_forks(llama_ckpt: str) -> None:
    """Shared blocks (a common prefix, n > 1 forks) are swapped once and come back right."""
    shared = make_prompts([2 * BS + 3], seed=32)[0]
    prompts = [shared + [100 + i] for i in range(6)]
    params = [SamplingParams(n=2, temperature=0.7, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)]
    ref = LLM(llama_ckpt, num_blocks=256, block_size=BS).generate(prompts, params, use_tqdm=False)
    small = LLM(llama_ckpt, num_blocks=14, block_size=BS, preemption_mode="swap", num_swap_blocks=64)
    got = small.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in got] == [[o.token_ids for o in r.outputs] for r in ref]
    assert small.engine.stats.num_swapped_out_blocks > 0


def test_block_swapper_round_trip_on_cpu() -> None:
    torch.manual_seed(0)
    kv = torch.randn(2, 2, 10, 4, 3, 8)
    original = kv.clone()
    swapper = BlockSwapper(kv, num_cpu_blocks=6)
    swapper.swap_out([(7, 0), (2, 5), (9, 3)])
    kv[:, :, [7, 2, 9]] = 0.0  # the freed GPU blocks are reused
    swapper.swap_in([(5, 1), (0, 4), (3, 8)])
    assert torch.equal(kv[:, :, 1], original[:, :, 2])
    assert torch.equal(kv[:, :, 4], original[:, :, 7])
    assert torch.equal(kv[:, :, 8], original[:, :, 9])
    assert torch.equal(kv[:, :, 0], original[:, :, 0])  # untouched


def test_copy_runs_keep_sources_and_destinations_disjoint() -> None:
    assert copy_runs([]) == []
    assert copy_runs([(1, 2), (3, 4)]) == [[(1, 2), (3, 4)]]
    # Block 1 is read, then freed by a preemption and handed out as a destination in the same step.
    assert copy_runs([(1, 2), (3, 4), (5, 1)]) == [[(1, 2), (3, 4)], [(5, 1)]]
    assert copy_runs([(1, 2), (2, 6)]) == [[(1, 2)], [(2, 6)]]


def test_config_and_stats() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="offload")
    with pytest.raises(ValueError, match="memory size"):
        EngineConfig(swap_space="lots")
    before = EngineStats(num_swapped_out_blocks=3, num_swapped_in_blocks=1)
    after = EngineStats(num_swapped_out_blocks=10, num_swapped_in_blocks=9, swapped_seqs=2)
    d = after.delta(before)
    assert (d.num_swapped_out_blocks, d.num_swapped_in_blocks, d.swapped_seqs) == (7, 8, 2)
    assert {"num_swapped_out_blocks", "num_swapped_in_blocks"} <= set(after.to_dict())
