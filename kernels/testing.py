"""Random paged batches for the kernel tests and benchmarks (no Triton needed).

:func:`make_paged_batch` lays ``B`` sequences out in a paged cache the way the engine does: each sequence gets
``ceil(seq_len / block_size)`` physical blocks drawn from a shuffled pool (so tables are non-contiguous and
unordered), tables are padded with block 0, and the packed queries of sequence ``b`` are its last
``q_lens[b]`` tokens. Every cache slot, used or not, holds random values, so a kernel that reads past a
sequence's length or through a padding entry gives a wrong answer instead of a lucky zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .options import AttentionOptions
from .paged_kv import PagedKV


@dataclass
class PagedBatch:
    q: Tensor  # [T, Hq, D] packed queries (decode: T == B)
    k_cache: Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor
    block_tables: Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: Tensor  # [B] int32
    cu_seqlens_q: Tensor  # [B+1] int32
    q_lens: list[int]
    scale: float

    @property
    def kv(self) -> PagedKV:
        """The caches, block tables and lengths as the attention operations take them."""
        return PagedKV(self.k_cache, self.v_cache, self.block_tables, self.seq_lens)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    def options(self, **options) -> AttentionOptions:
        """This batch's scale with the keyword ``options`` (``sliding_window``, ``softcap``, ``sinks``)."""
        return AttentionOptions(self.scale, **options)

    def kv_bytes_read(self) -> int:
        """Bytes of K and V a kernel must read: every context token's K and V rows of every kv head."""
        _, _, hkv, d = self.k_cache.shape
        return 2 * int(self.seq_lens.sum()) * hkv * d * self.k_cache.element_size()


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int] | None = None,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    extra_blocks: int = 3,
    shuffle: bool = True,
    seed: int = 0,
) -> PagedBatch:
    """``q_lens`` defaults to one query per sequence (decode). ``q_lens[b] <= seq_lens[b]``."""
    if q_lens is None:
        q_lens = [1] * len(seq_lens)
    assert len(q_lens) == len(seq_lens) and all(1 <= n <= s for n, s in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return PagedBatch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        q_lens=list(q_lens),
        scale=head_dim**-0.5,
    )


def reference_attention(batch: PagedBatch, **options) -> Tensor:
    """:func:`.reference.paged_prefill_attention` (float64) of ``batch``'s packed queries: the expected output of
    both backends' prefill, and of their decode when every ``q_len`` is 1."""
    from .reference import paged_prefill_attention

    return paged_prefill_attention(batch.q, batch.cu_seqlens_q, batch.kv, batch.options(**options))


def with_stale_blocks(batch: PagedBatch, sliding_window: int) -> tuple[PagedBatch, int]:
    """``batch`` with every block-table entry of a block that lies entirely before all of its sequence's query
    windows (``sliding_window``) pointing at a new block of NaNs, as a KV-cache manager that frees such blocks
    might leave them. A kernel that reads one of them (even masked: ``0 * NaN``) returns NaNs; one that skips
    them returns the reference output. Also returns how many entries were replaced."""
    block_size = batch.k_cache.shape[1]
    nan_block = torch.full_like(batch.k_cache[:1], float("nan"))
    k_cache = torch.cat([batch.k_cache, nan_block])
    v_cache = torch.cat([batch.v_cache, nan_block])
    tables = batch.block_tables.clone()
    stale = 0
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens.tolist())):
        first_key = max(0, seq_len - q_len - sliding_window + 1)  # the first query's first key
        n = first_key // block_size
        tables[b, :n] = k_cache.shape[0] - 1
        stale += n
    batch = PagedBatch(**{**vars(batch), "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables})
    return batch, stale


# Attention options the backends are tested with (see attention_options; with a scale: PagedBatch.options): windows narrower than a block, one
# block, wider than most contexts; soft-capping; sinks; everything at once.
OPTION_CASES = ("window-1", "window-7", "window-16", "window-33", "softcap", "sinks", "all")


def attention_options(case: str, num_q_heads: int, seed: int = 0) -> dict:
    """The keyword options of ``case`` (one of :data:`OPTION_CASES`) for ``num_q_heads`` query heads."""
    sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed)) * 2
    if case.startswith("window-"):
        return dict(sliding_window=int(case.split("-")[1]))
    return {
        "softcap": dict(softcap=2.0),
        "sinks": dict(sinks=sinks),
        "all": dict(sliding_window=20, softcap=5.0, sinks=sinks),
    }[case]
