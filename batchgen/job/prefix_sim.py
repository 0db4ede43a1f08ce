"""The engine's prefix cache, simulated over a job's prompts in the order the job feeds them, and where a
dataset's prompts stop sharing.

The simulation follows :mod:`batchgen.engine.kv_cache`: only whole blocks of ``block_size`` tokens are shared,
chained by their parent (and a LoRA adapter's root), never the block holding a prompt's last token (at most
``(len - 1) // block_size`` blocks), and a prompt's full blocks are registered as it is scheduled (a request
admitted right after it shares them). Cached blocks are evicted least recently used once ``capacity`` blocks
are held (None: never). The figure it predicts is the report's ``tokens.prefix_hit_rate`` (whole-block hits
over prompt tokens admitted).
"""

from __future__ import annotations

from collections import OrderedDict
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


def simulate_prefix_cache(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    roots: Sequence[Hashable] | None = None,
    capacity: int | None = None,
) -> CacheResult:
    """Tokens the prefix cache serves to each prompt of ``prompts`` admitted in this order (module docstring);
    ``roots[i]`` starts prompt i's hash chain (its adapter; None = the base model)."""
    cache: OrderedDict[Hashable, None] = OrderedDict()
    children: dict[Hashable, list[tuple[int, ...]]] = {}  # parent -> tokens of its cached child blocks
    cached: list[int] = []
    copied: list[int] = []
    total = 0
    bs = block_size
    for i, toks in enumerate(prompts):
        n = len(toks)
        total += n
        parent: Hashable = roots[i] if roots is not None else None
        hit = 0
        shareable = (n - 1) // bs if n >= 2 else 0
        keys = []
        for b in range(n // bs):
            key = hash((parent, tuple(toks[b * bs : (b + 1) * bs])))
            keys.append(key)
            parent = key
        for b in range(shareable):
            if keys[b] in cache:
                hit += 1
                cache.move_to_end(keys[b])
            else:
                break
        cached.append(hit * bs)
        # the registered block under the last shared one continuing the prompt furthest (never its last token)
        start = hit * bs
        end = min(start + bs, n - 1)
        lead = 0
        if end > start:
            want = tuple(toks[start:end])
            par = keys[hit - 1] if hit else (roots[i] if roots is not None else None)
            for child in children.get(par, ()):
                lead = max(lead, common_prefix_len(want, child))
        copied.append(lead)
        for b in range(hit, len(keys)):
            key = keys[b]
            if key not in cache:
                par = keys[b - 1] if b else (roots[i] if roots is not None else None)
                kids = children.setdefault(par, [])
                kids.append(tuple(toks[b * bs : (b + 1) * bs]))
                if len(kids) > 16:
                    del kids[0]
            cache[key] = None
            cache.move_to_end(key)
        if capacity is not None:
            while len(cache) > capacity:
                cache.popitem(last=False)
    return CacheResult(cached, total, copied)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_run_after_start(texts: Sequence[str], min_chars: int = 40) -> tuple[str, float, int] | None:
    """The longest text two of ``texts`` share, when it is at least ``min_chars`` long and not at their start:
    (the text, the fraction of ``texts`` holding it, where it starts in the first text); None otherwise."""
    import difflib

    if len(texts) < 2:
        return None
    a, b = texts[0], texts[len(texts) // 2] if texts[len(texts) // 2] != texts[0] else texts[-1]
    m = difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
    if m.size < min_chars or (m.a == 0 and m.b == 0):
        return None
    run = a[m.a : m.a + m.size]
    held = sum(run in t for t in texts) / len(texts)
    return run, held, m.a
