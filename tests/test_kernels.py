"""Every Triton kernel against the reference (:mod:`batchgen.kernels.reference`: naive per-sequence float64 code).

``device="cpu"`` runs the kernels in Triton's interpreter (CPU tensors always are; no GPU needed, and
``TRITON_INTERPRET=1`` is not required — see ``batchgen/kernels/_jit.py``); ``device="cuda"`` (marker ``gpu``,
skipped without a GPU) runs the same cases compiled for real. Shapes stay small: the interpreter executes every
program of the grid in Python.

Tolerances (kernel vs the float64 reference on the same rounded inputs): float32 2e-5 absolute and relative
(float32 accumulation; the GPU's ``exp2`` is approximate); bfloat16/float16 2e-2 (the outputs round to an 8-bit /
11-bit mantissa, and on the GPU the softmax weights are rounded to the cache dtype before ``P @ V``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen.attention import AttentionMetadata, PagedAttention  # noqa: E402
from batchgen.kernels import reference  # noqa: E402
from batchgen.kernels.copy_blocks import copy_blocks  # noqa: E402
from batchgen.kernels.decode_attention import (  # noqa: E402
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
)
from batchgen.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from batchgen.kernels.store_kv import store_kv  # noqa: E402
from batchgen.kernels.testing import (  # noqa: E402
    OPTION_CASES,
    PagedBatch,
    attention_options,
    make_paged_batch,
    reference_attention,
    with_stale_blocks,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
}
GQA = [(2, 2), (8, 2), (8, 1)]  # (num_q_heads, num_kv_heads): ratios 1, 4, 8


def ragged_lengths(block_size: int) -> list[int]:
    """Lengths 1, bs-1, bs, bs+1 and many blocks."""
    return [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]


def to_device(batch: PagedBatch, device: str) -> PagedBatch:
    return PagedBatch(
        q=batch.q.to(device), k_cache=batch.k_cache.to(device), v_cache=batch.v_cache.to(device),
        block_tables=batch.block_tables.to(device), seq_lens=batch.seq_lens.to(device),
        cu_seqlens_q=batch.cu_seqlens_q.to(device), q_lens=batch.q_lens, scale=batch.scale,
    )  # fmt: skip


def decode_ref(batch: PagedBatch, **options) -> torch.Tensor:
    assert batch.max_query_len == 1
    return reference_attention(batch, **options)


prefill_ref = reference_attention


def run_decode(batch: PagedBatch, device: str, num_splits=None, max_seq_len=None, **options) -> torch.Tensor:
    b = to_device(batch, device)
    out = paged_decode_attention(
        b.q, b.kv, b.options(**options), num_splits=num_splits, max_seq_len=max_seq_len
    )
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    return out.cpu()


def run_prefill(batch: PagedBatch, device: str, max_query_len=None, **options) -> torch.Tensor:
    b = to_device(batch, device)
    out = paged_prefill_attention(
        b.q, b.cu_seqlens_q, b.kv, b.options(**options), max_query_len=max_query_len
    )
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    return out.cpu()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """``out`` (the kernel's, in the inputs' dtype) against the float64 reference ``ref``."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[out.dtype])


# --------------------------------------------------------------------------------------------- store_kv
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 64])
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_store_kv(device, block_size, src_dtype, cache_dtype):
    num_blocks, num_kv_heads, head_dim = 4, 2, 80
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    # key/value as strided views of a fused qkv projection (token stride != Hkv * D)
    qkv = torch.randn(7, 3, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor(
        [0, block_size - 1, -1, block_size, 3 * block_size + 5, -1, num_blocks * block_size - 1]
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, ref_k, ref_v, slots)
    kc, vc = k_cache.to(device), v_cache.to(device)
    store_kv(key.to(device), value.to(device), kc, vc, slots.to(device))
    if src_dtype == cache_dtype:
        assert torch.equal(kc.cpu(), ref_k) and torch.equal(vc.cpu(), ref_v)
    else:  # Triton's interpreter truncates float32 -> bfloat16 where torch rounds to nearest: 1 ulp apart
        torch.testing.assert_close(kc.cpu(), ref_k, atol=0, rtol=2**-7)
        torch.testing.assert_close(vc.cpu(), ref_v, atol=0, rtol=2**-7)


# ------------------------------------------------------------------------------------------ copy_blocks
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks(device, dtype):
    kv = torch.randn(3, 2, 8, 16, 2, 80).to(dtype)
    mapping = torch.tensor([[0, 5], [2, 3], [7, 6]])
    ref = kv.clone()
    reference.copy_blocks(ref, mapping)
    out = kv.to(device)
    copy_blocks(out, mapping.to(device))
    assert torch.equal(out.cpu(), ref)
    copy_blocks(out, mapping[:0].to(device))  # no copies: no launch, no change
    assert torch.equal(out.cpu(), ref)


# ------------------------------------------------------------------------------------- decode attention
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_ragged(device, block_size, num_q_heads, num_kv_heads, num_splits):
    batch = make_paged_batch(
        ragged_lengths(block_size), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32,
        block_size=block_size, seed=block_size + num_q_heads,
    )  # fmt: skip
    assert_close(run_decode(batch, device, num_splits=num_splits), decode_ref(batch))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_head_sizes(device, head_dim, num_splits):
    batch = make_paged_batch([1, 17, 40], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, seed=head_dim)
    assert_close(run_decode(batch, device, num_splits=num_splits), decode_ref(batch))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_half_precision(device, dtype, num_q_heads, num_kv_heads, num_splits):
    batch = make_paged_batch(
        ragged_lengths(16), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=80, block_size=16,
        dtype=dtype,
    )  # fmt: skip
    assert_close(run_decode(batch, device, num_splits=num_splits), decode_ref(batch))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_long_context_split_k(device):
    """A long context over many blocks, more splits than some sequences have tiles (empty splits)."""
    batch = make_paged_batch([1000, 3, 130], num_q_heads=8, num_kv_heads=1, head_dim=64, block_size=16)
    ref = decode_ref(batch)
    for num_splits in (1, 8, None):
        assert_close(run_decode(batch, device, num_splits=num_splits), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_zero_cache_is_finite(device):
    batch = make_paged_batch([1, 7, 33], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    batch.k_cache.zero_()
    batch.v_cache.zero_()
    for num_splits in (1, 4):
        out = run_decode(batch, device, num_splits=num_splits)
        assert torch.equal(out, torch.zeros_like(out))


def test_choose_num_splits():
    # plenty of (sequence, kv head) programs or short contexts: single pass
    assert choose_num_splits(256, 8, 32768, num_sms=132) == 1
    assert choose_num_splits(1, 8, 300, num_sms=132) == 1
    # one long sequence: split to fill the GPU, capped by tokens per split and MAX_SPLITS
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 33
    assert choose_num_splits(1, 1, 32768, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(1, 8, 1024, num_sms=132) == 4


# ------------------------------------------------------------------------------------ prefill attention
# (q_len, cached context) per sequence: a single-token prompt, block-boundary chunks, a chunk straddling a
# boundary after a partial block, a short chunk after a long prefix (chunked prefill / prefix-cache hit).
PREFILL_SPEC = [(1, 0), (15, 0), (16, 0), (17, 15), (5, 80), (40, 9)]


def prefill_batch(spec, **kw) -> PagedBatch:
    return make_paged_batch([n + c for n, c in spec], [n for n, _ in spec], **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
def test_prefill_ragged(device, block_size, num_q_heads, num_kv_heads):
    batch = prefill_batch(
        PREFILL_SPEC, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=block_size,
        seed=block_size,
    )  # fmt: skip
    assert_close(run_prefill(batch, device), prefill_ref(batch))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_prefill_head_sizes(device, head_dim):
    batch = prefill_batch([(20, 0), (7, 19)], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, seed=head_dim)
    assert_close(run_prefill(batch, device), prefill_ref(batch))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_prefill_half_precision(device, dtype, num_q_heads, num_kv_heads):
    batch = prefill_batch(
        [(1, 0), (17, 15), (33, 40)], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=80,
        dtype=dtype,
    )  # fmt: skip
    assert_close(run_prefill(batch, device), prefill_ref(batch))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_long_chunk_and_group_of_seven(device):
    """A chunk spanning several query tiles, and GQA with a non-power-of-2 group (14 q / 2 kv heads, as
    Qwen2-7B's 28 / 4)."""
    batch = prefill_batch([(45, 0), (20, 30)], num_q_heads=14, num_kv_heads=2, head_dim=16, seed=3)
    assert_close(run_prefill(batch, device), prefill_ref(batch))
    assert_close(run_prefill(batch, device, max_query_len=256), prefill_ref(batch))  # loose bound is fine


# -------------------------------------------------------------------- attention options (issue 11)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_options(device, case, block_size, num_splits):
    batch = make_paged_batch(
        ragged_lengths(block_size) + [100], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=block_size,
        seed=block_size,
    )  # fmt: skip
    options = attention_options(case, 8)
    assert_close(run_decode(batch, device, num_splits=num_splits, **options), decode_ref(batch, **options))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("block_size,num_q_heads,num_kv_heads", [(8, 2, 2), (64, 8, 2)])
def test_prefill_options(device, case, block_size, num_q_heads, num_kv_heads):
    batch = prefill_batch(
        PREFILL_SPEC, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=block_size,
        seed=block_size,
    )  # fmt: skip
    options = attention_options(case, num_q_heads)
    assert_close(run_prefill(batch, device, **options), prefill_ref(batch, **options))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [3, 24, 40, 70])
def test_prefill_window_across_query_tiles(device, window):
    """Long chunks (several query tiles each) after short and long prefixes: windows narrower than a query
    tile, than a key tile, and wider, so each tile has masked head tiles, unmasked tiles and the diagonal in
    every combination."""
    batch = prefill_batch([(45, 0), (20, 100), (70, 30)], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=5)
    assert_close(run_prefill(batch, device, sliding_window=window), prefill_ref(batch, sliding_window=window))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 8, 20])
def test_window_reads_no_block_before_it(device, window):
    """Block-table entries of blocks wholly before every window of a sequence are never read (nor are the
    blocks): they point at a block of NaNs here, and the outputs stay finite and exact."""
    decode, stale = with_stale_blocks(
        make_paged_batch([1, 8, 9, 50, 75], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8), window
    )
    assert stale > 0
    for num_splits in (1, 3):
        out = run_decode(decode, device, num_splits=num_splits, sliding_window=window)
        assert_close(out, decode_ref(decode, sliding_window=window))
    prefill, stale = with_stale_blocks(
        prefill_batch([(1, 40), (3, 60), (30, 30), (50, 0)], num_q_heads=4, num_kv_heads=2, head_dim=16,
                      block_size=8),
        window,
    )  # fmt: skip
    assert stale > 0
    assert_close(
        run_prefill(prefill, device, sliding_window=window), prefill_ref(prefill, sliding_window=window)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_options_half_precision(device, dtype):
    options = attention_options("all", 8)
    dec = make_paged_batch(ragged_lengths(16) + [90], num_q_heads=8, num_kv_heads=2, head_dim=80, dtype=dtype)
    for num_splits in (1, 3):
        assert_close(run_decode(dec, device, num_splits=num_splits, **options), decode_ref(dec, **options))
    pre = prefill_batch([(1, 0), (17, 15), (33, 40)], num_q_heads=8, num_kv_heads=2, head_dim=80, dtype=dtype)
    assert_close(run_prefill(pre, device, **options), prefill_ref(pre, **options))


# ------------------------------------------------------------------------------ PagedAttention (triton)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options_case", [None, "all"])
def test_paged_attention_triton_and_torch_match_reference(device, dtype, options_case):
    """Store + decode + prefill through the engine's interface, decodes first, as the model calls it."""
    q_lens, seq_lens, block_size = [1, 1, 1, 9, 20], [12, 1, 40, 9, 30], 8
    batch = make_paged_batch(
        seq_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype
    )
    tables = batch.block_tables.tolist()
    slots = [
        tables[b][p // block_size] * block_size + p % block_size
        for b, (n, s) in enumerate(zip(q_lens, seq_lens))
        for p in range(s - n, s)
    ]
    k_new = torch.randn(len(slots), 2, 64).to(dtype)
    v_new = torch.randn(len(slots), 2, 64).to(dtype)
    options = {} if options_case is None else attention_options(options_case, 8)

    def run(backend: str, dev: str):
        b = to_device(batch, dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), num_decode_seqs=3,
            seq_lens=b.seq_lens, cu_seqlens_q=b.cu_seqlens_q, block_tables=b.block_tables,
            max_seq_len=max(seq_lens), max_query_len=max(q_lens),
        )  # fmt: skip
        out = PagedAttention(backend).forward(
            b.q, k_new.to(dev), v_new.to(dev), b.k_cache, b.v_cache, meta, b.options(**options)
        )
        return out.cpu(), b.k_cache.cpu(), b.v_cache.cpu()

    out, k_cache, v_cache = run("triton", device)
    torch_out, ref_k, ref_v = run("torch", "cpu")
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    stored = PagedBatch(**{**vars(batch), "k_cache": ref_k, "v_cache": ref_v})
    expected = reference_attention(stored, **options)
    assert_close(out, expected)
    assert_close(torch_out, expected)
