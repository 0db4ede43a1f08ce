"""Batched token sampler: one call turns a ``[N, V]`` block of next-token logits into N token ids.

Pipeline for each row (every stage is vectorised over the rows that need it; rows that don't skip it):

1. **logprobs** (rows with ``params.logprobs`` set): ``log_softmax`` of the *raw* model logits, before any
   penalty, temperature or filter (vLLM's default ``raw_logprobs`` mode). The row gets the top-``k`` tokens
   plus the sampled token.
2. **banned tokens** (``SamplingRow.banned_token_ids``, e.g. eos/stop ids while ``min_tokens`` is not yet
   reached): logit set to ``-inf``.
3. **penalties**: repetition (transformers: over prompt + output tokens, positive logits divided by the
   penalty, negative ones multiplied), then frequency and presence (OpenAI/vLLM: output tokens only,
   ``logit -= frequency * count + presence * (count > 0)``).
4. **greedy rows** (``temperature < 1e-5``): argmax of the penalised logits. Ties go to the lowest token id
   (``torch.argmax``), as in transformers.
5. **random rows**: temperature, top-k, top-p, min-p (transformers' order; top-p acts on the distribution
   renormalised after top-k), then one draw by the exponential race ``argmax(p / q)``, ``q ~ Exp(1)``,
   which samples exactly from ``p`` (``q = -log(u)``, ``u`` uniform). A row with a seed (seeded request) draws its ``q`` from a
   generator of its own (the sampler keeps one per row key, seeded at first use), so its tokens do not depend
   on the other rows of the batch; the other rows share the Sampler's generator.

When every row is greedy and nothing else is asked for, the call is a single ``argmax`` (the hot path).

**Watched tokens** (``watch``: row -> token ids): the sampler returns the probability that the row's draw is one
of them, under the distribution it drew from (after banned tokens, penalties and filters): for a random row its
filtered probabilities' sum over those ids, for a greedy row 1 or 0 (whether the argmax is one of them). A
feature that wants the chance of an event it would otherwise only see happen (a sequence ending) reads it here:
its expectation is the event's, with none of the draw's noise.

Scored rows are not sampled: :meth:`Sampler.log_softmax` returns their float32 log-softmax of the raw logits
(for the group kind that asked for them to score).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from batchgen.sampling_params import GREEDY_EPS, SamplingParams


@dataclass
class SamplingRow:
    """Everything the sampler needs to know about one row of the logits batch (built by the engine).

    Plain data. ``seed`` is set for requests with a seed (``sample_seed(seed, sample_index)``,
    :mod:`batchgen.engine.sched.sequence`) and ``key`` names the row's generator across steps (the sequence
    id): the sampler seeds a generator of its own for a new key on the logits' device and advances it by
    exactly one draw of V numbers per random (non-greedy) step, until :meth:`Sampler.release` drops it.
    """

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    key: int = -1
    banned_token_ids: list[int] = field(default_factory=list)


@dataclass
class SamplerOutput:
    """``token_ids[i]`` is row i's sampled token; ``logprobs[i]`` is ``None`` unless row i asked for
    logprobs, else ``{token_id: logprob}`` with the top ``params.logprobs`` tokens and the sampled token
    (so ``k`` or ``k + 1`` entries)."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    sampled: Tensor | None = None
    """The token ids as an int64 tensor on the logits' device (a pipelined engine feeds them to the next
    step's inputs without a host round trip)."""
    watched: dict[int, float] = field(default_factory=dict)
    """Row -> the probability that its draw was one of its watched tokens (rows of ``watch`` only)."""


class WatchedTokens:
    """Token ids whose probability of being drawn a row watches (:class:`Sampler`'s ``watch``), with the forms
    the sampler reads them in, each made once: a set (greedy rows: is the token taken one of them) and an index
    tensor per vocab size and device (random rows: one gather). Compared by identity: rows watching one object
    are summed together."""

    __slots__ = ("ids", "members", "_columns")

    def __init__(self, ids: Iterable[int]) -> None:
        self.ids = tuple(ids)
        self.members = frozenset(self.ids)
        self._columns: dict[tuple[int, str], Tensor] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def columns(self, vocab: int, device: torch.device) -> Tensor:
        """The ids within the vocab as an int64 tensor on ``device``."""
        key = (vocab, str(device))
        cols = self._columns.get(key)
        if cols is None:
            ids = [t for t in self.ids if 0 <= t < vocab]
            cols = self._columns[key] = torch.tensor(ids, dtype=torch.int64, device=device)
        return cols


_FILTER_FIELDS = ("temperature", "top_k", "top_p", "min_p")


@dataclass
class SamplingTensors:
    """The filter settings of N rows as arrays (float64 as in ``SamplingParams``, so every comparison and the
    float32 tensors made from them are exactly those of the per-row values): ``temperature``, ``top_k``
    (int64), ``top_p``, ``min_p``."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> SamplingTensors:
        n = len(params)
        return cls(
            temperature=np.fromiter((p.temperature for p in params), np.float64, n),
            top_k=np.fromiter((p.top_k for p in params), np.int64, n),
            top_p=np.fromiter((p.top_p for p in params), np.float64, n),
            min_p=np.fromiter((p.min_p for p in params), np.float64, n),
        )

    def select(self, idx: np.ndarray | list[int]) -> SamplingTensors:
        return SamplingTensors(*(getattr(self, f)[idx] for f in _FILTER_FIELDS))

    def __len__(self) -> int:
        return self.temperature.shape[0]


class SamplingBatch:
    """Per-row sampling settings kept across steps, keyed by sequence id (vLLM v1's InputBatch sampling
    state, reduced to what the filters read).

    A sequence's row is written once, when it first samples (admission, or its first sampling step after
    being preempted or skipped), and released when a step samples without it (finished, aborted, preempted):
    so a steady decode batch reads its settings with one dict lookup per row and numpy gathers, instead of
    rebuilding every value from the ``SamplingParams``. Invariant after :meth:`gather`: row ``row_of[id]``
    holds the settings of sequence ``id``'s params, for every sequence of that step."""

    def __init__(self, capacity: int = 64) -> None:
        self.arrays = SamplingTensors.from_params([SamplingParams()] * capacity)
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(capacity - 1, -1, -1))

    def _grow(self) -> None:
        old = len(self.arrays)
        more = SamplingTensors.from_params([SamplingParams()] * old)
        self.arrays = SamplingTensors(
            *(np.concatenate([getattr(self.arrays, f), getattr(more, f)]) for f in _FILTER_FIELDS)
        )
        self.free_rows[:0] = range(2 * old - 1, old - 1, -1)

    def gather(self, seq_ids: list[int], params: list[SamplingParams]) -> SamplingTensors:
        """The settings of this step's rows (``params[i]`` is sequence ``seq_ids[i]``'s)."""
        old, new, free = self.row_of, {}, self.free_rows
        rows = np.empty(len(seq_ids), dtype=np.int64)
        pending: list[int] = []
        for i, sid in enumerate(seq_ids):
            row = old.pop(sid, None)
            if row is None:
                pending.append(i)
            else:
                new[sid] = rows[i] = row
        free.extend(old.values())
        a = self.arrays
        for i in pending:
            if not free:
                self._grow()
                a = self.arrays
            row = free.pop()
            p = params[i]
            a.temperature[row], a.top_k[row], a.top_p[row], a.min_p[row] = (
                p.temperature,
                p.top_k,
                p.top_p,
                p.min_p,
            )
            new[seq_ids[i]] = rows[i] = row
        self.row_of = new
        return a.select(rows)


class Sampler:
    """Stateless apart from its random generators: its own (one per device, seeded with ``seed``) and one per
    seeded row key (:class:`SamplingRow`)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[int, torch.Generator] = {}

    def release(self, keys: list[int]) -> None:
        """Drop the generators of these row keys (their sequences are done)."""
        for key in keys:
            self._row_generators.pop(key, None)

    def row_generator(self, row: SamplingRow, device: torch.device) -> torch.Generator:
        """The generator of a seeded row, seeded with ``row.seed`` on ``device`` the first time its key is seen."""
        gen = self._row_generators.get(row.key)
        if gen is None:
            assert row.seed is not None
            gen = torch.Generator(device=_device(device))
            gen.manual_seed(row.seed)
            self._row_generators[row.key] = gen
        return gen

    def generator(self, device: torch.device) -> torch.Generator:
        """The sampler's own generator on ``device`` (used by rows without a seed)."""
        device = _device(device)
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    @torch.inference_mode()
    def __call__(
        self,
        logits: Tensor,
        rows: list[SamplingRow] | None,
        settings: SamplingTensors | None = None,
        watch: dict[int, WatchedTokens] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row. ``logits``: float32 ``[N, V]`` with ``N == len(rows)``; not modified.
        ``settings``: the rows' filter settings when the caller keeps them (:class:`SamplingBatch`), else
        read from the rows' params. ``watch``: rows whose probability of drawing one of the given tokens is
        returned (``SamplerOutput.watched``).

        ``rows=None`` means no row asks for penalties, banned tokens, logprobs or its own seed: without
        ``settings`` every row is greedy (one argmax, no per-row settings built at all: the engine's hot
        path); with ``settings`` the rows are filtered and drawn from those settings alone, with the
        sampler's generator (exactly the draws of the same rows passed as :class:`SamplingRow` objects)."""
        if rows is None:
            if logits.dim() != 2 or (settings is not None and len(settings.temperature) != logits.shape[0]):
                raise ValueError(
                    f"logits must be [N, vocab] with one settings row each, got {tuple(logits.shape)}"
                )
            n = logits.shape[0]
            watched: dict[int, float] = {}
            if settings is None or not n:
                sampled = _argmax(logits)
            else:
                x = logits.float().clone(memory_format=torch.contiguous_format)
                sampled = self._sample(x, None, settings, watch, watched)
            token_ids = sampled.tolist()
            _watch_greedy(token_ids, watch, watched)
            return SamplerOutput(token_ids, [None] * n, sampled, watched)
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [len(rows), vocab], got {tuple(logits.shape)} for {n} rows")
        if n == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        params = [r.params for r in rows]

        all_greedy = all(p.greedy for p in params)
        needs_processing = any(r.banned_token_ids or r.params.needs_penalties for r in rows)
        want_logprobs = any(p.logprobs is not None for p in params)

        watched: dict[int, float] = {}
        if all_greedy and not needs_processing:
            sampled = _argmax(logits)
        else:
            x = logits.float().clone(memory_format=torch.contiguous_format)
            if needs_processing:
                _apply_banned(x, rows)
                _apply_penalties(x, rows)
            if all_greedy:
                sampled = _argmax(x)
            else:
                settings = settings or SamplingTensors.from_params(params)
                sampled = self._sample(x, rows, settings, watch, watched)

        token_ids = sampled.tolist()
        _watch_greedy(token_ids, watch, watched)
        logprobs: list[dict[int, float] | None] = [None] * n
        if want_logprobs:
            _gather_logprobs(logits, rows, sampled, logprobs)
        return SamplerOutput(token_ids, logprobs, sampled, watched)

    @staticmethod
    @torch.inference_mode()
    def log_softmax(logits: Tensor) -> Tensor:
        """Float32 log-softmax of the raw logits ``[N, V]`` of scored rows, on the CPU (their consumer works
        there, one small block per group)."""
        return torch.log_softmax(logits.float(), dim=-1).cpu()

    def _sample(
        self,
        x: Tensor,
        rows: list[SamplingRow] | None,
        settings: SamplingTensors,
        watch: dict[int, WatchedTokens] | None = None,
        watched: dict[int, float] | None = None,
    ) -> Tensor:
        """Greedy rows take the argmax of ``x``; random rows are filtered and drawn (``rows`` None: no row
        has its own generator). Returns ``[N]`` int64; the watched random rows' probabilities go into
        ``watched``."""
        device = x.device
        num_rows = x.shape[0]
        rand_idx = np.flatnonzero(settings.temperature >= GREEDY_EPS).tolist()
        generators = [
            None if rows is None or rows[i].seed is None else self.row_generator(rows[i], device)
            for i in rand_idx
        ]
        all_random = len(rand_idx) == num_rows
        if all_random:
            sampled = torch.empty(num_rows, dtype=torch.int64, device=device)
        else:
            sampled = x.argmax(dim=-1)
        idx = torch.tensor(rand_idx, device=device)
        probs = _filtered_probs(
            x if all_random else x[idx], settings if all_random else settings.select(rand_idx)
        )
        if watch and watched is not None:
            _watch_probs(probs, rand_idx, watch, watched)

        # Exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. is a draw from p. q = -log(u), u ~ U[0, 1)
        # (several times cheaper than exponential_ on CPU): q > 0 always (u < 1), and u == 0 gives q = inf,
        # so a token with p == 0 can never win (0 / q == 0).
        vocab = probs.shape[1]
        u = torch.empty_like(probs)
        unseeded = [j for j, gen in enumerate(generators) if gen is None]
        if len(unseeded) == len(generators):
            torch.rand(u.shape, generator=self.generator(device), device=device, dtype=u.dtype, out=u)
        elif unseeded:
            uidx = torch.tensor(unseeded, device=device)
            u[uidx] = torch.rand(
                (len(unseeded), vocab), generator=self.generator(device), device=device, dtype=u.dtype
            )
        for j, gen in enumerate(generators):
            if gen is not None:
                # Exactly one draw of `vocab` numbers from the row's own generator per step.
                u[j] = torch.rand(vocab, generator=gen, device=gen.device, dtype=u.dtype).to(device)
        q = u.log_().neg_()
        sampled[idx] = (probs / q).argmax(dim=-1)
        return sampled


def _watch_probs(
    probs: Tensor, rand_idx: list[int], watch: dict[int, WatchedTokens], watched: dict[int, float]
) -> None:
    """``watched[row]``: the sum of ``probs`` over the row's watched tokens, for every watched random row
    (``probs[j]`` is row ``rand_idx[j]``'s distribution). Rows watching the same :class:`WatchedTokens` are
    summed in one gather, however many tokens it holds."""
    at = {row: j for j, row in enumerate(rand_idx)}
    groups: dict[WatchedTokens, tuple[list[int], list[int]]] = {}
    for row, tokens in watch.items():
        j = at.get(row)
        if j is not None:
            rows, js = groups.setdefault(tokens, ([], []))
            rows.append(row)
            js.append(j)
    for tokens, (rows, js) in groups.items():
        cols = tokens.columns(probs.shape[1], probs.device)
        if cols.numel() == 0:
            sums = [0.0] * len(rows)
        else:
            sel = torch.tensor(js, dtype=torch.int64, device=probs.device)
            sums = probs.index_select(0, sel).index_select(1, cols).double().sum(dim=1).cpu().tolist()
        for row, v in zip(rows, sums):
            watched[row] = v


def _watch_greedy(
    token_ids: list[int], watch: dict[int, WatchedTokens] | None, watched: dict[int, float]
) -> None:
    """The watched rows not drawn at random (greedy): 1 if the token taken is watched, else 0."""
    for row, tokens in (watch or {}).items():
        if row not in watched and row < len(token_ids):
            watched[row] = 1.0 if token_ids[row] in tokens.members else 0.0


def _device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (ties and NaN alike: the first maximal index). On the CPU through
    numpy, whose vectorised argmax is ~30x faster than torch's on a [256, 4096] float32 block."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 2 and x.shape[1]:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def _apply_banned(x: Tensor, rows: list[SamplingRow]) -> None:
    """Set the logits of each row's banned tokens (ids outside the vocab are ignored) to -inf, in place."""
    vocab = x.shape[1]
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i, r in enumerate(rows):
        for t in r.banned_token_ids:
            if 0 <= t < vocab:
                r_idx.append(i)
                t_idx.append(t)
    if r_idx:
        x[torch.tensor(r_idx, device=x.device), torch.tensor(t_idx, device=x.device)] = -float("inf")


def _flat_index(rows: list[SamplingRow], which: list[int], tokens_of, vocab: int, device) -> Tensor:
    """Flat indices ``i * vocab + token`` into the ``[N, V]`` logits of every token of every row ``i`` in
    ``which`` (``tokens_of(row)`` gives the tokens; repeats are kept; ids outside the vocab are dropped)."""
    token_lists = [tokens_of(rows[i]) for i in which]
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(which, dtype=torch.int64), lengths)
    valid = (tokens >= 0) & (tokens < vocab)
    return (row_ids[valid] * vocab + tokens[valid]).to(device)


def _apply_penalties(x: Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, then frequency and presence penalties, in place on the contiguous ``[N, V]`` logits.

    Sparse: the work is proportional to the number of prompt/output tokens of the penalised rows, not to
    ``N * V``. Every update is either a write of values computed from the original logits (repeated tokens
    write the same value) or an accumulation of identical terms, so the result is deterministic on CUDA too.
    """
    vocab = x.shape[1]
    device = x.device
    flat_x = x.view(-1)

    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        flat = _flat_index(rows, rep, lambda r: r.prompt_token_ids + r.output_token_ids, vocab, device)
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], dtype=x.dtype, device=device)
        penalty = penalty[flat // vocab]
        vals = flat_x[flat]
        flat_x[flat] = torch.where(vals > 0, vals / penalty, vals * penalty)

    freq = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 and r.output_token_ids]
    if freq:
        flat = _flat_index(rows, freq, lambda r: r.output_token_ids, vocab, device)
        fp = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype, device=device)
        flat_x.index_add_(0, flat, -fp[flat // vocab])  # once per occurrence

    pres = [i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 and r.output_token_ids]
    if pres:
        flat = _flat_index(rows, pres, lambda r: r.output_token_ids, vocab, device).unique()
        pp = torch.tensor([r.params.presence_penalty for r in rows], dtype=x.dtype, device=device)
        flat_x.index_add_(0, flat, -pp[flat // vocab])  # once per distinct token


def _filtered_probs(x: Tensor, params: list[SamplingParams] | SamplingTensors) -> Tensor:
    """Probabilities ``[M, V]`` after temperature, top-k, top-p and min-p (each row with its own values).

    Filtered-out tokens have probability exactly 0; the most likely token always survives.
    """
    st = params if isinstance(params, SamplingTensors) else SamplingTensors.from_params(params)
    vocab = x.shape[1]
    device = x.device
    neg_inf = -float("inf")
    temp = torch.from_numpy(st.temperature).to(device=device, dtype=x.dtype)
    x = x / temp.unsqueeze(1)

    # top-k: drop logits below the row's k-th largest (ties at the k-th value are kept, as transformers).
    top_k = np.where((st.top_k > 0) & (st.top_k < vocab), st.top_k, vocab)
    active = top_k < vocab
    if active.any():
        max_k = int(top_k[active].max())
        top_vals = x.topk(max_k, dim=-1).values  # the k-th largest value does not depend on max_k
        k = torch.from_numpy(top_k).to(device)
        kth = top_vals.gather(1, (k - 1).clamp(max=max_k - 1).unsqueeze(1))
        kth = kth.masked_fill((k >= vocab).unsqueeze(1), neg_inf)  # top-k off: remove nothing
        x = x.masked_fill(x < kth, neg_inf)

    # top-p, on the rows that use it (the full sort is the expensive part): keep the smallest set of most
    # likely tokens whose mass, renormalised after top-k, reaches top_p: token j of the sorted row is kept
    # iff the mass strictly before it is < top_p.
    p_rows = np.flatnonzero(st.top_p < 1.0)
    if p_rows.size:
        idx = torch.from_numpy(p_rows).to(device)
        sorted_x, order = x[idx].sort(dim=-1, descending=True)
        sorted_probs = sorted_x.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = torch.from_numpy(st.top_p[p_rows]).to(device=device, dtype=x.dtype)
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        x[idx] = torch.empty_like(sorted_x).scatter_(1, order, sorted_x.masked_fill(drop, neg_inf))

    probs = x.softmax(dim=-1)
    if (st.min_p > 0.0).any():
        min_p = torch.from_numpy(st.min_p).to(device=device, dtype=x.dtype).unsqueeze(1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        # Renormalise only the min-p rows: the other rows' probabilities must not depend on the batch.
        probs = torch.where(min_p > 0.0, probs / probs.sum(dim=-1, keepdim=True), probs)
    return probs


def _gather_logprobs(
    logits: Tensor, rows: list[SamplingRow], sampled: Tensor, out: list[dict[int, float] | None]
) -> None:
    """Fill ``out[i]`` with the top-k and sampled-token logprobs (raw logits) of each row asking for them."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    device = logits.device
    idx = torch.tensor(want, device=device)
    logp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = logp.gather(1, sampled[idx].unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = sampled[idx].tolist()
    max_k = min(max(rows[i].params.logprobs for i in want), logp.shape[1])
    if max_k > 0:
        top_vals, top_ids = logp.topk(max_k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(want):
        k = rows[i].params.logprobs
        d: dict[int, float] = {}
        if k and max_k > 0:
            d = dict(zip(top_ids[j][:k], top_vals[j][:k]))
        d[chosen_ids[j]] = chosen[j]
        out[i] = d
