"""Property tests: random allocate/append/fork/write/free/cache/swap runs keep every block-manager invariant.

A shadow "physical memory" (token id per slot of every block, GPU and CPU pools) plays the KV cache: writes go
through the block table, copies returned by ``append_slots`` / ``swap_out`` / ``swap_in`` are applied, and after
every step each sequence must read back exactly its own tokens, from the GPU or, while swapped out, from the
CPU pool. That catches a write into a shared block, a wrong prefix-cache hit, a lost copy-on-write and a block
swapped twice or not at all alike. Forks include beam-style ones (sharing only a block-aligned prefix) and
swap-outs take whole groups of sequences (the beams of a group share blocks) or single ones.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchgen.engine.kv.kv_cache import LEAD_PENDING, KVCacheManager


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 14),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
        num_cpu_blocks=st.sampled_from([0, 2, 6, 16]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool, num_cpu_blocks: int) -> None:
        self.bs = block_size
        self.mgr = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=caching, num_cpu_blocks=num_cpu_blocks
        )
        self.phys: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu_phys: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.swapped: set[int] = set()
        self.tokens: dict[int, list[int]] = {}  # every known token of a sequence (prompt + generated)
        self.live: dict[int, int] = {}  # tokens written to the cache
        self.next_id = 0
        self.writes = 0

    # ------------------------------------------------------------ helpers
    def _snapshot(self):
        m = self.mgr
        return (
            {s: m.raw_table(s) for s in self.live},
            list(m.pool.ref_counts),
            m.num_free_blocks,
            m.pool.num_cached_blocks,
            list(m.cpu_pool.ref_counts) if m.cpu_pool else None,
            sorted(self.swapped),
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
        ids = sorted(s for s in self.live if s not in self.swapped)
        return ids[i % len(ids)]

    def _resident(self) -> bool:
        return any(s not in self.swapped for s in self.live)

    # ------------------------------------------------------------- rules
    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14),
        frac=st.floats(0.0, 1.0),
        settle=st.booleans(),
        wait=st.booleans(),
    )
    def allocate(self, prompt: list[int], frac: float, settle: bool, wait: bool) -> None:
        """Admission in a step of its own: ``settle`` ends the schedule before (blocks registered so far become
        copy sources), and the step's partial-prefix copies run right after."""
        sid = self.next_id
        self.next_id += 1
        n = max(1, round(len(prompt) * frac))  # chunked prefill: first chunk only
        if settle:
            assert self.mgr.end_schedule() == []
        before = self._snapshot()
        r = self.mgr.allocate(sid, prompt, n, wait_for_lead=wait)
        if r is None or r == LEAD_PENDING:
            assert self._snapshot() == before, "failed allocate changed state"
            return
        assert r <= len(prompt) - 1 or r == 0
        assert r // self.bs * self.bs <= (len(prompt) - 1) // self.bs * self.bs
        for src, dst in self.mgr.end_schedule():
            assert self.mgr.pool.ref_counts[dst] == 1 and dst in self.mgr.block_table(sid)
            self.phys[dst] = list(self.phys[src])
        table = self.mgr.block_table(sid)
        for pos in range(r):  # cached prefix must hold exactly the request's tokens
            assert self.phys[table[pos // self.bs]][pos % self.bs] == prompt[pos]
        self.tokens[sid] = list(prompt)
        live = max(n, r)
        self.live[sid] = live
        self._write(sid, r, live)
        self.mgr.cache_full_blocks(sid, prompt, live)

    @precondition(lambda self: self._resident())
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

    @precondition(lambda self: self._resident())
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

    @precondition(lambda self: self._resident())
    @rule(i=st.integers(0, 1000), nb=st.integers(0, 4))
    def fork_prefix(self, i: int, nb: int) -> None:
        """A beam resumed after a preemption: shares only the parent's first ``nb`` full blocks."""
        parent = self._pick(i)
        n = min(nb, self.live[parent] // self.bs) * self.bs
        child = self.next_id
        self.next_id += 1
        free_before = self.mgr.num_free_blocks
        self.mgr.fork(parent, child, n)
        assert self.mgr.num_free_blocks == free_before
        assert self.mgr.block_table(child) == self.mgr.block_table(parent)[: n // self.bs]
        self.tokens[child] = self.tokens[parent][:n]
        self.live[child] = n

    @precondition(lambda self: self._resident())
    @rule(
        i=st.integers(0, 1000),
        picks=st.lists(st.integers(0, 3), min_size=1, max_size=4),
        new=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    )
    def beam_step(self, i: int, picks: list[int], new: list[int]) -> None:
        """One beam-search step over a group: survivors kept once reuse their sequence, kept again are forked
        (before growing), dropped ones are freed, then every new beam writes its next token (copy on write)."""
        root = self._pick(i)
        mine = set(self.mgr.block_table(root))
        group = [root] + [
            s
            for s in sorted(self.live)
            if s != root and s not in self.swapped and mine & set(self.mgr.block_table(s))
        ][:3]
        parents = [group[p % len(group)] for p in picks]
        beams: list[int] = []
        for p in parents:
            if p in beams:
                child = self.next_id
                self.next_id += 1
                self.mgr.fork(p, child)
                self.tokens[child] = self.tokens[p][: self.live[p]]
                self.live[child] = self.live[p]
                beams.append(child)
            else:
                beams.append(p)
        for s in group:
            if s not in beams:
                self.mgr.free(s)
                del self.live[s], self.tokens[s]
        for s, tok in zip(beams, new):
            old = self.live[s]
            del self.tokens[s][old:]
            self.tokens[s].append(tok)
            copies = self.mgr.append_slots(s, old + 1)
            if copies is None:
                self.tokens[s].pop()
                continue
            for src, dst in copies:
                self.phys[dst] = list(self.phys[src])
            self.live[s] = old + 1
            self._write(s, old, old + 1)
            self.mgr.cache_full_blocks(s, self.tokens[s], old + 1)

    @precondition(lambda self: self._resident())
    @rule(i=st.integers(0, 1000), group=st.booleans())
    def swap_out(self, i: int, group: bool) -> None:
        """Swap out one sequence, or it and every resident sequence sharing a block with it (a beam group)."""
        sid = self._pick(i)
        ids = [sid]
        if group:
            mine = set(self.mgr.block_table(sid))
            ids += [
                s
                for s in sorted(self.live)
                if s != sid and s not in self.swapped and mine & set(self.mgr.block_table(s))
            ]
        before = self._snapshot()
        used_before = self.mgr.stats().blocks_used
        copies = self.mgr.swap_out(ids)
        if copies is None:
            assert self._snapshot() == before, "failed swap_out changed state"
            return
        assert len({g for g, _ in copies}) == len(copies), "a GPU block was swapped twice"
        assert len({c for _, c in copies}) == len(copies), "two blocks swapped into one CPU block"
        for g, c in copies:
            assert self.mgr.cpu_pool.ref_counts[c] >= 1
            self.cpu_phys[c] = list(self.phys[g])
        assert self.mgr.stats().blocks_used == used_before - len(copies)
        self.swapped.update(ids)

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 1000), group=st.booleans())
    def swap_in(self, i: int, group: bool) -> None:
        ids = sorted(self.swapped)
        ids = ids if group else [ids[i % len(ids)]]
        before = self._snapshot()
        cost = self.mgr.swap_in_cost(ids)
        free_before = self.mgr.num_free_blocks
        copies = self.mgr.swap_in(ids)
        if copies is None:
            assert cost > free_before
            assert self._snapshot() == before, "failed swap_in changed state"
            return
        assert self.mgr.num_free_blocks == free_before - cost
        for c, g in copies:
            assert self.mgr.pool.ref_counts[g] >= 1
            self.phys[g] = list(self.cpu_phys[c])
        self.swapped.difference_update(ids)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def free(self, i: int) -> None:
        ids = sorted(self.live)
        sid = ids[i % len(ids)]
        self.mgr.free(sid)
        del self.live[sid], self.tokens[sid]
        self.swapped.discard(sid)

    @rule()
    def free_all(self) -> None:
        for sid in list(self.live):
            self.mgr.free(sid)
        self.live.clear()
        self.tokens.clear()
        self.swapped.clear()
        m = self.mgr
        assert m.num_free_blocks == m.num_blocks, "blocks leaked after every sequence was freed"
        assert m.num_free_cpu_blocks == m.num_cpu_blocks, "CPU blocks leaked after every sequence was freed"
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
        cpu_refs: Counter[int] = Counter()
        live_slots: set[tuple[int, int]] = set()
        for sid, live in self.live.items():
            table = m.raw_table(sid)
            assert m.is_swapped(sid) == (sid in self.swapped)
            if sid not in self.swapped:
                assert all(b >= 0 for b in table) and table == m.block_table(sid)
            assert len(table) == _cdiv(live, self.bs), "table does not cover exactly the live tokens"
            assert len(set(table)) == len(table)
            assert m.num_tokens(sid) == live
            refs.update(b for b in table if b >= 0)
            cpu_refs.update(~b for b in table if b < 0)
            for pos in range(live):  # every sequence reads back exactly its own tokens (GPU or CPU)
                b = table[pos // self.bs]
                mem = self.phys[b] if b >= 0 else self.cpu_phys[~b]
                assert mem[pos % self.bs] == self.tokens[sid][pos], f"seq {sid} pos {pos} corrupted"
                if b >= 0:
                    live_slots.add((b, pos % self.bs))
        for b in range(m.num_blocks):
            assert pool.ref_counts[b] == refs[b], (
                f"block {b}: refcount {pool.ref_counts[b]} != {refs[b]} refs"
            )
        if m.cpu_pool is not None:
            m.cpu_pool.check_invariants()
            for c in range(m.num_cpu_blocks):
                assert m.cpu_pool.ref_counts[c] == cpu_refs[c], f"CPU block {c}: refcount != refs"
        else:
            assert not cpu_refs
            cached = pool.cached_tokens(b)
            if cached is not None:  # a registered block holds exactly the tokens it is registered under
                assert list(cached) == self.phys[b]
        st_ = m.stats()
        assert st_.blocks_used == len(refs)
        assert st_.blocks_used + st_.blocks_free == m.num_blocks
        assert st_.live_token_slots == len(live_slots)
        assert st_.logical_tokens == sum(v for s, v in self.live.items() if s not in self.swapped)
        assert st_.num_seqs == len(self.live) - len(self.swapped) and st_.num_swapped_seqs == len(
            self.swapped
        )
        assert st_.cpu_blocks_used == len(cpu_refs)
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
