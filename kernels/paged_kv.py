"""What an attention call reads besides its queries: :class:`PagedKV`, one layer's paged K/V cache and where a
batch's sequences live in it (vLLM keeps the same in its attention metadata). Every attention implementation
(the reference, the torch backend, the Triton kernels' wrappers) and the engine's ``PagedAttention`` take one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor


@dataclass(frozen=True, eq=False)
class PagedKV:
    """One layer's K/V cache planes and the block tables and lengths of the batch's ``B`` sequences.

    Invariants (the callers' duty; the Triton wrappers assert the cache ones):

    * ``k_cache``, ``v_cache``: ``[NB, BS, Hkv, D]``, same shape, contiguous (layer ``i``'s planes
      ``kv_cache[i, 0]`` / ``kv_cache[i, 1]``, layout in :mod:`batchgen.kernels`).
    * ``block_tables``: ``[B, max_blocks]`` int32; token ``t`` of sequence ``b`` is at slot
      ``block_tables[b, t // BS] * BS + t % BS`` of the flattened ``[NB * BS, Hkv, D]`` plane. Padding entries
      are valid block ids (0) and are never read for real tokens.
    * ``seq_lens``: ``[B]`` int32 >= 1, the sequence's cached tokens *including* the new ones of this step
      (whose K/V ``store_kv`` has already written): its queries are its last tokens.

    Compared by identity (it holds tensors).
    """

    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    seq_lens: Tensor

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    def select(self, rows: slice | Tensor) -> PagedKV:
        """The same caches, seen by the sequences ``rows`` only (a slice, or indices on any device)."""
        if isinstance(rows, slice):
            return replace(self, block_tables=self.block_tables[rows], seq_lens=self.seq_lens[rows])
        return replace(
            self,
            block_tables=self.block_tables[rows.to(self.block_tables.device)],
            seq_lens=self.seq_lens[rows.to(self.seq_lens.device)],
        )
