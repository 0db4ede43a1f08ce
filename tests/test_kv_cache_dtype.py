"""engine.kv_cache_dtype: each attention implementation over a narrow cache (bfloat16, float16, fp8 e4m3/e5m2)
against the float64 reference on the rounded K/V; the rounding itself; the pool counting narrower blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.kernels import kv_cache_dtype as kvd
from batchgen.kernels import torch_backend as tb
from batchgen.kernels.testing import make_paged_batch, reference_attention

NARROW = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
# The output of attention over rounded K/V, against float64 over the same rounded values: float32 arithmetic.
TOL = dict(atol=2e-5, rtol=2e-5)


def narrow_batch(batch, dtype):
    """(the batch with its caches in `dtype`, the batch with those rounded values in float32)."""
    k, v = kvd.narrow(batch.k_cache, dtype), kvd.narrow(batch.v_cache, dtype)
    return (
        dataclasses.replace(batch, k_cache=k, v_cache=v),
        dataclasses.replace(batch, k_cache=k.float(), v_cache=v.float()),
    )


def test_names_and_rounding() -> None:
    assert kvd.cache_dtype("auto", torch.float32) == torch.float32
    assert kvd.cache_dtype("fp8", torch.float32) == kvd.cache_dtype("fp8_e4m3", torch.bfloat16)
    assert kvd.cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="engine.kv_cache_dtype must be one of auto"):
        kvd.check("int4")
    x = torch.tensor([1e6, -1e6, 0.1, 3.0])
    assert kvd.round_trip(x, torch.float8_e4m3fn).tolist()[:2] == [448.0, -448.0]  # saturates
    assert kvd.round_trip(x, torch.float8_e5m2).tolist()[:2] == [57344.0, -57344.0]
    assert kvd.round_trip(x, torch.bfloat16)[3] == 3.0


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("workspace", [False, True])
def test_torch_decode_over_narrow_cache(dtype, workspace) -> None:
    batch = make_paged_batch([1, 15, 16, 17, 83], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    narrow, rounded = narrow_batch(batch, dtype)
    ws = tb.Workspace() if workspace else None
    out = tb.paged_decode_attention(narrow.q, narrow.kv, narrow.options(), workspace=ws)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_attention(rounded), **TOL)


@pytest.mark.parametrize("dtype", NARROW)
def test_torch_prefill_over_narrow_cache(dtype) -> None:
    spec = [(1, 0), (17, 15), (5, 80), (40, 9)]
    batch = make_paged_batch(
        [n + c for n, c in spec],
        [n for n, _ in spec],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
    )
    narrow, rounded = narrow_batch(batch, dtype)
    out = tb.paged_prefill_attention(
        narrow.q, narrow.cu_seqlens_q, narrow.kv, narrow.options(), workspace=tb.Workspace()
    )
    torch.testing.assert_close(out.double(), reference_attention(rounded), **TOL)


@pytest.mark.parametrize("dtype", NARROW)
def test_store_rounds_into_the_cache(dtype) -> None:
    k_cache, v_cache = torch.zeros(3, 4, 2, 8, dtype=dtype), torch.zeros(3, 4, 2, 8, dtype=dtype)
    key, value = torch.randn(5, 2, 8) * 100, torch.randn(5, 2, 8)
    slots = torch.tensor([0, 5, -1, 11, 7])
    tb.store_kv(key, value, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 2, 8).float()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], kvd.round_trip(key[i], dtype))
            assert torch.equal(v_cache.view(-1, 2, 8)[s].float(), kvd.round_trip(value[i], dtype))


# ------------------------------------------------------------------------------------------- the engine
BS = 16


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4096, (n,), generator=g).tolist() for n in lengths]


def _tokens(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in outs]


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_engine_narrow_cache_swap_prefix_cow_beam_unchanged(llama_ckpt, kv) -> None:
    """With a narrow cache the engine's block machinery changes nothing: a pool small enough for many
    preemptions (swap and recompute), prefix caching off, and beam groups (copy-on-write) all give the tokens
    of a large pool, and the cache really is narrow."""
    from batchgen import LLM, SamplingParams

    shared = _prompts([BS + 3], seed=40)[0]
    prompts = [shared + p for p in _prompts([1, BS, 9, BS + 1], seed=41)] + _prompts([BS + 3, 12], seed=42)
    params = [
        SamplingParams(beam_width=3, n=2, max_tokens=16, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ref_llm = LLM(llama_ckpt, num_blocks=256, block_size=BS, kv_cache_dtype=kv)
    assert ref_llm.engine.runner.kv_cache.dtype == kvd.cache_dtype(kv, torch.float32)
    ref = _tokens(ref_llm.generate(prompts, params, use_tqdm=False))
    for opts in (
        dict(num_blocks=14, preemption_mode="swap", num_swap_blocks=64),
        dict(num_blocks=14, preemption_mode="recompute"),
        dict(num_blocks=256, enable_prefix_caching=False),
    ):
        llm = LLM(llama_ckpt, block_size=BS, kv_cache_dtype=kv, **opts)
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == ref, opts
        if opts["num_blocks"] == 14:
            assert llm.engine.stats.num_preemptions > 0
        if opts.get("preemption_mode") == "swap":
            assert llm.engine.stats.num_swapped_out_blocks > 0
    assert ref_llm.engine.stats.num_cow_copies > 0


def test_pool_counts_narrower_blocks(llama_ckpt) -> None:
    from batchgen import LLM

    blocks = {
        kv: LLM(
            llama_ckpt, block_size=BS, kv_cache_memory="1MiB", kv_cache_dtype=kv
        ).engine.runner.kv_cache.shape[2]
        for kv in ("auto", "bfloat16", "fp8")
    }
    assert blocks["bfloat16"] == 2 * blocks["auto"] and blocks["fp8"] == 4 * blocks["auto"]


# ------------------------------------------------------------------------------- the CPU C kernels
from batchgen.kernels import cpu_kernel, reference  # noqa: E402
from batchgen.kernels.options import AttentionOptions  # noqa: E402
from batchgen.kernels.paged_kv import PagedKV  # noqa: E402

needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")


@pytest.fixture
def _kernel(monkeypatch):
    monkeypatch.delenv(cpu_kernel.ENV_SWITCH, raising=False)
    cpu_kernel.reset()
    yield
    cpu_kernel.reset()


def _shared_prefix(dtype, head_dim: int = 64, block_size: int = 16):
    """40 decode sequences sharing 5 blocks, 5 sharing 2, 3 alone; caches in `dtype` and rounded in float32."""
    g = torch.Generator().manual_seed(9)
    sizes, shared, nb = [40, 5, 1, 1, 1], [5, 2, 0, 0, 0], 8
    batch = sum(sizes)
    num_blocks = batch * nb + 3
    tables = torch.randperm(num_blocks, generator=g)[: batch * nb].view(batch, nb).int()
    lens = torch.randint(6 * block_size + 1, nb * block_size + 1, (batch,), generator=g)
    at = 0
    for n, s in zip(sizes, shared):
        tables[at : at + n, :s] = tables[at, :s]
        at += n
    k = kvd.narrow(torch.randn(num_blocks, block_size, 2, head_dim, generator=g), dtype)
    v = kvd.narrow(torch.randn(num_blocks, block_size, 2, head_dim, generator=g), dtype)
    q = torch.randn(batch, 8, head_dim, generator=g)
    return q, PagedKV(k, v, tables, lens.int()), PagedKV(k.float(), v.float(), tables, lens.int())


@needs_compiler
@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("dtype", NARROW)
def test_cpu_kernels_widen_narrow_caches(_kernel, monkeypatch, dtype, generic) -> None:
    """Decode (with the step's own rows stored rounded), prefill and the cascade's prefix half, AVX2 and plain C,
    against the float64 reference over the rounded K/V."""
    if generic:
        lib = cpu_kernel._load(("BATCHGEN_GENERIC",))
        assert lib is not None
        monkeypatch.setitem(cpu_kernel._state, "lib", lib)
    monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
    batch = make_paged_batch(
        [1, 15, 16, 17, 83, 40], num_q_heads=8, num_kv_heads=2, head_dim=80, block_size=16
    )
    narrow, rounded = narrow_batch(batch, dtype)
    assert cpu_kernel.supports(narrow.q, narrow.k_cache, narrow.v_cache)
    out = cpu_kernel.decode(narrow.q, narrow.kv, narrow.options())
    assert out is not None
    torch.testing.assert_close(out.double(), reference_attention(rounded), **TOL)
    # the step's own K/V: rounded into the cache, then attended
    new_k, new_v = torch.randn(6, 2, 80), torch.randn(6, 2, 80)
    lens = batch.seq_lens.long() - 1
    slots = (batch.block_tables.long().gather(1, (lens // 16)[:, None])[:, 0] * 16 + lens % 16).contiguous()
    new = cpu_kernel.NewKV(new_k, new_v, slots)
    out = cpu_kernel.decode(narrow.q, narrow.kv, narrow.options(), new)
    assert out is not None and new.written
    flat_k, flat_v = rounded.k_cache.view(-1, 2, 80), rounded.v_cache.view(-1, 2, 80)
    flat_k[slots], flat_v[slots] = kvd.round_trip(new_k, dtype), kvd.round_trip(new_v, dtype)
    assert torch.equal(narrow.k_cache.float(), rounded.k_cache)
    torch.testing.assert_close(out.double(), reference_attention(rounded), **TOL)
    # prefill over a cached context
    pre = make_paged_batch(
        [90, 33, 17], [90, 5, 17], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16
    )
    pn, pr = narrow_batch(pre, dtype)
    got = cpu_kernel.prefill(pn.q, pn.cu_seqlens_q, pn.kv, 0.2)
    assert got is not None
    want = reference.paged_prefill_attention(pr.q, pr.cu_seqlens_q, pr.kv, AttentionOptions(0.2))
    torch.testing.assert_close(got[0].double(), want, **TOL)
    # cascade: suffixes and each shared prefix once, through the engine's call
    q, kv, kv_rounded = _shared_prefix(dtype)
    want = reference.paged_decode_attention(q, kv_rounded, AttentionOptions(0.15))
    merged, real = [], cpu_kernel.merge_prefix
    monkeypatch.setattr(cpu_kernel, "merge_prefix", lambda *a: merged.append(real(*a)) or merged[-1])
    out = tb.paged_decode_attention(q, kv, AttentionOptions(0.15), workspace=tb.Workspace(), plan_cache={})
    assert merged == [True]  # the prefix half ran in C over the narrow cache
    torch.testing.assert_close(out.double(), want, **TOL)


@needs_compiler
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 2), (16, 2)])
def test_cpu_decode_over_a_narrow_cache_is_the_float32_kernel_on_the_rounded_values(_kernel, heads) -> None:
    """Every GQA group (tokens read in chunks for groups 1, 2, 4 and multiples of 8, one at a time otherwise) and
    lengths that end mid-chunk: a narrow cache gives bit for bit the float32 cache's result on its values, and
    that is the float64 reference's within float32 rounding."""
    hq, hkv = heads
    batch = make_paged_batch(
        [1, 3, 15, 16, 17, 70], num_q_heads=hq, num_kv_heads=hkv, head_dim=64, block_size=16
    )
    want = cpu_kernel.decode(batch.q, batch.kv, batch.options())
    torch.testing.assert_close(want.double(), reference_attention(batch), **TOL)
    for dtype in NARROW:
        narrow, rounded = narrow_batch(batch, dtype)
        got = cpu_kernel.decode(narrow.q, narrow.kv, narrow.options())
        assert torch.equal(got, cpu_kernel.decode(rounded.q, rounded.kv, rounded.options())), dtype


@needs_compiler
def test_cpu_decode_e4m3_spans_with_nan_codes_read_as_they_are(_kernel) -> None:
    """e4m3fn spans without a NaN code are read at 2^-8 of their value (scaled back exactly); a token whose K or V
    holds a NaN code (0x7f, 0xff) is read as it is: the result is bit for bit the kernel's over a float32 cache of
    the same values (a NaN value reaches its sequence's heads)."""
    batch = make_paged_batch([17, 40, 33], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=3)
    narrow, _ = narrow_batch(batch, torch.float8_e4m3fn)
    k_codes = narrow.k_cache.view(torch.uint8).view(-1, 2, 64)
    v_codes = narrow.v_cache.view(torch.uint8).view(-1, 2, 64)

    def slot(b: int, t: int) -> int:
        return int(batch.block_tables[b, t // 16]) * 16 + t % 16

    k_codes[slot(1, 5), 0, 3] = 0x7F
    v_codes[slot(2, 7), 1, 0] = 0xFF
    rounded = dataclasses.replace(batch, k_cache=narrow.k_cache.float(), v_cache=narrow.v_cache.float())
    out = cpu_kernel.decode(narrow.q, narrow.kv, narrow.options())
    wide = cpu_kernel.decode(rounded.q, rounded.kv, rounded.options())
    assert out is not None and wide is not None
    assert torch.equal(out.isnan(), wide.isnan()) and torch.equal(out.nan_to_num(), wide.nan_to_num())
    assert out[2, 2:, 0].isnan().all() and out[:2].isfinite().all()
    torch.testing.assert_close(out[0].double(), reference_attention(rounded)[0], **TOL)


# ------------------------------------------------------------------------- the Triton kernels (interpreter)
@pytest.mark.parametrize("dtype", NARROW)
def test_triton_kernels_over_narrow_caches(dtype) -> None:
    """Store (rounded exactly as the torch backend rounds), copy, decode and prefill over a narrow cache, in
    Triton's interpreter on the CPU, against the float64 reference over the rounded K/V."""
    pytest.importorskip("triton")
    from batchgen.kernels.copy_blocks import copy_blocks
    from batchgen.kernels.decode_attention import paged_decode_attention
    from batchgen.kernels.prefill_attention import paged_prefill_attention
    from batchgen.kernels.store_kv import store_kv

    k_cache, v_cache = torch.zeros(4, 8, 2, 16, dtype=dtype), torch.zeros(4, 8, 2, 16, dtype=dtype)
    key, value = torch.randn(3, 2, 16) * 1000, torch.randn(3, 2, 16)
    store_kv(key, value, k_cache, v_cache, torch.tensor([0, 9, -1]))
    assert torch.equal(k_cache.view(-1, 2, 16)[9].float(), kvd.round_trip(key[1], dtype))
    assert torch.equal(v_cache.view(-1, 2, 16)[0].float(), kvd.round_trip(value[0], dtype))
    pool = torch.stack([k_cache, v_cache])[None].contiguous()
    copy_blocks(pool, torch.tensor([[1, 3]]))
    assert torch.equal(pool[0, :, 3].float(), pool[0, :, 1].float())

    batch = make_paged_batch([1, 17, 40], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    narrow, rounded = narrow_batch(batch, dtype)
    out = paged_decode_attention(narrow.q, narrow.kv, narrow.options(), max_seq_len=narrow.max_seq_len)
    torch.testing.assert_close(out.double(), reference_attention(rounded), **TOL)
    spec = [(1, 0), (17, 15), (5, 40)]
    batch = make_paged_batch(
        [n + c for n, c in spec],
        [n for n, _ in spec],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
    )
    narrow, rounded = narrow_batch(batch, dtype)
    out = paged_prefill_attention(
        narrow.q, narrow.cu_seqlens_q, narrow.kv, narrow.options(), max_query_len=narrow.max_query_len
    )
    torch.testing.assert_close(out.double(), reference_attention(rounded), **TOL)


def test_the_config_accepts_exactly_the_kernels_cache_dtypes() -> None:
    from batchgen.engine import config as engine_config
    from batchgen.kernels import kv_cache_dtype as kernel_dtypes

    assert engine_config.KV_CACHE_DTYPES == kernel_dtypes.KV_CACHE_DTYPES
