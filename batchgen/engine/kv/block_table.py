"""One sequence's block table: logical block ``i`` -> physical block id, over its live tokens.

Invariant: ``len(table) == ceil(num_tokens / block_size)``; ``block_hashes[:num_registered]`` are the hashes of
the leading full blocks registered in (or taken from) the prefix cache. While ``swapped``, entries ``< 0`` are
CPU blocks ``~entry`` of the swap space. Owned by the :class:`~batchgen.engine.kv.kv_cache.KVCacheManager`, which
never hands one out: callers get copies of ``table``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.kv.block_pool import BlockHash


@dataclass(slots=True)
class BlockTable:
    table: list[int]
    num_tokens: int
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Hashes of the sequence's leading full blocks, as far as they have been computed."""
    num_registered: int = 0
    """Leading blocks already registered in the prefix cache (or taken from it)."""
    swapped: bool = False
    """Swapped out: entries ``< 0`` of ``table`` are CPU blocks ``~entry``."""
    root: BlockHash | None = None
    """Start of the hash chain (the key of the weights its request runs under, e.g. an adapter's; None: the base model's)."""

    def live_in_block(self, i: int, block_size: int) -> int:
        """Live token slots of logical block ``i`` (a shared block is equally full in every sharer: sequences
        never write into a shared block, and forks share only full blocks or their whole table)."""
        return min(block_size, self.num_tokens - i * block_size)

    def write_cost(self, num_tokens: int, block_size: int, ref_counts: list[int]) -> tuple[int, list[int]]:
        """Growing to ``num_tokens``: (blocks needed, logical indices of shared blocks the new tokens would be
        written into, which must be copied first)."""
        table = self.table
        n = len(table)
        first = self.num_tokens // block_size  # the block holding position num_tokens, where writing starts
        cow = [i for i in range(first, n) if ref_counts[table[i]] > 1] if first < n else []
        return -(-num_tokens // block_size) - n + len(cow), cow
