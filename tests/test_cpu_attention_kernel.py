"""The C paged decode attention kernel (kernels/csrc/paged_attention_cpu.c via kernels/cpu_kernel.py): equal to
the float64 reference and to the torch path, deterministic, and silently replaced by the torch path whenever
it cannot run (no compiler, a failed build, ``BATCHGEN_CPU_KERNEL=0``, unsupported dtype or layout)."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

from batchgen.kernels import PagedKV, cpu_kernel, reference
from batchgen.kernels import torch_backend as tb
from batchgen.kernels.options import AttentionOptions
from batchgen.kernels.testing import OPTION_CASES, attention_options, make_paged_batch, reference_attention

TOL = dict(atol=1e-5, rtol=1e-5)

needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")


@pytest.fixture(autouse=True)
def _fresh_kernel(monkeypatch):
    """Each test sees the kernel enabled and loads it under the session cache (conftest's BATCHGEN_CACHE)."""
    monkeypatch.delenv(cpu_kernel.ENV_SWITCH, raising=False)
    cpu_kernel.reset()
    yield
    cpu_kernel.reset()


def _lens(rng: random.Random, n: int, block_size: int, longest: int = 300) -> list[int]:
    """Mixed lengths: 1, exact block boundaries, short and long."""
    fixed = [1, block_size, 2 * block_size, block_size + 1, longest]
    return (fixed + [rng.randint(1, longest) for _ in range(n)])[: max(n, 1)]


def _kernel(batch, **options) -> torch.Tensor:
    out = cpu_kernel.decode(batch.q, batch.kv, batch.options(**options))
    assert out is not None, "the kernel did not serve the call"
    return out


@needs_compiler
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [
        ((4, 4), 64, 16),
        ((4, 2), 80, 8),
        ((8, 2), 128, 32),
        ((8, 1), 64, 8),
        ((16, 2), 80, 32),
        ((2, 2), 128, 16),
    ],
)
def test_matches_reference(heads, head_dim, block_size) -> None:
    hq, hkv = heads
    lens = _lens(random.Random(hq * head_dim + block_size), 12, block_size)
    batch = make_paged_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size)
    torch.testing.assert_close(_kernel(batch).double(), reference_attention(batch), **TOL)


@needs_compiler
@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("heads", [(4, 1), (8, 4)])
def test_options_match_reference(case, heads) -> None:
    hq, hkv = heads
    lens = _lens(random.Random(3), 10, 16, longest=120)
    batch = make_paged_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=16, seed=2)
    options = attention_options(case, hq)
    torch.testing.assert_close(
        _kernel(batch, **options).double(), reference_attention(batch, **options), **TOL
    )


@needs_compiler
@pytest.mark.parametrize("size", [1, 100])
def test_batch_sizes_equal_the_torch_path(size) -> None:
    lens = [157] if size == 1 else _lens(random.Random(size), size, 16, longest=90)
    batch = make_paged_batch(lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=size)
    args = (batch.q, batch.kv, batch.options())
    with_kernel = tb.paged_decode_attention(*args, workspace=tb.Workspace())  # the engine's call
    torch_path = tb.paged_decode_attention(*args)  # no workspace: the torch path
    assert not torch.equal(with_kernel, torch_path)  # really two implementations
    torch.testing.assert_close(with_kernel, torch_path, **TOL)
    if size == 1:
        torch.testing.assert_close(with_kernel.double(), reference_attention(batch), **TOL)


@needs_compiler
def test_strided_query_and_window_reads_no_block_before_it() -> None:
    from batchgen.kernels.testing import with_stale_blocks

    batch = make_paged_batch([70, 33, 5, 128], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    batch, stale = with_stale_blocks(batch, sliding_window=9)
    assert stale > 0
    wide = torch.randn(batch.q.shape[0], 4, 3 * 64)
    wide[:, :, 64:128] = batch.q
    strided = wide[:, :, 64:128]  # a view, as the engine's q of a fused projection may be
    out = cpu_kernel.decode(strided, batch.kv, batch.options(sliding_window=9))
    assert out is not None and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference_attention(batch, sliding_window=9), **TOL)


@needs_compiler
def test_deterministic_and_independent_of_threads_and_items(monkeypatch) -> None:
    batch = make_paged_batch(_lens(random.Random(5), 40, 16), num_q_heads=8, num_kv_heads=4, head_dim=64)
    threads = torch.get_num_threads()
    first = _kernel(batch)
    assert torch.equal(first, _kernel(batch))
    try:
        torch.set_num_threads(1)
        assert torch.equal(first, _kernel(batch))
    finally:
        torch.set_num_threads(threads)
    for heads in (1, 2, 4):  # KV heads per work item: every query head still computed the same way
        monkeypatch.setattr(cpu_kernel, "heads_per_item", lambda *a, n=heads: n)
        assert torch.equal(first, _kernel(batch))


@needs_compiler
def test_built_under_the_cache_root_not_the_source_tree() -> None:
    from batchgen.runtime.disk_cache import cache_root

    lib = cpu_kernel.library()
    assert lib is not None
    assert str(cache_root()) in lib._name
    assert not list(cpu_kernel.SOURCES[0].parent.glob("*.so"))


def _torch_fallback_equals_torch_path() -> None:
    batch = make_paged_batch([40, 17, 1, 64], num_q_heads=4, num_kv_heads=2, head_dim=64)
    args = (batch.q, batch.kv, batch.options())
    assert cpu_kernel.decode(*args) is None
    assert torch.equal(
        tb.paged_decode_attention(*args, workspace=tb.Workspace()), tb.paged_decode_attention(*args)
    )


def test_switched_off_by_environment(monkeypatch) -> None:
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    _torch_fallback_equals_torch_path()
    cpu_kernel.start_build()
    assert cpu_kernel.library() is None


def test_no_compiler_falls_back(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_kernel, "compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger=cpu_kernel.__name__):
        _torch_fallback_equals_torch_path()
    assert any("no C compiler" in r.getMessage() for r in caplog.records)
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == cpu_kernel.__name__)


def test_failed_build_falls_back(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "compiler", lambda: ["false"])  # runs, fails
    with caplog.at_level(logging.INFO, logger=cpu_kernel.__name__):
        cpu_kernel.start_build()  # in the background, as the engine does
        _torch_fallback_equals_torch_path()
    assert any("unavailable" in r.getMessage() for r in caplog.records)


@needs_compiler
def test_unsupported_inputs_are_not_served() -> None:
    batch = make_paged_batch([30, 9], num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    opts = batch.options()
    assert cpu_kernel.decode(batch.q, batch.kv, opts) is None
    q, k, v = batch.q.float(), batch.k_cache.float(), batch.v_cache.float()
    k_t = k.transpose(2, 3).contiguous().transpose(2, 3)  # head_dim not innermost in memory
    assert cpu_kernel.decode(q, PagedKV(k_t, v, batch.block_tables, batch.seq_lens), opts) is None
    assert cpu_kernel.decode(q, PagedKV(k, v, batch.block_tables, batch.seq_lens), opts) is not None


def test_heads_per_item_leaves_work_for_every_thread() -> None:
    assert cpu_kernel.heads_per_item(64, 4, 2, 2) == 4  # enough sequences: whole rows
    assert cpu_kernel.heads_per_item(1, 8, 4, 2) == 1  # one sequence: one item per kv head
    assert cpu_kernel.heads_per_item(2, 8, 1, 2) == 2
    assert cpu_kernel.heads_per_item(64, 2, 200, 1) == 1  # an item holds at most MAX_HEADS query heads


@needs_compiler
def test_engine_decodes_through_the_kernel_same_tokens(llama_ckpt: str, monkeypatch) -> None:
    from batchgen import LLM, SamplingParams

    calls = []
    real = cpu_kernel.decode
    monkeypatch.setattr(cpu_kernel, "decode", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 4096) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_kernel = LLM(llama_ckpt, num_blocks=128).generate(prompts, sp, use_tqdm=False)
    assert calls, "the CPU engine's decode did not reach the kernel"
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    calls.clear()
    torch_path = LLM(llama_ckpt, num_blocks=128).generate(prompts, sp, use_tqdm=False)
    assert not calls
    assert [o.outputs[0].token_ids for o in with_kernel] == [o.outputs[0].token_ids for o in torch_path]


@needs_compiler
def test_out_of_range_tables_are_refused_not_read() -> None:
    batch = make_paged_batch([40, 17], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    q, k, v, opts = batch.q, batch.k_cache, batch.v_cache, batch.options()
    bad_id = batch.block_tables.clone()
    bad_id[0, 1] = k.shape[0] + 1000  # a block id past the cache
    assert cpu_kernel.decode(q, PagedKV(k, v, bad_id, batch.seq_lens), opts) is None
    too_long = batch.seq_lens.clone()
    too_long[1] = batch.block_tables.shape[1] * 8 + 1  # more tokens than the table row holds
    assert cpu_kernel.decode(q, PagedKV(k, v, batch.block_tables, too_long), opts) is None
    assert cpu_kernel.decode(q, batch.kv, opts) is not None


@needs_compiler
@pytest.mark.parametrize("heads, block_size", [((8, 4), 16), ((4, 1), 8)])
def test_suffix_with_log_sum_exp_matches_a_float64_computation(heads, block_size) -> None:
    """decode_suffix: each sequence attends only to its keys from starts[b] on, and returns the log-sum-exp of
    those scaled logits (-inf and a zero output where it has none: a start at or past its length)."""
    hq, hkv = heads
    lens = _lens(random.Random(7), 10, block_size, longest=120)
    batch = make_paged_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=block_size)
    kv, scale = batch.kv, 0.2
    starts = torch.tensor([0 if n == 1 else (n // 2 if b % 3 else n - 1) for b, n in enumerate(lens)])
    starts[-1] = lens[-1]  # no key at all
    res = cpu_kernel.decode_suffix(batch.q, kv, scale, starts)
    assert res is not None
    out, lse = res
    block_size = kv.k_cache.shape[1]
    for b, n in enumerate(lens):
        pos = torch.arange(int(starts[b]), n)
        blocks = kv.block_tables[b, pos // block_size].long()
        k = kv.k_cache[blocks, pos % block_size].double()  # [n, Hkv, D]
        v = kv.v_cache[blocks, pos % block_size].double()
        for h in range(hq):
            if pos.numel() == 0:
                assert lse[b, h] == float("-inf") and not out[b, h].any()
                continue
            s = (k[:, h // (hq // hkv)] @ batch.q[b, h].double()) * scale
            torch.testing.assert_close(lse[b, h].double(), torch.logsumexp(s, 0), atol=1e-5, rtol=1e-5)
            want = torch.softmax(s, 0) @ v[:, h // (hq // hkv)]
            torch.testing.assert_close(out[b, h].double(), want, **TOL)


def _shared_prefix_batch(hq: int, hkv: int, head_dim: int, block_size: int, seed: int = 0):
    """A decode batch where 40 sequences share 5 leading blocks, 5 share 2, and 3 share nothing; block ids
    shuffled. Returns (q, kv, plan) with the kernel's cascade plan (every group kept)."""
    g = torch.Generator().manual_seed(seed)
    sizes, shared = [40, 5, 1, 1, 1], [5, 2, 0, 0, 0]
    nb, batch = 8, sum(sizes)
    num_blocks = batch * nb + 3
    tables = torch.randperm(num_blocks, generator=g)[: batch * nb].view(batch, nb).int()
    lens = torch.randint((max(shared) + 1) * block_size + 1, nb * block_size + 1, (batch,), generator=g)
    at = 0
    for n, s in zip(sizes, shared):
        tables[at : at + n, :s] = tables[at, :s]
        at += n
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g)
    q = torch.randn(batch, hq, head_dim, generator=g)
    kv = PagedKV(k, v, tables, lens.int())
    plan = tb._cascade_plan(tables, lens, block_size, torch.float32, 0.0, kernel=True)
    assert plan is not None and plan.prefix is not None and len(plan.groups) == 2
    return q, kv, plan


def _cascade(q, kv, plan, scale: float = 0.15) -> torch.Tensor:
    res = cpu_kernel.decode_suffix(q, kv, scale, plan.starts)
    assert res is not None
    out, lse = res
    assert cpu_kernel.merge_prefix(q, kv, scale, plan.prefix, out, lse), "the prefix half was refused"
    return out


@needs_compiler
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [
        ((8, 4), 64, 16),
        ((8, 2), 80, 8),
        ((4, 4), 128, 16),
        ((16, 2), 32, 32),
        ((4, 2), 40, 24),
        ((8, 4), 64, 12),
    ],
)
def test_cascade_prefix_merge_matches_reference(monkeypatch, heads, head_dim, block_size) -> None:
    """merge_prefix after decode_suffix: each group's prefix read once (a group of 40 spans three chunks of
    work), merged into the suffixes' results; equal to plain attention over the whole context."""
    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
    q, kv, plan = _shared_prefix_batch(*heads, head_dim, block_size)
    want = reference.paged_decode_attention(q, kv, AttentionOptions(0.15))
    torch.testing.assert_close(_cascade(q, kv, plan).double(), want, **TOL)
    # and through the engine's call, which plans the cascade itself
    out = tb.paged_decode_attention(q, kv, AttentionOptions(0.15), workspace=tb.Workspace(), plan_cache={})
    torch.testing.assert_close(out.double(), want, **TOL)


@needs_compiler
def test_cascade_prefix_deterministic_over_threads_and_chunks(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
    q, kv, plan = _shared_prefix_batch(8, 4, 64, 16, seed=3)
    first = _cascade(q, kv, plan)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(first, _cascade(q, kv, plan))
    finally:
        torch.set_num_threads(threads)
    for chunk in (1, 3, 64):  # sequences per work item: each query row is still computed the same way
        monkeypatch.setattr(cpu_kernel, "PREFIX_CHUNK", chunk)
        assert torch.equal(first, _cascade(q, kv, plan))


@needs_compiler
def test_cascade_prefix_refuses_out_of_range_blocks(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
    q, kv, plan = _shared_prefix_batch(8, 4, 64, 16)
    out, lse = cpu_kernel.decode_suffix(q, kv, 0.15, plan.starts)
    bad = dataclasses.replace(plan.prefix, tables=plan.prefix.tables.clone())
    bad.tables[0, 1] = kv.k_cache.shape[0]  # one past the last block
    assert not cpu_kernel.merge_prefix(q, kv, 0.15, bad, out.clone(), lse.clone())
    seqs = dataclasses.replace(plan.prefix, seqs=plan.prefix.seqs.clone())
    seqs.seqs[0] = q.shape[0]  # no such sequence
    assert not cpu_kernel.merge_prefix(q, kv, 0.15, seqs, out.clone(), lse.clone())


@needs_compiler
def test_generic_build_matches_reference(monkeypatch) -> None:
    """The plain-C loops (BATCHGEN_GENERIC, what a CPU without AVX2/FMA compiles) against the reference, for
    both the decode kernel and the cascade's prefix half."""
    lib = cpu_kernel._load(("BATCHGEN_GENERIC",))
    assert lib is not None
    monkeypatch.setitem(cpu_kernel._state, "lib", lib)
    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
    batch = make_paged_batch(_lens(random.Random(11), 12, 16), num_q_heads=8, num_kv_heads=2, head_dim=80)
    torch.testing.assert_close(_kernel(batch).double(), reference_attention(batch), **TOL)
    q, kv, plan = _shared_prefix_batch(8, 4, 64, 16, seed=5)
    want = reference.paged_decode_attention(q, kv, AttentionOptions(0.15))
    torch.testing.assert_close(_cascade(q, kv, plan).double(), want, **TOL)
    pre = make_paged_batch([90, 33], [90, 5], num_q_heads=8, num_kv_heads=2, head_dim=80)
    got = cpu_kernel.prefill(pre.q, pre.cu_seqlens_q, pre.kv, 0.2)
    assert got is not None
    torch.testing.assert_close(
        got[0].double(),
        reference.paged_prefill_attention(pre.q, pre.cu_seqlens_q, pre.kv, AttentionOptions(0.2)),
        **TOL,
    )


@needs_compiler
@pytest.mark.parametrize(
    "heads, head_dim, block_size",
    [
        ((8, 4), 64, 16),
        ((8, 2), 80, 8),
        ((4, 4), 128, 32),
        ((6, 3), 32, 16),
        ((4, 2), 40, 24),  # register tiles: a last 8 of the head dim, a last 8 keys of a block
        ((8, 4), 64, 12),  # a block size that is not a multiple of 8: the plain loops
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_reference(heads, head_dim, block_size, causal) -> None:
    """cpu_kernel.prefill: fresh prompts, chunks over a cached context, single tokens, one longer than a work
    item's chunk; the log-sum-exps against a float64 computation. Query rows per work item (chunk x group) that
    are not a multiple of the register tile's rows, causal rows ending inside a block."""
    hq, hkv = heads
    lens = [1, 37, 70, 200, 16, 90]
    q_lens = [1, 37, 9, 70, 1, 90]
    batch = make_paged_batch(
        lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size
    )
    res = cpu_kernel.prefill(batch.q, batch.cu_seqlens_q, batch.kv, 0.3, causal=causal, with_lse=True)
    assert res is not None
    out, lse = res
    cu = batch.cu_seqlens_q.tolist()
    kv = batch.kv
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        pos = torch.arange(n)
        blocks = kv.block_tables[b, pos // block_size].long()
        k = kv.k_cache[blocks, pos % block_size].double()
        v = kv.v_cache[blocks, pos % block_size].double()
        for i in range(m):
            visible = n - m + i + 1 if causal else n
            for h in range(hq):
                kh = h // (hq // hkv)
                s = (k[:visible, kh] @ batch.q[cu[b] + i, h].double()) * 0.3
                torch.testing.assert_close(
                    out[cu[b] + i, h].double(), torch.softmax(s, 0) @ v[:visible, kh], **TOL
                )
                torch.testing.assert_close(lse[cu[b] + i, h].double(), torch.logsumexp(s, 0), **TOL)


@needs_compiler
def test_prefill_deterministic_and_through_the_engine_call(monkeypatch) -> None:
    """Same bits for any thread count and chunking; paged_prefill_attention with a workspace (the engine's
    call) runs it and equals the reference."""
    batch = make_paged_batch([300, 64, 129], [300, 20, 129], num_q_heads=8, num_kv_heads=4, head_dim=64)
    first, _ = cpu_kernel.prefill(batch.q, batch.cu_seqlens_q, batch.kv, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(first, cpu_kernel.prefill(batch.q, batch.cu_seqlens_q, batch.kv, 0.125)[0])
    finally:
        torch.set_num_threads(threads)
    for chunk in (1, 7, 512):
        monkeypatch.setattr(cpu_kernel, "PREFILL_CHUNK", chunk)
        assert torch.equal(first, cpu_kernel.prefill(batch.q, batch.cu_seqlens_q, batch.kv, 0.125)[0])
    calls = []
    kernel_prefill = cpu_kernel.prefill
    monkeypatch.setattr(cpu_kernel, "prefill", lambda *a, **k: calls.append(1) or kernel_prefill(*a, **k))
    out = tb.paged_prefill_attention(
        batch.q, batch.cu_seqlens_q, batch.kv, AttentionOptions(0.125), workspace=tb.Workspace()
    )
    assert calls and torch.equal(out, first)
    want = reference.paged_prefill_attention(batch.q, batch.cu_seqlens_q, batch.kv, AttentionOptions(0.125))
    torch.testing.assert_close(out.double(), want, **TOL)


@needs_compiler
def test_prefill_refuses_out_of_range_tables() -> None:
    batch = make_paged_batch([40, 20], [40, 20], num_q_heads=4, num_kv_heads=2, head_dim=64)
    tables = batch.block_tables.clone()
    tables[1, 0] = batch.k_cache.shape[0]
    kv = PagedKV(batch.k_cache, batch.v_cache, tables, batch.seq_lens)
    assert cpu_kernel.prefill(batch.q, batch.cu_seqlens_q, kv, 0.1) is None
    short = PagedKV(
        batch.k_cache, batch.v_cache, batch.block_tables[:, :1], batch.seq_lens
    )  # table too narrow
    assert cpu_kernel.prefill(batch.q, batch.cu_seqlens_q, short, 0.1) is None
