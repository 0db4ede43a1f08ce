"""Property tests: random allocate/append/fork/write/free/cache runs keep every block-manager invariant.

A shadow "physical memory" (token id per slot of every block) plays the KV cache: writes go through the
block table, copies returned by ``append_slots`` are applied, and after every step each sequence must
read back exactly its own tokens. That catches a write into a shared block, a wrong prefix-cache hit
and a lost copy-on-write alike.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchgen.engine.kv_cache import KVCacheManager


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 14),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bs = block_size
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.phys: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tokens: dict[int, list[int]] = {}  # every known token of a sequence (prompt + generated)
        self.live: dict[int, int] = {}  # tokens written to the cache
        self.next_id = 0
        self.writes = 0

    # ------------------------------------------------------------ helpers
    def _snapshot(self):
        m = self.mgr
        return (
            {s: m.block_table(s) for s in self.live},
            list(m.pool.ref_counts),
            m.num_free_blocks,
            m.pool.num_cached_blocks,
        )

    def _write(self, seq: int, start: int, stop: int) -> None:
        """The model runner stores K/V of positions start..stop-1: each target block must be exclusive."""
        table = self.mgr.block_table(seq)
        for pos in range(start, stop):
            b = table[pos // self.bs]
            assert self.mgr.pool.ref_counts[b] == 1, f"write into block {b} with refcount != 1"
            self.phys[b][pos % self.bs] = self.tokens[seq][pos]
            self.writes += 1

    def _pick(self, i: int) -> int:
        ids = sorted(self.live)
        return ids[i % len(ids)]

    # ------------------------------------------------------------- rules
    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), frac=st.floats(0.0, 1.0))
    def allocate(self, prompt: list[int], frac: float) -> None:
        sid = self.next_id
        self.next_id += 1
        n = max(1, round(len(prompt) * frac))  # chunked prefill: first chunk only
        before = self._snapshot()
        r = self.mgr.allocate(sid, prompt, n)
        if r is None:
            assert self._snapshot() == before, "failed allocate changed state"
            return
        assert r % self.bs == 0 and r <= (len(prompt) - 1) // self.bs * self.bs
        table = self.mgr.block_table(sid)
        for pos in range(r):  # cached prefix must hold exactly the request's tokens
            assert self.phys[table[pos // self.bs]][pos % self.bs] == prompt[pos]
        self.tokens[sid] = list(prompt)
        live = max(n, r)
        self.live[sid] = live
        self._write(sid, r, live)
        self.mgr.cache_full_blocks(sid, prompt, live)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000), k=st.integers(1, 6), new=st.lists(st.integers(0, 2), max_size=6))
    def append(self, i: int, k: int, new: list[int]) -> None:
        sid = self._pick(i)
        old = self.live[sid]
        toks = self.tokens[sid]
        toks.extend(new)
        target = old + k
        while len(toks) < target:
            toks.append(len(toks) % 3)
        before = self._snapshot()
        copies = self.mgr.append_slots(sid, target)
        if copies is None:
            assert self._snapshot() == before, "failed append_slots changed state"
            return
        for src, dst in copies:
            assert self.mgr.pool.ref_counts[dst] == 1
            self.phys[dst] = list(self.phys[src])
        self.live[sid] = target
        self._write(sid, old, target)
        self.mgr.cache_full_blocks(sid, toks, target)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def fork(self, i: int) -> None:
        parent = self._pick(i)
        child = self.next_id
        self.next_id += 1
        free_before = self.mgr.num_free_blocks
        self.mgr.fork(parent, child)
        assert self.mgr.num_free_blocks == free_before
        self.tokens[child] = list(self.tokens[parent])
        self.live[child] = self.live[parent]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def free(self, i: int) -> None:
        sid = self._pick(i)
        self.mgr.free(sid)
        del self.live[sid], self.tokens[sid]

    @rule()
    def free_all(self) -> None:
        for sid in list(self.live):
            self.mgr.free(sid)
        self.live.clear()
        self.tokens.clear()
        m = self.mgr
        assert m.num_free_blocks == m.num_blocks, "blocks leaked after every sequence was freed"
        assert sum(m.pool.ref_counts) == 0
        st_ = m.stats()
        assert st_.blocks_used == 0 and st_.live_token_slots == 0 and st_.logical_tokens == 0

    # --------------------------------------------------------- invariants
    @invariant()
    def invariants(self) -> None:
        m = self.mgr
        pool = m.pool
        pool.check_invariants()
        refs: Counter[int] = Counter()
        live_slots: set[tuple[int, int]] = set()
        for sid, live in self.live.items():
            table = m.block_table(sid)
            assert len(table) == _cdiv(live, self.bs), "table does not cover exactly the live tokens"
            assert len(set(table)) == len(table)
            assert m.num_tokens(sid) == live
            refs.update(table)
            for pos in range(live):  # every sequence reads back exactly its own tokens
                b = table[pos // self.bs]
                assert self.phys[b][pos % self.bs] == self.tokens[sid][pos], f"seq {sid} pos {pos} corrupted"
                live_slots.add((b, pos % self.bs))
        for b in range(m.num_blocks):
            assert pool.ref_counts[b] == refs[b], (
                f"block {b}: refcount {pool.ref_counts[b]} != {refs[b]} refs"
            )
            cached = pool.cached_tokens(b)
            if cached is not None:  # a registered block holds exactly the tokens it is registered under
                assert list(cached) == self.phys[b]
        st_ = m.stats()
        assert st_.blocks_used == len(refs)
        assert st_.blocks_used + st_.blocks_free == m.num_blocks
        assert st_.live_token_slots == len(live_slots)
        assert st_.logical_tokens == sum(self.live.values())
        assert st_.peak_blocks_used >= st_.blocks_used
        assert 0.0 <= st_.kv_utilization <= 1.0
        assert st_.prefix_hit_tokens <= st_.prefix_queried_tokens


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManager = BlockManagerMachine.TestCase
