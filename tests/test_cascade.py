"""Cascade decode attention (a shared prefix read once per group of sequences) against the reference,
and end to end: prefix-shared batches give the same greedy tokens with and without shared blocks."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.kernels import cpu_kernel, reference
from batchgen.kernels import torch_backend as tb
from batchgen.kernels.options import AttentionOptions
from batchgen.kernels.paged_kv import PagedKV


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,num_kv_heads", [(16, 4), (8, 1), (32, 2)])
@pytest.mark.parametrize("consecutive", [False, True])
def test_cascade_decode_matches_reference(
    dtype, tol, block_size, num_kv_heads, consecutive, monkeypatch
) -> None:
    """`consecutive`: the shared prefixes sit in consecutive physical blocks (read in place, no gather)."""
    g = torch.Generator().manual_seed(0)
    batch, num_q_heads, head_dim = 24, 8, 32
    lens = torch.randint(3 * block_size + 1, 6 * block_size, (batch,), generator=g).int()
    nb = 6
    num_blocks = batch * nb + 7
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: batch * nb].view(batch, nb).int()
    # Three groups sharing 3, 2 and 1 leading blocks; the rest unshared (and one group of 2, too small).
    for lo, hi, shared in [(0, 8, 3), (8, 14, 2), (14, 19, 1), (19, 21, 3)]:
        tables[lo:hi, :shared] = torch.arange(shared) + lo * nb if consecutive else tables[lo, :shared]
    plan = tb._cascade_plan(tables, lens.long(), block_size, dtype)
    assert plan is not None
    assert all(isinstance(blocks, slice) for _, blocks in plan.groups) == consecutive
    q = torch.randn(batch, num_q_heads, head_dim, generator=g).to(dtype)
    out = tb._decode_cascade(q, PagedKV(k, v, tables, lens), 0.17, tb.Workspace())
    assert out is not None, "groups share enough blocks: the cascade path must be taken"
    ref = reference.paged_decode_attention(q, PagedKV(k, v, tables, lens), AttentionOptions(0.17))
    assert (out.double() - ref).abs().max().item() < tol
    if dtype == torch.float32 and cpu_kernel.compiler() is not None:  # suffixes read by the C kernel
        monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
        out = tb._decode_cascade(q, PagedKV(k, v, tables, lens), 0.17, tb.Workspace(), None, 0.0, kernel=True)
        assert out is not None
        assert (out.double() - ref).abs().max().item() < tol
    full = tb.paged_decode_attention(q, PagedKV(k, v, tables, lens), AttentionOptions(0.17))
    assert (full.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("options", [dict(sliding_window=20), dict(softcap=2.0), dict(sinks=torch.ones(8))])
def test_cascade_not_used_with_attention_options(monkeypatch, options) -> None:
    """The cascade reads a shared prefix for everyone; under a window (or soft-capping, sinks) decode takes
    the general path instead, and stays exact on a batch the cascade would take."""
    g = torch.Generator().manual_seed(2)
    block_size, batch = 16, 12
    k = torch.randn(64, block_size, 2, 32, generator=g)
    v = torch.randn(64, block_size, 2, 32, generator=g)
    tables = torch.randperm(64, generator=g)[: batch * 5].view(batch, 5).int()
    tables[:, :3] = tables[0, :3]  # every sequence shares 3 blocks
    lens = torch.randint(3 * block_size + 1, 5 * block_size, (batch,), generator=g).int()
    q = torch.randn(batch, 8, 32, generator=g)
    assert tb._decode_cascade(q, PagedKV(k, v, tables, lens), 0.2, None) is not None
    monkeypatch.setattr(tb, "_decode_cascade", lambda *a: pytest.fail("cascade taken with options"))
    out = tb.paged_decode_attention(q, PagedKV(k, v, tables, lens), AttentionOptions(0.2, **options))
    expected = reference.paged_decode_attention(
        q, PagedKV(k, v, tables, lens), AttentionOptions(0.2, **options)
    )
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_cascade_not_used_without_sharing() -> None:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(64, 16, 2, 16, generator=g)
    tables = torch.randperm(64, generator=g)[:48].view(12, 4).int()
    lens = torch.full((12,), 50, dtype=torch.int32)
    q = torch.randn(12, 4, 16, generator=g)
    assert tb._decode_cascade(q, PagedKV(k, k, tables, lens), 0.25, None) is None


def test_engine_prefix_shared_batch_same_tokens_with_cascade(llama_ckpt: str) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(5, 4096) for _ in range(45)]
    prompts = [prefix + [rng.randrange(5, 4096) for _ in range(rng.randint(1, 20))] for _ in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    shared = LLM(llama_ckpt, num_blocks=256).generate(prompts, sp, use_tqdm=False)
    private = LLM(llama_ckpt, num_blocks=256, enable_prefix_caching=False).generate(
        prompts, sp, use_tqdm=False
    )
    assert sum(o.num_cached_tokens for o in shared) > 0
    assert [o.outputs[0].token_ids for o in shared] == [o.outputs[0].token_ids for o in private]


def test_kernel_cascade_keeps_only_groups_that_save_enough(monkeypatch) -> None:
    """With the C kernel reading suffixes, a group that saves fewer block reads than one prefix call costs is
    read whole by the kernel (its sequences' starts are 0), the others go through the cascade."""
    block_size, nb = 16, 6
    tables = torch.arange(40 * nb).view(40, nb).int()
    lens = torch.full((40,), nb * block_size - 3)
    tables[0:32, :5] = tables[0, :5]  # 31 x 5 = 155 blocks saved
    tables[32:40, :5] = tables[32, :5]  # 7 x 5 = 35 blocks saved
    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 100)
    plan = tb._cascade_plan(tables, lens, block_size, torch.float32, 0.0, kernel=True)
    assert plan is not None and len(plan.groups) == 1 and plan.groups[0][0].tolist() == list(range(32))
    assert plan.starts[:32].tolist() == [5 * block_size] * 32 and not plan.starts[32:].any()
    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 1000)
    assert tb._cascade_plan(tables, lens, block_size, torch.float32, 0.0, kernel=True) is None


@pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")
@pytest.mark.parametrize("block_size,heads", [(16, (8, 4)), (8, (4, 1)), (32, (6, 2))])
def test_prefill_cascade_matches_reference(monkeypatch, block_size, heads) -> None:
    """Prefill chunks over a cached shared prefix: a group of 9 sequences (one chunk long, one a single token,
    one continuing a long context of its own), a second group of 4, a sequence writing the shared blocks in
    this very step (context 0: not in a group) and 2 unrelated ones; the cascade is taken and equals the
    float64 reference."""
    hq, hkv = heads
    g = torch.Generator().manual_seed(block_size)
    nb, head_dim = 12, 32
    groups = [(9, 4), (4, 2)]
    batch = sum(n for n, _ in groups) + 3
    num_blocks = batch * nb + 5
    tables = torch.randperm(num_blocks, generator=g)[: batch * nb].view(batch, nb).int()
    lens, q_lens, at = [], [], 0
    for n, shared in groups:
        tables[at : at + n, :shared] = tables[at, :shared]
        for i in range(n):
            ctx = shared * block_size + (3 if i % 2 else 0) + (4 * block_size if i == 2 else 0)
            q_len = [block_size + 5, 1, 7][i % 3]
            lens.append(ctx + q_len)
            q_lens.append(q_len)
        at += n
    tables[at, :4] = tables[0, :4]  # the sequence computing the first group's prefix in this step
    lens += [4 * block_size + 9, 40, 3 * block_size]
    q_lens += [4 * block_size + 9, 40, 5]
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=g)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    kv = PagedKV(k, v, tables, torch.tensor(lens, dtype=torch.int32))
    calls = []
    merge = cpu_kernel.merge_prefix
    monkeypatch.setattr(cpu_kernel, "merge_prefix", lambda *a: calls.append(1) or merge(*a))
    out = tb.paged_prefill_attention(q, cu, kv, AttentionOptions(0.2), workspace=tb.Workspace())
    assert calls, "the groups share most of the work: the prefill cascade must be taken"
    ref = reference.paged_prefill_attention(q, cu, kv, AttentionOptions(0.2))
    assert (out.double() - ref).abs().max().item() < 1e-5


def _shared_prefixes_reference(tables: list[list[int]], visible: list[int], block_size: int):
    """The grouping spelled out row by row: rows that see a whole block, grouped by their first block id (groups
    of at least tb._CASCADE_MIN_GROUP), each group's prefix the leading blocks every member has in common with
    the first and sees whole."""
    full = [v // block_size for v in visible]
    start = [0] * len(tables)
    groups = []
    by_first: dict[int, list[int]] = {}
    for r, row in enumerate(tables):
        if full[r] > 0:
            by_first.setdefault(row[0], []).append(r)
    for first in sorted(by_first):
        rows = by_first[first]
        if len(rows) < tb._CASCADE_MIN_GROUP:
            continue
        n = 0
        while (
            n < min(full[r] for r in rows)
            and n < len(tables[0])
            and all(tables[r][n] == tables[rows[0]][n] for r in rows)
        ):
            n += 1
        if n:
            for r in rows:
                start[r] = n
            groups.append((rows, tables[rows[0]][:n]))
    return start, groups


def test_shared_prefix_groups_equal_the_row_by_row_reference() -> None:
    rng = random.Random(0)
    for _ in range(400):
        batch, width, block_size = rng.randint(0, 24), rng.randint(1, 10), rng.choice([1, 4, 16])
        heads = [[rng.randrange(40) for _ in range(width)] for _ in range(rng.randint(1, 3))]
        tables, fresh = [], 1000
        for _ in range(batch):  # a shared head cut at a random block, then blocks of the row's own
            cut = rng.randint(0, width)
            tables.append(rng.choice(heads)[:cut] + list(range(fresh, fresh + width - cut)))
            fresh += width
        visible = [rng.randint(0, width * block_size + 2) for _ in range(batch)]
        start, groups = tb._shared_prefixes(
            torch.tensor(tables, dtype=torch.int32).reshape(batch, width), torch.tensor(visible), block_size
        )
        want_start, want_groups = _shared_prefixes_reference(tables, visible, block_size)
        assert start.tolist() == want_start
        assert [(idx.tolist(), ids.tolist()) for idx, ids in groups] == want_groups
        assert all(idx.dtype == torch.long and ids.dtype == torch.int32 for idx, ids in groups)


def _plan_fields(plan: tb.CascadePlan | None) -> object:
    if plan is None:
        return None
    p = plan.prefix
    assert p is not None
    return (
        [(idx.tolist(), ids.tolist()) for idx, ids in plan.groups],
        plan.starts.tolist(),
        [p.offsets.tolist(), p.seqs.tolist(), p.tables.tolist(), p.num_blocks.tolist()],
    )


@pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler: the kernel path does not run")
def test_kernel_cascade_plan_is_kept_across_decode_steps_of_the_same_batch(
    monkeypatch,
) -> None:
    """Decode steps of a batch whose sequences grow and cross into new blocks, one of them replaced twice: the
    plan is computed for the first step and after each change of the batch, kept in between (each kept group's
    rows still start with its prefix), and every step's output is the float64 reference's."""
    rng = random.Random(1)
    block_size, heads, dim = 4, 2, 8
    k = torch.randn(400, block_size, heads, dim)
    v = torch.randn(400, block_size, heads, dim)
    prefixes = [[1, 2, 3], [10, 11], [20, 21, 22, 23]]
    fresh = iter(range(100, 400))

    def new_seq(unlike: dict | None = None) -> dict:
        head = list(rng.choice([p for p in prefixes if unlike is None or p[0] != unlike["blocks"][0]]))
        n = len(head) * block_size + rng.randint(1, 6)
        return {"blocks": head + [next(fresh) for _ in range(-(-n // block_size) - len(head))], "len": n}

    seqs = [new_seq() for _ in range(16)]
    ws, computed, steps, plans = tb.Workspace(), [0], 0, []
    real = tb._cascade_plan

    def counting(*args, **kwargs):
        computed[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tb, "_cascade_plan", counting)
        for step in range(40):
            if step in (15, 30):  # one sequence ends, another (of another group) starts in its row
                row = rng.randrange(len(seqs))
                seqs[row] = new_seq(unlike=seqs[row])
            width = max(len(s["blocks"]) for s in seqs)
            tables = torch.tensor(
                [s["blocks"] + [0] * (width - len(s["blocks"])) for s in seqs], dtype=torch.int32
            )
            lens = torch.tensor([s["len"] for s in seqs], dtype=torch.int32)
            kv = PagedKV(k, v, tables, lens)
            q = torch.randn(len(seqs), 2 * heads, dim)
            out = tb._decode_cascade(q, kv, 0.3, ws, {}, 0.0, kernel=True)
            assert out is not None
            assert ws.cascade is not None
            kept, fresh_plan = ws.cascade.plan, real(tables, lens.long(), block_size, q.dtype, 0.0, True)
            if step in (0, 15, 30):  # a new batch: planned afresh
                assert _plan_fields(kept) == _plan_fields(fresh_plan)
            else:  # the same rows: the groups planned before, each row's prefix still at its table's head
                assert kept is not None and _plan_fields(kept) == _plan_fields(plans[-1])
                for idx, ids in kept.groups:
                    assert (tables[idx, : ids.numel()] == ids).all()
            plans.append(kept)
            want = reference.paged_decode_attention(q, kv, AttentionOptions(0.3))
            assert (out.double() - want).abs().max().item() < 1e-5
            steps += 1
            for s in seqs:  # the next token: a new block when the last one is full
                if s["len"] % block_size == 0:
                    s["blocks"].append(next(fresh))
                s["len"] += 1
    assert computed[0] == 3  # the first step, and after each change of the batch
