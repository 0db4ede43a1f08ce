"""The torch backend (the engine's CPU attention path) against the reference (:mod:`batchgen.kernels.reference`:
naive per-sequence float64 code), and the ``PagedAttention`` interface (store then attend, decode/prefill split,
backend resolution).

Tolerances: float32 inputs 1e-5 (absolute and relative); bfloat16 inputs 2e-2 (bf16 has an 8-bit mantissa:
the output alone rounds by up to 2^-8 relative), against a float64 computation on the same (rounded) values.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.attention import (
    AttentionMetadata,
    AttentionOptions,
    PagedAttention,
    TorchBackend,
    resolve_backend,
)
from batchgen.kernels import reference
from batchgen.kernels import torch_backend as tb
from batchgen.kernels.testing import (
    OPTION_CASES,
    attention_options,
    make_paged_batch,
    reference_attention,
    with_stale_blocks,
)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def ragged_lengths(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(block_size, num_q_heads, num_kv_heads, dtype):
    batch = make_paged_batch(
        ragged_lengths(block_size), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32,
        block_size=block_size, dtype=dtype, seed=block_size,
    )  # fmt: skip
    out = tb.paged_decode_attention(batch.q, batch.kv, batch.options())
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), reference_attention(batch), **TOL[dtype])


@pytest.mark.parametrize("head_dim", [64, 80])
def test_decode_uniform_lengths_and_workspace(head_dim):
    """All sequences equally long (no mask needed) and a reused workspace give the same answer."""
    ws = tb.Workspace()
    for lens in ([37, 37, 37], [5, 70, 33], [2, 2]):
        batch = make_paged_batch(lens, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, seed=len(lens))
        args = (batch.q, batch.kv, batch.options())
        out = tb.paged_decode_attention(*args, workspace=ws)
        torch.testing.assert_close(out.double(), reference_attention(batch), **TOL[torch.float32])


# (q_len, cached context) per sequence: single-token prompt, whole blocks, chunks straddling block boundaries,
# a short chunk after a long prefix (chunked prefill / prefix-cache hit).
PREFILL_CASES = {
    "ragged": [(1, 0), (15, 0), (16, 0), (17, 15), (5, 80), (40, 9)],
    "uniform": [(12, 20), (12, 20), (12, 21)],
    "single": [(33, 31)],
    "fresh": [(50, 0)],
}


@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(case, block_size, num_q_heads, num_kv_heads, dtype):
    spec = PREFILL_CASES[case]
    batch = make_paged_batch(
        [n + c for n, c in spec], [n for n, _ in spec], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=32, block_size=block_size, dtype=dtype, seed=7,
    )  # fmt: skip
    args = (batch.q, batch.cu_seqlens_q, batch.kv)
    expected = reference_attention(batch)
    out = tb.paged_prefill_attention(*args, batch.options())
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    # Both strategies (one padded SDPA call / one call per sequence) agree whichever the heuristic picks.
    padded = tb._prefill_padded(*args, batch.options(), tb.Workspace())
    torch.testing.assert_close(padded.double(), expected, **TOL[dtype])


# ------------------------------------------------------------------- attention options (issue 11)
@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_options_match_reference(case, block_size, num_q_heads, num_kv_heads, dtype):
    batch = make_paged_batch(
        ragged_lengths(block_size) + [40], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32,
        block_size=block_size, dtype=dtype, seed=block_size,
    )  # fmt: skip
    options = attention_options(case, num_q_heads)
    out = tb.paged_decode_attention(batch.q, batch.kv, batch.options(**options))
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), reference_attention(batch, **options), **TOL[dtype])


@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("spec", sorted(PREFILL_CASES))
@pytest.mark.parametrize("block_size", [8, 64])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_prefill_options_match_reference(case, spec, block_size, num_q_heads, num_kv_heads):
    """Prefix + causal chunks of every shape, each padding bucket strategy, under each option."""
    pairs = PREFILL_CASES[spec]
    batch = make_paged_batch(
        [n + c for n, c in pairs], [n for n, _ in pairs], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=32, block_size=block_size, seed=3,
    )  # fmt: skip
    options = attention_options(case, num_q_heads)
    args = (batch.q, batch.cu_seqlens_q, batch.kv)
    expected = reference_attention(batch, **options)
    out = tb.paged_prefill_attention(*args, batch.options(**options))
    torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])
    padded = tb._prefill_padded(*args, batch.options(**options), tb.Workspace())
    torch.testing.assert_close(padded.double(), expected, **TOL[torch.float32])


@pytest.mark.parametrize("window", [1, 8, 20])
def test_window_reads_no_block_before_it(window):
    """Block-table entries of blocks wholly before every window of a sequence are never read: here they point
    at a block of NaNs, and the outputs stay finite and exact."""
    decode = make_paged_batch([1, 8, 9, 50, 75], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    decode, stale = with_stale_blocks(decode, window)
    assert stale > 0
    out = tb.paged_decode_attention(decode.q, decode.kv, decode.options(sliding_window=window))
    torch.testing.assert_close(
        out.double(), reference_attention(decode, sliding_window=window), **TOL[torch.float32]
    )
    spec = [(1, 40), (3, 60), (30, 30), (50, 0)]
    prefill = make_paged_batch([n + c for n, c in spec], [n for n, _ in spec], num_q_heads=4, num_kv_heads=2,
                               head_dim=16, block_size=8)  # fmt: skip
    prefill, stale = with_stale_blocks(prefill, window)
    assert stale > 0
    for softcap in (None, 3.0):  # SDPA, and the explicit-score path
        out = tb.paged_prefill_attention(
            prefill.q,
            prefill.cu_seqlens_q,
            prefill.kv,
            prefill.options(sliding_window=window, softcap=softcap),
        )
        expected = reference_attention(prefill, sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])


def test_explicit_scores_in_query_chunks(monkeypatch):
    """The soft-capping / sinks path computes scores a chunk of queries at a time: same answer."""
    batch = make_paged_batch([70, 30], [50, 30], num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    options = dict(softcap=4.0, sinks=torch.tensor([1.0, -2.0]))
    args = (batch.q, batch.cu_seqlens_q, batch.kv)
    whole = tb.paged_prefill_attention(*args, batch.options(**options))
    monkeypatch.setattr(
        tb, "_EXPLICIT_SCORES_ELEMENTS", 2000
    )  # 2000 // (2 seqs * 2 heads * 80 keys) = 6 queries
    chunked = tb.paged_prefill_attention(*args, batch.options(**options))
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked.double(), reference_attention(batch, **options), **TOL[torch.float32])


def test_prefill_heuristic_picks_padded_for_uniform_batches(monkeypatch):
    calls = []
    real = tb._prefill_padded
    monkeypatch.setattr(tb, "_prefill_padded", lambda *a: calls.append(1) or real(*a))
    uniform = make_paged_batch([32, 32, 31], [8, 8, 8])
    tb.paged_prefill_attention(uniform.q, uniform.cu_seqlens_q, uniform.kv, uniform.options())
    assert calls == [1]
    ragged = make_paged_batch([600, 4, 3], [600, 4, 3])
    tb.paged_prefill_attention(ragged.q, ragged.cu_seqlens_q, ragged.kv, ragged.options())
    # A group is padded only while that at most doubles each member's work: the 600-token chunk runs alone,
    # the two short ones share one padded call.
    assert calls == [1, 1]
    assert tb._padding_buckets([600, 4, 3], [600, 4, 3]) == [[0], [1, 2]]
    # Chunks after a cached prefix group together even beside a long uncached prompt.
    assert tb._padding_buckets([347, 33, 33, 33], [347, 347, 346, 347]) == [[0], [1, 3, 2]]
    assert tb._padding_buckets([0, 5], [9, 5]) == [[1]]
    # Fresh prompts: padded and masked, a prompt costs its whole square where alone it costs half of it, so
    # long ones of similar length still run alone; short ones share a call (a call's fixed cost dominates).
    assert tb._padding_buckets([300, 280, 260], [300, 280, 260]) == [[0], [1], [2]]
    assert tb._padding_buckets([20, 18, 16], [20, 18, 16]) == [[0, 1, 2]]


def test_zero_cache_gives_finite_outputs():
    """The engine zero-initialises the cache; padding and masked positions never produce NaN."""
    batch = make_paged_batch([1, 3, 17], [1, 2, 17], num_q_heads=4, num_kv_heads=2, head_dim=16)
    batch.k_cache.zero_()
    batch.v_cache.zero_()
    dec = tb.paged_decode_attention(batch.q[:3], batch.kv, batch.options())
    pre = tb.paged_prefill_attention(batch.q, batch.cu_seqlens_q, batch.kv, batch.options())
    assert torch.equal(dec, torch.zeros_like(dec)) and torch.equal(pre, torch.zeros_like(pre))


@pytest.mark.parametrize("impl", [tb, reference], ids=["torch_backend", "reference"])
def test_store_kv_skips_negative_slots(impl):
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    impl.store_kv(key, value, k_cache, v_cache, torch.tensor([9, -1, 31]))
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[9], key[0]) and torch.equal(flat_k[31], key[2])
    assert torch.equal(flat_v[9], value[0]) and torch.equal(flat_v[31], value[2])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2


def test_store_kv_matches_reference_with_dtype_conversion():
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(5, 8, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(2)]
    key, value = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    slots = torch.tensor([0, 7, -1, 8, 39, -1])
    ref = [c.clone() for c in caches]
    reference.store_kv(key, value, *ref, slots)
    tb.store_kv(key, value, *caches, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("impl", [tb, reference], ids=["torch_backend", "reference"])
def test_copy_blocks_all_layers(impl):
    kv = torch.randn(3, 2, 6, 4, 2, 8)
    before = kv.clone()
    impl.copy_blocks(kv, torch.tensor([[0, 5], [2, 3]]))
    assert torch.equal(kv[:, :, 5], before[:, :, 0]) and torch.equal(kv[:, :, 3], before[:, :, 2])
    untouched = [0, 1, 2, 4]
    assert torch.equal(kv[:, :, untouched], before[:, :, untouched])


def _forward_case(q_lens, seq_lens, num_decode, dtype=torch.float32, block_size=8):
    """A packed batch whose new tokens' K/V are not in the cache yet, its metadata and the new K/V."""
    batch = make_paged_batch(
        seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size, dtype=dtype
    )
    tables = batch.block_tables.tolist()
    slots = []
    for b, (n, s) in enumerate(zip(q_lens, seq_lens)):
        slots += [tables[b][p // block_size] * block_size + p % block_size for p in range(s - n, s)]
    gen = torch.Generator().manual_seed(1)
    k_new = torch.randn(len(slots), 2, 16, generator=gen).to(dtype)
    v_new = torch.randn(len(slots), 2, 16, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decode_seqs=num_decode,
        seq_lens=batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        block_tables=batch.block_tables,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
    )
    return batch, k_new, v_new, meta


FORWARD_CASES = {
    "mixed": ([1, 1, 9, 4], [12, 1, 9, 30], 2),
    "prefill_only": ([1, 1, 9, 4], [12, 1, 9, 30], 0),
    "decode_only": ([1, 1, 1], [12, 1, 17], 3),
}


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
def test_paged_attention_torch_forward_stores_then_attends(case):
    q_lens, seq_lens, num_decode = FORWARD_CASES[case]
    batch, k_new, v_new, meta = _forward_case(q_lens, seq_lens, num_decode)
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    for i, s in enumerate(meta.slot_mapping.tolist()):
        expected_k.view(-1, 2, 16)[s] = k_new[i]
        expected_v.view(-1, 2, 16)[s] = v_new[i]
    attn = PagedAttention("torch")
    out = attn.forward(batch.q, k_new, v_new, batch.k_cache, batch.v_cache, meta, batch.options())
    assert torch.equal(batch.k_cache, expected_k) and torch.equal(batch.v_cache, expected_v)
    torch.testing.assert_close(out.double(), reference_attention(batch), **TOL[torch.float32])


@pytest.mark.parametrize("path", ["kernel", "cascade", "torch"])
def test_decode_step_stores_its_own_kv_on_every_path(monkeypatch, path):
    """An all-decode step: the C kernel writes the step's K/V as it attends (plain and cascade), the torch path
    stores them first; the cache ends the same, a slot of -1 writes nothing, the output is the reference's."""
    from batchgen.kernels import cpu_kernel

    if path == "torch":
        monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    elif cpu_kernel.library() is None:
        pytest.skip("batchgen's C kernels do not build here (no C compiler)")
    if path == "cascade":
        monkeypatch.setattr(cpu_kernel, "CASCADE_MIN_GROUP_BLOCKS", 0)
    seq_lens = [40, 37, 45, 33, 50, 41, 36, 39, 44]
    batch = make_paged_batch(seq_lens, [1] * 9, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    batch.block_tables[:, :4] = batch.block_tables[0, :4]  # every sequence shares its first 4 blocks
    tables = batch.block_tables.tolist()
    slots = [tables[b][(n - 1) // 8] * 8 + (n - 1) % 8 for b, n in enumerate(seq_lens)]
    slots[3] = -1  # a padding row: nothing stored
    gen = torch.Generator().manual_seed(2)
    k_new, v_new = torch.randn(9, 2, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            expected_k.view(-1, 2, 16)[s], expected_v.view(-1, 2, 16)[s] = k_new[i], v_new[i]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decode_seqs=9,
        seq_lens=batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        block_tables=batch.block_tables,
        max_seq_len=max(seq_lens),
        max_query_len=1,
    )
    calls = []
    real_store = tb.store_kv
    monkeypatch.setattr(tb, "store_kv", lambda *a: calls.append(1) or real_store(*a))
    out = PagedAttention("torch").forward(
        batch.q, k_new, v_new, batch.k_cache, batch.v_cache, meta, batch.options()
    )
    assert torch.equal(batch.k_cache, expected_k) and torch.equal(batch.v_cache, expected_v)
    assert calls == ([1] if path == "torch" else [])  # the kernel paths never store separately
    torch.testing.assert_close(out.double(), reference_attention(batch), **TOL[torch.float32])


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
@pytest.mark.parametrize("options_case", ["window-7", "all"])
def test_paged_attention_torch_forward_with_options(case, options_case):
    """Keyword-only options reach both the decode and the prefill part of a mixed batch."""
    batch, k_new, v_new, meta = _forward_case(*FORWARD_CASES[case])
    options = attention_options(options_case, 4)
    out = PagedAttention("torch").forward(
        batch.q, k_new, v_new, batch.k_cache, batch.v_cache, meta, batch.options(**options)
    )
    torch.testing.assert_close(out.double(), reference_attention(batch, **options), **TOL[torch.float32])


@pytest.mark.parametrize("bad", [dict(sliding_window=0), dict(softcap=0.0), dict(softcap=-1.0)])
def test_paged_attention_rejects_bad_options(bad):
    batch, k_new, v_new, meta = _forward_case(*FORWARD_CASES["mixed"])
    with pytest.raises(ValueError, match="must be"):
        PagedAttention("torch").forward(
            batch.q, k_new, v_new, batch.k_cache, batch.v_cache, meta, AttentionOptions(0.1, **bad)
        )


def test_paged_attention_takes_a_backend_object():
    """Any :class:`AttentionBackend` plugs in; a mixed batch is one decode call and one prefill call."""
    calls = []

    class Recording(TorchBackend):
        name = "recording"

        def decode(self, q, *args, **kwargs):
            calls.append(("decode", q.shape[0]))
            return super().decode(q, *args, **kwargs)

        def prefill(self, q, *args, **kwargs):
            calls.append(("prefill", q.shape[0]))
            return super().prefill(q, *args, **kwargs)

    batch, k_new, v_new, meta = _forward_case(*FORWARD_CASES["mixed"])
    attn = PagedAttention(Recording())
    assert attn.backend == "recording"
    out = attn.forward(batch.q, k_new, v_new, batch.k_cache, batch.v_cache, meta, batch.options())
    assert calls == [("decode", 2), ("prefill", 13)]
    torch.testing.assert_close(out.double(), reference_attention(batch), **TOL[torch.float32])


def test_resolve_backend(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cpu) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("flash", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    assert resolve_backend("triton", cpu) == "triton"


def test_paged_attention_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend"):
        PagedAttention("cuda")


@pytest.mark.parametrize("flash_with_lse", [True, False])
def test_prefill_after_prefix_with_and_without_the_lse_fast_path(monkeypatch, flash_with_lse):
    """A chunk after a cached prefix runs as prefix + causal square merged by log-sum-exp when the CPU flash
    op is available, else as one masked SDPA call: same answer."""
    if not flash_with_lse:
        monkeypatch.setattr(tb, "_CPU_FLASH_WITH_LSE", None)
    batch = make_paged_batch([70], [23], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    out = tb.paged_prefill_attention(batch.q, batch.cu_seqlens_q, batch.kv, batch.options())
    torch.testing.assert_close(out.double(), reference_attention(batch), **TOL[torch.float32])
