"""The reference itself (:mod:`batchgen.kernels.reference`), the yardstick of both backends: against dense attention
over contiguous K/V written independently of it (no block tables, one matrix product per head), and its attention
options against transformers' own code: the sliding-window mask (``masking_utils``), Gemma 2's soft-capping and
gpt-oss's sinks (their eager attention functions)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchgen.kernels import reference
from batchgen.kernels.testing import PagedBatch, make_paged_batch, reference_attention


def contiguous_kv(batch: PagedBatch, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s K and V, ``[seq_len, Hkv, D]`` float64, read block by block."""
    block_size = batch.k_cache.shape[1]
    seq_len = int(batch.seq_lens[b])
    blocks = batch.block_tables[b, : -(-seq_len // block_size)].long()
    k = batch.k_cache[blocks].flatten(0, 1)[:seq_len].double()
    v = batch.v_cache[blocks].flatten(0, 1)[:seq_len].double()
    return k, v


def dense(batch: PagedBatch) -> torch.Tensor:
    """Per sequence: ``softmax(Q K^T * scale + causal mask) V`` with the queries' rows at the last positions."""
    outs = []
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    cu = batch.cu_seqlens_q.tolist()
    for b in range(len(batch.q_lens)):
        k, v = contiguous_kv(batch, b)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, Hq, D]
        q = batch.q[cu[b] : cu[b + 1]].double()  # [n, Hq, D]
        n, seq_len = q.shape[0], k.shape[0]
        scores = torch.einsum("nhd,lhd->hnl", q, k) * batch.scale
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]  # [n, L]
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("hnl,lhd->nhd", weights, v))
    return torch.cat(outs)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_reference_is_dense_causal_attention(block_size, num_q_heads, num_kv_heads):
    spec = [(1, 0), (9, 0), (5, 20), (1, 33), (16, 16)]  # (q_len, cached context)
    batch = make_paged_batch(
        [n + c for n, c in spec], [n for n, _ in spec], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=8, block_size=block_size, dtype=torch.bfloat16,
    )  # fmt: skip
    out = reference_attention(batch)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, dense(batch), atol=1e-12, rtol=1e-12)


def test_reference_decode_is_prefill_with_one_query_each():
    batch = make_paged_batch([1, 7, 40], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=8)
    dec = reference.paged_decode_attention(batch.q, batch.kv, batch.options())
    assert torch.equal(dec, reference_attention(batch))


def transformers_attention(batch: PagedBatch, sliding_window=None, softcap=None, sinks=None) -> torch.Tensor:
    """Each sequence through transformers' eager attention (Gemma 2's, or gpt-oss's for sinks), float64, with
    transformers' causal / sliding-window mask at the queries' absolute positions."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    group = batch.q.shape[1] // batch.k_cache.shape[2]
    module = SimpleNamespace(num_key_value_groups=group, training=False, sinks=sinks)
    mask_fn = (
        causal_mask_function
        if sliding_window is None
        else sliding_window_causal_mask_function(sliding_window)
    )
    cu = batch.cu_seqlens_q.tolist()
    outs = []
    for b in range(len(batch.q_lens)):
        k, v = contiguous_kv(batch, b)  # [L, Hkv, D]
        q = batch.q[cu[b] : cu[b + 1]].double()  # [n, Hq, D]
        n, seq_len = q.shape[0], k.shape[0]
        visible = mask_fn(0, 0, torch.arange(seq_len - n, seq_len)[:, None], torch.arange(seq_len)[None, :])
        mask = torch.zeros(n, seq_len, dtype=torch.float64).masked_fill(~visible, float("-inf"))[None, None]
        args = (module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
        if sinks is None:
            out, _ = gemma2_eager(*args, scaling=batch.scale, softcap=softcap)
        else:
            assert softcap is None, "gpt-oss has sinks, no soft-capping"
            module.sinks = sinks.double()
            out, _ = gpt_oss_eager(*args, scaling=batch.scale)
        outs.append(out[0])  # [n, Hq, D]
    return torch.cat(outs)


OPTIONS = {
    "causal": {},
    "window-1": dict(sliding_window=1),
    "window-5": dict(sliding_window=5),
    "window-16": dict(sliding_window=16),
    "window-37": dict(sliding_window=37),
    "softcap": dict(softcap=1.5),
    "window+softcap": dict(sliding_window=9, softcap=3.0),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 8.0, 0.0, -3.0])),
    "window+sinks": dict(sliding_window=7, sinks=torch.tensor([0.5, -1.0, 2.0, 8.0, 0.0, -3.0])),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_reference_options_follow_transformers(name):
    """Sliding window: a query at position p sees keys p - W < k <= p (itself and W - 1 before it), as
    transformers' ``sliding_window_causal_mask_function``; soft-capping as Gemma 2; sinks as gpt-oss."""
    spec = [(1, 0), (9, 0), (5, 20), (1, 33), (16, 16), (30, 3)]  # (q_len, cached context)
    batch = make_paged_batch(
        [n + c for n, c in spec], [n for n, _ in spec], num_q_heads=6, num_kv_heads=2, head_dim=8,
        block_size=8, dtype=torch.float64,
    )  # fmt: skip
    batch.q *= 3  # larger logits, so that soft-capping at 1.5 or 3 changes them a lot
    options = OPTIONS[name]
    expected = transformers_attention(batch, **options)
    # Gemma 2's eager softmax runs in float32 (gpt-oss's in the inputs' float64).
    tol = dict(atol=1e-12, rtol=1e-12) if "sinks" in options else dict(atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(reference_attention(batch, **options), expected, **tol)


def test_reference_window_wider_than_the_context_is_no_window():
    batch = make_paged_batch([40, 7], [13, 7], num_q_heads=2, num_kv_heads=1, head_dim=8, block_size=8)
    assert torch.equal(reference_attention(batch, sliding_window=40), reference_attention(batch))
