"""What a sequence's admission reuses of the prefix cache: the longest run of cached whole blocks of its
prompt (shared: refcount + 1), then the run of a registered block that continues it (copied), and the figures
of both. The :class:`~batchgen.engine.kv.kv_cache.KVCacheManager` owns the block tables and asks
:class:`PrefixReuse` at each admission (:meth:`KVCacheManager.allocate`); registering full blocks as they are
computed stays with the tables (:meth:`KVCacheManager.cache_full_blocks`).

**Partial blocks.** Block hashes cover whole blocks, so a shared prompt prefix (a system prompt, few-shot
examples) that ends inside a block would leave its last ``< block_size`` tokens to be recomputed by every
sequence. :meth:`KVCacheManager.allocate` instead looks, after the last whole cached block, for a registered
block under the same parent whose leading tokens continue the prompt (the longest such run,
:meth:`BlockPool.longest_lead`), and copies that block into the sequence's own next block: those tokens count
as cached, and the sequence computes from the first token that differs. The copy (``(src, dst)``, returned by
:meth:`PrefixReuse.end_schedule` with the step's other copies) runs before the forward; the tokens after
the copied run are written over by the sequence's own. A block registered in the step being scheduled is not
written yet and is never a source; when one would continue the prompt at least
``WAIT_FOR_LEAD_MIN_TOKENS`` further than any written block, ``wait_for_lead`` makes the request wait a step
for it (``allocate`` returns None) instead of recomputing the difference. The copy's source holds a reference
until :meth:`PrefixReuse.end_schedule`, so nothing evicts or rewrites it before the copy runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchgen.engine.kv.block_pool import BlockHash, BlockPool, hash_block_tokens

WAIT_FOR_LEAD_MIN_TOKENS = 4
"""``allocate(wait_for_lead=True)`` waits for a block being computed only when it would copy at least this many
more tokens than a written block can: unrelated prompts often share a token or two (BOS, a digit), and a wait
holds back every admission behind the request for a step."""


@dataclass
class PrefixMatch:
    """What the prefix cache holds of a prompt: whole blocks to share, then a block to copy a leading run from."""

    blocks: list[int]
    hashes: list[BlockHash]
    lead_block: int = -1
    """A registered block whose first ``lead_tokens`` tokens continue the prompt after ``blocks`` (-1: none)."""
    lead_tokens: int = 0
    pending_tokens: int = 0
    """The longest such run in a block registered by the step being scheduled (not written yet: it cannot be
    copied now)."""


def match_prefix(pool: BlockPool, token_ids: Sequence[int], root: BlockHash | None) -> PrefixMatch:
    """Longest run of cached full blocks at the start of token_ids, never the last token's block, then the
    registered block continuing it furthest (short of the last token); ``root`` starts the hash chain (the key of
    the weights the request runs under, e.g. an adapter's: None for the base model)."""
    match = PrefixMatch([], [])
    if len(token_ids) < 2:
        return match
    bs = pool.block_size
    lookup = pool.lookup
    parent: BlockHash | None = root
    for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
        toks = token_ids[start : start + bs]
        h = hash_block_tokens(parent, toks)
        b = lookup(h, parent, toks)
        if b is None:
            break
        match.blocks.append(b)
        match.hashes.append(h)
        parent = h
    start = len(match.blocks) * bs
    end = min(start + bs, len(token_ids) - 1)
    if end > start:
        match.lead_block, match.lead_tokens, match.pending_tokens = pool.longest_lead(
            parent, token_ids[start:end]
        )
    return match


class PrefixReuse:
    """The admission side of the prefix cache over one pool (``enabled`` False: nothing is ever reused)."""

    def __init__(self, pool: BlockPool, enabled: bool) -> None:
        self.pool = pool
        self.enabled = enabled
        self.hit_tokens = 0
        """Prompt tokens admissions reused (shared whole blocks and copied runs)."""
        self.queried_tokens = 0
        """Prompt tokens admissions looked up."""
        self.num_copies = 0
        """Partial-block copies made so far."""
        # This schedule's partial-block copies (src, dst); each src holds one reference until end_schedule.
        self._copies: list[tuple[int, int]] = []

    def match(self, token_ids: Sequence[int], root: BlockHash | None = None) -> PrefixMatch:
        if not self.enabled:
            return PrefixMatch([], [])
        return match_prefix(self.pool, token_ids, root)

    def should_wait(self, match: PrefixMatch) -> bool:
        """A block being computed by the step being scheduled would be worth waiting a step for."""
        return match.pending_tokens >= match.lead_tokens + WAIT_FOR_LEAD_MIN_TOKENS

    def blocks_needed(self, match: PrefixMatch, num_tokens: int) -> int:
        """Free blocks an admission with ``match`` takes for ``num_tokens`` live tokens (evictable cached
        blocks it revives count: they leave the free list)."""
        rc = self.pool.ref_counts
        bs = self.pool.block_size
        cached = match.blocks
        revived = sum(1 for b in cached if rc[b] == 0)  # evictable now, so they use up free blocks
        if match.lead_tokens and rc[match.lead_block] == 0:
            revived += 1  # the copy's source is held until the schedule ends
        live = max(num_tokens, len(cached) * bs + match.lead_tokens)
        return -(-live // bs) - len(cached) + revived

    def hold(self, match: PrefixMatch) -> int:
        """Take a reference on the shared blocks and the copy's source (before allocating the rest, so that
        allocation cannot evict them); returns how many of these blocks were evictable (revived: each is a
        full block whose slots count as live while it is held, the copy's source included)."""
        rc = self.pool.ref_counts
        revived = sum(1 for b in match.blocks if rc[b] == 0)
        self.pool.incref(match.blocks)
        if match.lead_tokens:
            revived += rc[match.lead_block] == 0
            self.pool.incref((match.lead_block,))  # the copy's source, held until end_schedule
        return revived

    def admitted(self, match: PrefixMatch, table: list[int], num_queried: int) -> int:
        """The sequence got ``table`` (the shared blocks first): queue the partial copy into its next block and
        count the reuse; returns the tokens reused."""
        if match.lead_tokens:
            self._copies.append((match.lead_block, table[len(match.blocks)]))
        reused = len(match.blocks) * self.pool.block_size + match.lead_tokens
        if self.enabled:
            self.hit_tokens += reused
            self.queried_tokens += num_queried
        return reused

    def end_schedule(self) -> tuple[list[tuple[int, int]], int]:
        """The ``(src, dst)`` partial-block copies queued since the last call and how many of their sources
        this releases (no sequence and no other copy holds them any more: their live slots end); marks every
        block registered so far as written before any later step's copies run."""
        copies, self._copies = self._copies, []
        self.num_copies += len(copies)
        released = self.pool.free(src for src, _ in copies)
        self.pool.settle()
        return copies, released
