"""Decode attention in groups of similar context (kernels/torch_backend.py ``_decode_groups``): the grouped
path equals the float64 reference, whatever the grouping, and groups bound the padding."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.kernels import reference
from batchgen.kernels import torch_backend as tb
from batchgen.kernels.options import AttentionOptions
from batchgen.kernels.paged_kv import PagedKV


def test_groups_bound_padding() -> None:
    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 900) for _ in range(rng.randint(1, 64))]
        groups = tb._decode_groups(lens, 16)
        blocks = [(n + 15) // 16 for n in lens]
        if groups is None:
            assert max(blocks) * len(blocks) <= tb._DECODE_PAD_SLACK * sum(blocks)
            continue
        assert sorted(b for g in groups for b in g) == list(range(len(lens)))
        for g in groups:  # each group pads to its longest within the slack
            assert max(blocks[b] for b in g) * len(g) <= tb._DECODE_PAD_SLACK * sum(blocks[b] for b in g)


def test_uniform_lengths_one_call() -> None:
    assert tb._decode_groups([100] * 8, 16) is None
    assert tb._decode_groups([5, 900], 16) == [[1], [0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_grouped_decode_matches_reference(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    torch.manual_seed(0)
    rng = random.Random(1)
    hq, hkv = heads
    batch, d, bs, num_blocks = 24, 32, 16, 1000
    lens = [rng.choice([rng.randint(1, 40), rng.randint(200, 600)]) for _ in range(batch)]
    assert tb._decode_groups(lens, bs) is not None  # the grouped path runs
    k_cache = torch.randn(num_blocks, bs, hkv, d).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d).to(dtype)
    width = max((n + bs - 1) // bs for n in lens)
    tables = torch.randperm(num_blocks)[: batch * width].view(batch, width).int()
    q = torch.randn(batch, hq, d).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kv = PagedKV(k_cache, v_cache, tables, seq_lens)
    opts = AttentionOptions(scale=d**-0.5)
    plan: dict = {}
    got = tb.paged_decode_attention(q, kv, opts, plan_cache=plan)
    assert len(plan["decode_plan"].groups) > 1
    want = reference.paged_decode_attention(q, kv, opts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    # the plan is reused by the next layer of the same forward
    again = tb.paged_decode_attention(q, kv, opts, plan_cache=plan)
    assert torch.equal(again, got)
