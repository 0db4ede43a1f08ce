"""Batched LoRA: the segmented torch path and the Triton kernels (interpreted on CPU) against the per-token
float64 reference, on batches mixing slots, ranks, untargeted parts and base-model tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.kernels.lora import (
    BLOCK_M,
    PER_SLOT_MIN_TOKENS,
    LoRAPlan,
    LoRAWeights,
    add_lora_torch,
    lora_reference,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


def make_weights(
    sizes: list[int], in_features: int, max_rank: int, slot_ranks: list[list[int]], dtype, device, seed=0
) -> LoRAWeights:
    """Slots with the given per-part ranks (0: part not targeted), random factors, distinct scales."""
    g = torch.Generator().manual_seed(seed)
    w = LoRAWeights.empty(len(slot_ranks), in_features, sizes, max_rank, dtype, torch.device(device))
    for s, ranks in enumerate(slot_ranks):
        for p, r in enumerate(ranks):
            if r == 0:
                w.set_slot(s, p, None, None, 0.0)
                continue
            a = torch.randn(r, in_features, generator=g) * 0.3
            b = torch.randn(sizes[p], r, generator=g) * 0.3
            w.set_slot(s, p, a.to(dtype), b.to(dtype), 0.5 + s + 0.25 * p)
    return w


def batch(token_slots: list[int], in_features: int, out_features: int, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), in_features, generator=g).to(dtype).to(device)
    y = torch.randn(len(token_slots), out_features, generator=g).to(dtype).to(device)
    return x, y


CASES = {
    # name: (part sizes, in, max rank, per-slot part ranks, token slots)
    "qkv-mixed": (
        [32, 16, 16],
        48,
        16,
        [[8, 0, 8], [16, 16, 16], [0, 0, 0], [4, 4, 0]],
        [0, -1, 1, 1, 3, -1, 0, 2, 1, 0, 3, 3, -1],
    ),
    "one-part-long-segment": ([40], 24, 32, [[32], [1]], [1] * (BLOCK_M + 3) + [-1, 0, 0] + [1] * 5),
    "base-only": ([24], 16, 8, [[8]], [-1, -1, -1]),
    # every active slot has as many tokens: the padded layout has no padding
    "equal-segments": ([24, 8], 16, 8, [[8, 4], [4, 0], [2, 2]], [1, 0, -1, 0, 1, 1, 0, -1]),
    # segments of PER_SLOT_MIN_TOKENS or more: the torch path goes slot by slot at each slot's own rank
    "prefill-per-slot": ([24, 8], 16, 8, [[8, 0], [4, 4]], [0] * 70 + [-1] * 3 + [1] * 65 + [0, 1]),
}
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_segmented_matches_reference(case):
    sizes, k, rank, slot_ranks, slots = CASES[case]
    w = make_weights(sizes, k, rank, slot_ranks, torch.float32, "cpu")
    x, y = batch(slots, k, sum(sizes), torch.float32, "cpu")
    ref = lora_reference(y, x, torch.tensor(slots), w)
    out = add_lora_torch(y.clone(), x, LoRAPlan.build(slots, x.device), w)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    base = [t for t, s in enumerate(slots) if s < 0 or not any(slot_ranks[s])]
    assert torch.equal(out[base], y[base])  # base-model tokens are untouched, bit for bit


def test_both_torch_paths_are_covered():
    longest = {c: max(v[4].count(s) for s in set(v[4]) if s >= 0) for c, v in CASES.items() if max(v[4]) >= 0}
    assert min(longest.values()) < PER_SLOT_MIN_TOKENS <= max(longest.values())


def test_plan_blocks_never_straddle_slots():
    slots = np.array([2, -1, 0, 2, 2, 0] + [1] * (2 * BLOCK_M + 1))
    plan = LoRAPlan.build(slots, torch.device("cpu"))
    order = plan.order.numpy()
    assert sorted(order.tolist()) == np.nonzero(slots >= 0)[0].tolist()
    for s, b0, b1 in zip(plan.block_slot.tolist(), plan.block_start.tolist(), plan.block_end.tolist()):
        assert 0 < b1 - b0 <= BLOCK_M
        assert (slots[order[b0:b1]] == s).all()
    assert [s for s, _, _ in plan.segments] == [0, 1, 2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_reference(device, dtype, case):
    pytest.importorskip("triton")
    from batchgen.kernels.lora_triton import add_lora_triton

    sizes, k, rank, slot_ranks, slots = CASES[case]
    w = make_weights(sizes, k, rank, slot_ranks, dtype, device)
    x, y = batch(slots, k, sum(sizes), dtype, device)
    ref = lora_reference(y.cpu(), x.cpu(), torch.tensor(slots), _cpu(w))
    out = add_lora_triton(y.clone(), x, LoRAPlan.build(slots, x.device), w)
    torch.testing.assert_close(out.double().cpu(), ref, **TOL[dtype])


def _cpu(w: LoRAWeights) -> LoRAWeights:
    return LoRAWeights(w.a.cpu(), [b.cpu() for b in w.b], w.scale.cpu(), w.offsets, w.sizes, w.ranks)
