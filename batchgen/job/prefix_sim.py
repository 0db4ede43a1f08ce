"""The engine's prefix cache, simulated over a job's prompts in the order the job feeds them, and where a
dataset's prompts stop sharing.

The simulation follows :mod:`batchgen.engine.kv.kv_cache`: only whole blocks of ``block_size`` tokens are shared,
chained by their parent (and a LoRA adapter's root), never the block holding a prompt's last token (at most
``(len - 1) // block_size`` blocks), and a prompt's full blocks are registered as it is scheduled (a request
admitted right after it shares them). A prompt whose output fills its last, partial block has that block
registered by the engine once the output fills it (written by the decode steps): the prompt's part of it is a
run later prompts may copy, from ``delay`` admissions on (the job's concurrency: the prompts admitted with it
come before the block is full). Cached blocks are evicted least recently used once ``capacity`` blocks
are held (None: never). The figure it predicts is the report's ``tokens.prefix_hit_rate`` (whole-block hits
over prompt tokens admitted).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class CacheResult:
    """Per prompt (in the order given): tokens the cache served (whole blocks) and tokens copied from a cached
    block continuing the prompt (a shared prefix ending inside a block); with totals."""

    cached: list[int]
    prompt_tokens: int
    copied: list[int]

    @property
    def copied_tokens(self) -> int:
        return sum(self.copied)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


MAX_CHILDREN = 8
"""Cached children remembered per block for the partial-block copy: in the job's trie order the block that
continues a prompt furthest is one of its latest siblings."""


class PrefixCacheSim:
    """The cache's state as prompts are admitted one after another (module docstring)."""

    def __init__(self, block_size: int, capacity: int | None = None, delay: int = 1) -> None:
        self.bs, self.capacity, self.delay = block_size, capacity, max(1, delay)
        self.cache: OrderedDict[Hashable, None] = OrderedDict()
        self.children: dict[Hashable, list[tuple[int, ...]]] = {}  # parent -> tokens of cached child blocks
        self.admitted = 0
        self.filling: deque[tuple[int, Hashable, bool, tuple[int, ...]]] = deque()
        """Last blocks being filled by outputs: (admission from which they may be copied, parent, whether the
        parent is a block (else the chain's root), the prompt's tokens in them)."""

    def admit(
        self, toks: Sequence[int], root: Hashable = None, lookup: int | None = None, output: int = 0
    ) -> tuple[int, int]:
        """Admit one prompt: (tokens served by whole cached blocks, tokens copied from a cached block).
        O(len(toks)): one hash per full block; a block past the first miss is never looked up. ``lookup``: the
        prompt's first tokens the engine may take from the cache (None: all; a request wanting its prompt's
        logprobs computes every token, 1); its full blocks are registered for later prompts whatever it is.
        ``output``: the tokens its output will hold (filling a partial last block makes it a copy source)."""
        bs, cache, children = self.bs, self.cache, self.children
        n = len(toks)
        if type(toks) is not tuple:
            toks = tuple(toks)
        self.admitted += 1
        while self.filling and self.filling[0][0] <= self.admitted:
            _, at, block, part = self.filling.popleft()
            if not block or at in cache:  # a parent evicted meanwhile takes its children with it
                self._child(at, part)
        full = n // bs
        m = n if lookup is None else min(n, lookup)
        shareable = (m - 1) // bs if m >= 2 else 0
        parent: Hashable = root
        keys = []
        hit = 0
        missed = False
        for b in range(full):
            key = hash((parent, toks[b * bs : (b + 1) * bs]))
            keys.append(key)
            parent = key
            if not missed:
                if b < shareable and key in cache:
                    hit += 1
                    cache.move_to_end(key)
                else:
                    missed = True
        # the registered block under the last shared one continuing the prompt furthest (never its last token)
        start, lead = hit * bs, 0
        end = min(start + bs, m - 1)
        if end > start:
            want = toks[start:end]
            for child in reversed(children.get(keys[hit - 1] if hit else root, ())):
                if child[0] == want[0]:
                    lead = max(lead, common_prefix_len(want, child))
                    if lead == len(want):
                        break
        for b in range(hit, full):
            key = keys[b]
            if key not in cache:
                self._child(keys[b - 1] if b else root, toks[b * bs : (b + 1) * bs])
                cache[key] = None
            else:
                cache.move_to_end(key)
        if n % bs and output >= bs - n % bs:  # the output fills the last block: registered then
            parent_key = keys[-1] if full else root
            self.filling.append((self.admitted + self.delay, parent_key, bool(full), toks[full * bs :]))
        if self.capacity is not None:
            while len(cache) > self.capacity:
                evicted, _ = cache.popitem(last=False)
                children.pop(evicted, None)  # memory bounded by the pool, not by the input
        return hit * bs, lead

    def elapse(self, admissions: int) -> None:
        """Count ``admissions`` the simulation did not see (the windows a sample skips) as passed."""
        self.admitted += max(0, admissions)

    def _child(self, parent: Hashable, tokens: tuple[int, ...]) -> None:
        """Remember a registered block's tokens (or a prompt's part of one) under its parent, for copies."""
        kids = self.children.setdefault(parent, [])
        kids.append(tokens)
        if len(kids) > MAX_CHILDREN:
            del kids[0]


def simulate_prefix_cache(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    roots: Sequence[Hashable] | None = None,
    capacity: int | None = None,
) -> CacheResult:
    """Tokens the prefix cache serves to each prompt of ``prompts`` admitted in this order (module docstring);
    ``roots[i]`` starts prompt i's hash chain (its adapter; None = the base model)."""
    sim = PrefixCacheSim(block_size, capacity)
    res = CacheResult([], 0, [])
    for i, toks in enumerate(prompts):
        c, k = sim.admit(toks, roots[i] if roots is not None else None)
        res.cached.append(c)
        res.copied.append(k)
        res.prompt_tokens += len(toks)
    return res


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slice equality (compared in C)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_run_after_start(texts: Sequence[str], min_chars: int = 40) -> tuple[str, float, int] | None:
    """The longest text most of ``texts`` share, when it is at least ``min_chars`` long and not at their start:
    (the text, the fraction of ``texts`` holding it, where it starts in the first text); None otherwise.

    The run starts as the longest text the first row shares with another, then is cut down to what a spread
    of further rows also hold: two rows may share by chance a few characters on either side of it (the same
    last digit of an id before a system prompt, the same first word of the question after it), which fewer
    rows hold; a row that holds no run of ``min_chars`` of it does not cut it (it is not one of the rows that
    share it)."""
    import difflib

    if len(texts) < 2:
        return None
    a, b = texts[0], texts[len(texts) // 2] if texts[len(texts) // 2] != texts[0] else texts[-1]
    m = difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
    if m.size < min_chars:
        return None
    run = a[m.a : m.a + m.size]
    others = texts[1:]
    for t in others[:: max(1, len(others) // 8)]:
        if run in t:
            continue
        k = difflib.SequenceMatcher(None, run, t, autojunk=False).find_longest_match(0, len(run), 0, len(t))
        if k.size >= min_chars:
            run = run[k.a : k.a + k.size]
    first = a.find(run)
    if first == 0 and b.find(run) == 0:
        return None
    held = sum(run in t for t in texts) / len(texts)
    return run, held, first
