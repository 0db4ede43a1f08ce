"""Sampler: greedy, filters against a naive reference, penalties by hand, seeded determinism, distribution."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from batchgen.engine.worker.sampler import Sampler, SamplingRow, _apply_penalties, _filtered_probs
from batchgen.sampling_params import SamplingParams

V = 50


_keys = itertools.count()


def row(params: SamplingParams | None = None, seed: int | None = None, **kw) -> SamplingRow:
    """A row; seeded rows get a key of their own (the sampler's generator for it persists across calls)."""
    return SamplingRow(params=params or SamplingParams(), seed=seed, key=next(_keys), **kw)


def rand_logits(n: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_logits_untouched():
    logits = rand_logits(7)
    before = logits.clone()
    out = Sampler()(logits, [row(SamplingParams(temperature=0)) for _ in range(7)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 7
    assert torch.equal(logits, before)


def test_greedy_ties_go_to_lowest_id():
    logits = torch.zeros(2, 10)
    logits[0, [3, 7]] = 5.0
    out = Sampler()(logits, [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0))])
    assert out.token_ids == [3, 0]


def test_empty_batch_and_shape_check():
    assert Sampler()(torch.zeros(0, V), []).token_ids == []
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, V), [row()])


def test_banned_tokens_greedy_and_random():
    logits = rand_logits(4)
    top = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0)
    rows = [
        row(greedy, banned_token_ids=[top[0]]),
        row(greedy),
        row(SamplingParams(top_k=1), banned_token_ids=[top[2], 10_000]),  # out-of-vocab id ignored
        row(greedy, banned_token_ids=[-3]),
    ]
    out = Sampler()(logits, rows)
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    assert out.token_ids == [second[0], top[1], second[2], top[3]]


def test_top_k_one_and_tiny_top_p_are_argmax_in_random_mode():
    logits = rand_logits(16)
    rows = [row(SamplingParams(temperature=1.3, top_k=1)) for _ in range(8)]
    rows += [row(SamplingParams(temperature=0.9, top_p=1e-6), seed=i) for i in range(8)]
    for step in range(5):
        assert Sampler(seed=step)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(6)
    rows = [
        row(SamplingParams(temperature=0)) if i % 2 == 0 else row(SamplingParams(top_k=1)) for i in range(6)
    ]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- filters vs a naive reference


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, float64, transformers' order: temperature, top-k, top-p, min-p."""
    x = logits.double() / p.temperature
    if p.top_k > 0:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, len(x)) - 1]
        x = torch.where(x < kth, torch.tensor(-math.inf, dtype=x.dtype), x)
    if p.top_p < 1.0:
        probs = x.softmax(-1).tolist()
        keep, mass = set(), 0.0
        for j in sorted(range(len(probs)), key=lambda j: -probs[j]):
            if mass < p.top_p:
                keep.add(j)
            mass += probs[j]
        x = torch.tensor([x[j].item() if j in keep else -math.inf for j in range(len(x))], dtype=x.dtype)
    probs = x.softmax(-1)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
        probs = probs / probs.sum()
    return probs


FILTER_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0, top_k=5),
    SamplingParams(top_k=1),
    SamplingParams(top_k=V + 10),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9, temperature=0.7),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.3, temperature=1.5),
    SamplingParams(top_k=10, top_p=0.8),
    SamplingParams(top_k=20, top_p=0.6, min_p=0.05, temperature=0.8),
    SamplingParams(top_k=7, min_p=0.2),
]


@pytest.mark.parametrize(
    "p", FILTER_CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_each_filter_matches_reference(p):
    logits = rand_logits(4, seed=1)
    got = _filtered_probs(logits, [p] * 4)
    for i in range(4):
        torch.testing.assert_close(got[i].double(), reference_probs(logits[i], p), atol=1e-6, rtol=1e-4)


def test_filters_vectorised_over_rows_with_different_params():
    """One batch mixing every case gives each row exactly what it gets alone (per-row tensors, no leakage)."""
    logits = rand_logits(len(FILTER_CASES), seed=2)
    got = _filtered_probs(logits, FILTER_CASES)
    for i, p in enumerate(FILTER_CASES):
        torch.testing.assert_close(got[i].double(), reference_probs(logits[i], p), atol=1e-6, rtol=1e-4)
        assert torch.equal(got[i], _filtered_probs(logits[i : i + 1], [p])[0])


def test_filtered_tokens_are_never_sampled():
    logits = rand_logits(1, seed=3).expand(4000, V).contiguous()
    p = SamplingParams(temperature=1.5, top_k=6, top_p=0.9)
    allowed = set(reference_probs(logits[0], p).nonzero().flatten().tolist())
    out = Sampler(seed=5)(logits, [row(p) for _ in range(4000)])
    assert set(out.token_ids) <= allowed
    assert len(set(out.token_ids)) == len(allowed)


# ---------------------------------------------------------------- penalties


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    rows = [
        row(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt_token_ids=[0, 1],
            output_token_ids=[3, 3, 4, 99],  # 99 is outside the vocab: ignored
        ),
        row(SamplingParams(frequency_penalty=-1.0), prompt_token_ids=[0, 0, 2], output_token_ids=[5, 5, 5]),
    ]
    x = logits.clone()
    _apply_penalties(x, rows)
    # row 0: repetition on {0,1,3,4}; then freq/presence on output counts {3: 2, 4: 1}
    expected0 = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 * 2 - 0.25, -2.0 * 2 - 0.5 - 0.25, 0.0]
    # row 1: prompt tokens are not penalised by frequency; output token 5 three times
    expected1 = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0 + 3.0]
    torch.testing.assert_close(x, torch.tensor([expected0, expected1]))


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = rand_logits(3, seed=4)
    ids = [[1, 5, 5, 9], [0, 2, 4, 6], [7, 7, 7, 7]]
    prompt_len = 2
    rows = [
        row(
            SamplingParams(repetition_penalty=1.3),
            prompt_token_ids=t[:prompt_len],
            output_token_ids=t[prompt_len:],
        )
        for t in ids
    ]
    x = logits.clone()
    _apply_penalties(x, rows)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids), logits.clone())
    torch.testing.assert_close(x, ref)


def test_penalty_changes_greedy_choice_and_only_for_its_row():
    logits = torch.tensor([[5.0, 4.9, 0.0], [5.0, 4.9, 0.0]])
    rows = [
        row(SamplingParams(temperature=0, presence_penalty=0.5), output_token_ids=[0]),
        row(SamplingParams(temperature=0), output_token_ids=[0]),
    ]
    assert Sampler()(logits, rows).token_ids == [1, 0]


# ---------------------------------------------------------------- seeds and determinism


def _run(rows_factory, logits_list, sampler_seed=0):
    """Sample len(logits_list) steps; rows_factory() builds fresh rows (fresh generators)."""
    sampler = Sampler(seed=sampler_seed)
    rows = rows_factory()
    outs = []
    for logits in logits_list:
        outs.append(sampler(logits, rows).token_ids)
    return outs


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_seeded_row_independent_of_batch_composition_and_order(device):
    steps = 12
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=30)
    target_logits = [rand_logits(1, seed=100 + s)[0] for s in range(steps)]

    def tokens_for(batch_size: int, position: int, neighbours: list[SamplingParams], seed_others: bool):
        others = [
            SamplingRow(params=q, seed=99 + j if seed_others else None, key=1 + j)
            for j, q in enumerate(neighbours)
        ]
        sampler = Sampler(seed=batch_size)  # different sampler seeds must not matter either
        result = []
        for s in range(steps):
            noise = rand_logits(batch_size, seed=1000 * batch_size + s)
            rows = list(others[: batch_size - 1])
            rows.insert(position, SamplingRow(params=target, seed=1234, key=0))
            logits = noise.clone()
            logits[position] = target_logits[s]
            result.append(sampler(logits.to(device), rows).token_ids[position])
        return result

    alone = tokens_for(1, 0, [], False)
    mixes = [
        [SamplingParams(temperature=0)] * 5,
        [SamplingParams(temperature=1.2)] * 5,
        [SamplingParams(top_p=0.5), SamplingParams(temperature=0), SamplingParams(min_p=0.2, top_k=3)] * 2,
        [SamplingParams(repetition_penalty=1.5, logprobs=3)] * 5,
    ]
    for mix in mixes:
        for position in (0, 4):
            for seed_others in (False, True):
                assert tokens_for(5, position, mix, seed_others) == alone
    assert len(set(alone)) > 3  # it really sampled


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = [rand_logits(1, seed=s) for s in range(30)]
    p = SamplingParams(temperature=1.5)
    a = _run(lambda: [row(p, seed=7)], logits)
    b = _run(lambda: [row(p, seed=7)], logits, sampler_seed=3)
    c = _run(lambda: [row(p, seed=8)], logits)
    assert a == b
    assert a != c


def test_unseeded_rows_reproducible_per_sampler_seed():
    logits = [rand_logits(8, seed=s) for s in range(10)]
    p = SamplingParams(temperature=1.0)
    a = _run(lambda: [row(p) for _ in range(8)], logits, sampler_seed=1)
    b = _run(lambda: [row(p) for _ in range(8)], logits, sampler_seed=1)
    c = _run(lambda: [row(p) for _ in range(8)], logits, sampler_seed=2)
    assert a == b and a != c


# ---------------------------------------------------------------- distribution


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    expected = probs * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "sampled a token with probability 0"
    stat = (((counts[mask] - expected[mask]) ** 2) / expected[mask]).sum().item()
    return stat, int(mask.sum()) - 1


def test_distribution_unseeded_rows():
    v, n = 12, 40_000
    base = torch.randn(v, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.8, top_k=9, top_p=0.97)
    probs = reference_probs(base, p)
    out = Sampler(seed=11)(base.expand(n, v).contiguous(), [row(p) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=v).double()
    stat, dof = _chi_square(counts, probs, n)
    assert stat < dof + 6 * math.sqrt(2 * dof), (stat, dof)  # ~6 sigma: flaky with prob. < 1e-6


def test_distribution_seeded_row():
    v, n = 6, 3000
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    p = SamplingParams(temperature=1.0)
    probs = reference_probs(base, p)
    sampler, r = Sampler(), row(p, seed=42)
    logits = base.unsqueeze(0)
    tokens = [sampler(logits, [r]).token_ids[0] for _ in range(n)]
    counts = torch.bincount(torch.tensor(tokens), minlength=v).double()
    stat, dof = _chi_square(counts, probs, n)
    assert stat < dof + 6 * math.sqrt(2 * dof), (stat, dof)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_top_k_plus_sampled():
    logits = rand_logits(4, seed=9)
    raw = torch.log_softmax(logits, -1)
    rows = [
        row(SamplingParams(temperature=0, logprobs=3)),
        row(SamplingParams(temperature=0.5, repetition_penalty=1.8, logprobs=0), prompt_token_ids=[1, 2]),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=2.0, top_k=40, logprobs=5), seed=3),
    ]
    out = Sampler()(logits, rows)
    assert out.logprobs[2] is None
    for i, k in [(0, 3), (1, 0), (3, 5)]:
        d = out.logprobs[i]
        tok = out.token_ids[i]
        assert tok in d
        top = raw[i].topk(k).indices.tolist() if k else []
        assert set(d) == set(top) | {tok}
        assert len(d) in (k, k + 1)
        for t, lp in d.items():
            assert lp == pytest.approx(raw[i, t].item(), abs=1e-6)  # raw logits, not penalised/tempered
    assert len(out.logprobs[0]) == 3  # greedy: the argmax is the top-1
    assert math.exp(raw[0].logsumexp(-1).item()) == pytest.approx(1.0, abs=1e-5)
    assert sum(math.exp(lp) for lp in out.logprobs[0].values()) <= 1.0 + 1e-6


def test_logprobs_k_larger_than_vocab():
    logits = rand_logits(1, v=5)
    out = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=20))])
    d = out.logprobs[0]
    assert set(d) == set(range(5))
    assert sum(math.exp(x) for x in d.values()) == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_semantics_and_seeded_rows_work():
    logits = rand_logits(8, seed=5).cuda()
    greedy = Sampler()(logits, [row(SamplingParams(temperature=0)) for _ in range(8)])
    assert greedy.token_ids == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, min_p=0.05, logprobs=2)
    rows = [row(p, seed=i) if i % 2 else row(p) for i in range(8)]  # seeded rows' generators on CUDA
    rows.append(row(p, seed=1))
    out = Sampler()(torch.cat([logits, logits[:1]]), rows)
    probs = _filtered_probs(torch.cat([logits, logits[:1]]), [p] * 9)
    assert all(probs[i, t] > 0 for i, t in enumerate(out.token_ids))
    torch.testing.assert_close(probs.cpu(), _filtered_probs(torch.cat([logits, logits[:1]]).cpu(), [p] * 9))


def test_a_released_key_starts_its_generator_again():
    """Seeded rows are plain data (seed, key): the sampler keeps one generator per key until released."""
    p = SamplingParams(temperature=1.0)
    logits = rand_logits(1, v=1000, seed=4)
    sampler = Sampler()
    seeded = SamplingRow(params=p, seed=5, key=7)
    first = [sampler(logits, [seeded]).token_ids[0] for _ in range(6)]
    assert len(set(first)) > 1  # the generator advances step after step
    sampler.release([7])
    assert [sampler(logits, [seeded]).token_ids[0] for _ in range(6)] == first
    assert Sampler()(logits, [SamplingRow(params=p, seed=5, key=8)]).token_ids[0] == first[0]
