"""The reference itself (:mod:`batchgen.kernels.reference`), the yardstick of both backends: against dense attention
over contiguous K/V written independently of it (no block tables, one matrix product per head)."""

from __future__ import annotations

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
    args = (batch.q, batch.k_cache, batch.v_cache)
    dec = reference.paged_decode_attention(*args, batch.block_tables, batch.seq_lens, batch.scale)
    assert torch.equal(dec, reference_attention(batch))
