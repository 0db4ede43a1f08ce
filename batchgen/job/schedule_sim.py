"""The engine's schedule simulated over a job's rows, each step priced by a step-time model: the seconds a plan
predicts.

The simulation follows :class:`batchgen.engine.sched.scheduler.Scheduler` (recompute preemption):

- **A step.** Decoding requests first (one token per sample), then unfinished prefills in chunks under
  ``max_num_batched_tokens``, then waiting requests admitted in order while the token budget, the sequence cap
  (``max_num_seqs``, a request's ``n`` samples counted) and the KV pool allow. A prefill's last chunk samples
  the first token; then the request decodes one token per step until its output length.
- **KV blocks** as :class:`batchgen.engine.kv.kv_cache.KVCacheManager` hands them out: at admission, blocks
  for the whole prompt less the whole blocks the prefix cache serves, admitted only while
  ``max(1, num_blocks // 100)`` blocks (the scheduler's watermark) stay free when anything runs; one more block
  each time a decoding sample's context crosses a block boundary; all freed when the request ends — at its
  output length, which is the *expected* one (EOS and stop strings end rows before ``max_tokens``), so blocks
  come back when the engine gives them back. The ``n`` samples of a request share its prompt's full blocks
  (each copies the partial last one).
- **Preemption.** When the decoders' next blocks do not fit, the most recently admitted running request is
  preempted (its blocks freed) until they do; it goes back to the front of the waiting queue with the tokens
  it generated, and on re-admission computes its prompt and those tokens again (prefix hits as before).

Approximations: blocks a request shares from the prefix cache are counted by the request that computed them
alone (shared blocks outliving it are not), a request's samples move together, swap-mode preemption is
priced as recompute. ``tests/test_schedule_sim.py`` holds the simulation to the real scheduler, KV-bound pools
included.

**Cost.** Stretches without admissions, prefills or preemptions are summed in closed form: the step model's
terms over the stretch, and the blocks the decoders take over it from a histogram of their contexts modulo
``block_size`` (O(block_size) per stretch, a binary search finding where the pool runs out). The simulation
costs O(rows log rows) plus the steps that admit or preempt.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class SimRequest:
    """A row as the simulation sees it: prompt tokens to compute (after prefix sharing), prompt length,
    output tokens per sample, samples."""

    compute: int
    prompt: int
    output: int
    n: int = 1


@dataclass
class SimResult:
    seconds: float
    steps: int
    peak_running: int
    """Most sequences admitted at once."""
    preemptions: int = 0
    peak_blocks: int = 0
    """Most KV blocks held at once (0 without a pool)."""
    prompt_tokens: int = 0
    """Prompt tokens computed: after prefix sharing, and again (with the tokens generated) after preemption."""


class _Decoder:
    """A decoding request: its context at step ``t`` is ``offset + t`` tokens per sample, its blocks
    ``base + n * ceil((offset + t) / block_size)``."""

    __slots__ = ("req", "start", "offset", "n", "base", "finish")

    def __init__(self, req: SimRequest, start: int, base: int, finish: int) -> None:
        self.req, self.start, self.n, self.base, self.finish = req, start, req.n, base, finish
        self.offset = req.prompt + 1 - start


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Schedule:
    """The scheduler's state over the simulated steps (module docstring)."""

    def __init__(
        self,
        reqs: Any,
        model: Any,
        max_num_seqs: int,
        max_batched_tokens: int,
        kv_tokens: int | None,
        block_size: int,
    ) -> None:
        self.model, self.max_seqs, self.max_tokens = model, max_num_seqs, max_batched_tokens
        self.bs = max(1, block_size)
        self.pool = None if kv_tokens is None else max(1, kv_tokens // self.bs)
        self.watermark = max(1, self.pool // 100) if self.pool is not None else 0
        self.waiting: deque[SimRequest] = deque(reqs)
        self.prefilling: deque[list[Any]] = deque()  # [tokens left to compute, request, uid, blocks held]
        self.decoders: list[tuple[int, int]] = []  # heap of (finish step, uid); preempted ones are stale
        self.live: dict[int, Any] = {}  # uid -> its prefilling item or its _Decoder
        self.order: list[int] = []  # uids in admission order (the last live one is the next victim)
        self.seqs = 0  # samples admitted and not finished
        self.s0 = 0  # sum over decoders of n * offset: their context at step t is s0 + dn * t
        self.dn = 0  # decoding samples
        self.held = 0  # blocks held by prefilling requests
        self.dec_base = 0  # sum of the decoders' base
        self.dec_ceil = 0  # sum over decoders of n * ceil((offset + step) / bs)
        self.hist = [0] * self.bs  # decoding samples by offset mod bs
        self.step = 0
        self.t = 0.0
        self.uid = 0
        self.peak = self.peak_blocks = self.preemptions = 0
        self.prompt_tokens = 0

    # ------------------------------------------------------------------------------------------ blocks
    def used(self) -> int:
        return self.held + self.dec_base + self.dec_ceil

    def growth(self, k: int) -> int:
        """Blocks the decoders take over the next ``k`` steps."""
        bs, s, total = self.bs, self.step, 0
        for q, c in enumerate(self.hist):
            if c:
                r = (q + s) % bs
                total += c * (_ceil_div(r + k, bs) - (1 if r else 0))
        return total

    def advance(self, k: int) -> None:
        if self.pool is not None:
            self.dec_ceil += self.growth(k)
        self.step += k

    def admission_blocks(self, r: SimRequest) -> int:
        """Blocks admitting ``r`` takes: its prompt's, less the whole blocks the prefix cache serves."""
        return _ceil_div(r.prompt, self.bs) - (r.prompt - r.compute) // self.bs

    def can_admit(self) -> bool:
        if not self.waiting:
            return False
        r = self.waiting[0]
        if self.seqs and self.seqs + r.n > self.max_seqs:
            return False
        if self.pool is None or not self.seqs:
            return True
        return self.admission_blocks(r) + self.watermark <= self.pool - self.used()

    # ------------------------------------------------------------------------------------ transitions
    def admit(self) -> None:
        r = self.waiting.popleft()
        self.seqs += r.n
        blocks = self.admission_blocks(r) if self.pool is not None else 0
        self.held += blocks
        item = [max(r.compute, 1), r, self.uid, blocks]
        self.prefilling.append(item)
        self.live[self.uid] = item
        self.order.append(self.uid)
        self.uid += 1

    def prefilled(self, item: list[Any]) -> None:
        """``item``'s prefill completed in this step with its first token."""
        _left, r, uid, blocks = item
        self.held -= blocks
        left = r.output - 1
        if left <= 0:
            self.seqs -= r.n
            del self.live[uid]
            return
        bs, n = self.bs, r.n
        # the samples share the prompt's full blocks and each holds the rest of its context
        base = blocks - _ceil_div(r.prompt, bs) - (n - 1) * (r.prompt // bs)
        d = _Decoder(r, self.step + 1, base, self.step + left + 1)
        self.live[uid] = d
        heapq.heappush(self.decoders, (d.finish, uid))
        self.s0 += n * d.offset
        self.dn += n
        if self.pool is not None:
            self.dec_base += base
            self.dec_ceil += n * _ceil_div(d.offset + self.step, bs)
            self.hist[d.offset % bs] += n

    def drop_decoder(self, d: _Decoder) -> None:
        self.s0 -= d.n * d.offset
        self.dn -= d.n
        self.seqs -= d.n
        if self.pool is not None:
            self.dec_base -= d.base
            self.dec_ceil -= d.n * _ceil_div(d.offset + self.step, self.bs)
            self.hist[d.offset % self.bs] -= d.n

    def finish_decoders(self) -> None:
        heap = self.decoders
        while heap and heap[0][0] <= self.step:
            d = self.live.pop(heapq.heappop(heap)[1], None)
            if d is not None:  # else preempted: a stale entry
                self.drop_decoder(d)

    def next_finish(self) -> int:
        heap = self.decoders
        while heap[0][1] not in self.live:
            heapq.heappop(heap)  # a preempted request's stale entry
        return heap[0][0]

    def preempt_to_fit(self) -> None:
        """Preempt the most recently admitted running requests while the step's blocks do not fit."""
        assert self.pool is not None
        while self.used() > self.pool and len(self.live) > 1:
            uid = self.order.pop()
            x = self.live.pop(uid, None)
            if x is None:
                continue
            self.preemptions += 1
            if isinstance(x, _Decoder):
                self.drop_decoder(x)
                g = 1 + self.step - x.start  # tokens generated so far, computed again on re-admission
                r = x.req
                self.waiting.appendleft(SimRequest(r.compute + g, r.prompt + g, r.output - g, r.n))
            else:
                self.prefilling.remove(x)
                self.held -= x[3]
                self.seqs -= x[1].n
                self.waiting.appendleft(x[1])

    # ---------------------------------------------------------------------------------------- the loop
    def run(self) -> SimResult:
        c = self.model.coef
        while self.waiting or self.prefilling or self.decoders:
            if self.pool is not None:
                if self.used() > self.pool:
                    self.preempt_to_fit()
                self.peak_blocks = max(self.peak_blocks, self.used())
            can_admit = self.can_admit()
            if not self.prefilling and not can_admit and self.decoders:
                self.decode_stretch(c)
            elif not self.prefilling and not can_admit:
                break  # only stale entries were left
            else:
                self.mixed_step(can_admit)
            self.finish_decoders()
            self.peak = max(self.peak, self.seqs)
        return SimResult(self.t, self.step, self.peak, self.preemptions, self.peak_blocks, self.prompt_tokens)

    def decode_stretch(self, c: Any) -> None:
        """Decode steps until the next request finishes or the pool runs out: D fixed, K growing by D a step."""
        if not self.live:  # only preempted requests' stale entries are left
            self.decoders.clear()
            return
        k = max(1, self.next_finish() - self.step)
        if self.pool is not None and self.used() + self.growth(k - 1) > self.pool:
            lo, hi = 0, k - 1  # the step at offset lo fits, hi does not
            room = self.pool - self.used()
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self.growth(mid) <= room:
                    lo = mid
                else:
                    hi = mid
            k = lo + 1
        if self.pool is not None:  # the stretch's last step holds the most
            self.peak_blocks = max(self.peak_blocks, self.used() + self.growth(k - 1))
        dn, step = self.dn, self.step
        kk = (self.s0 + dn * step) * k + dn * k * (k - 1) / 2  # sum of K over the k steps
        self.t += k * (c[0] + c[2] * dn) + c[3] * kk / 1000.0
        self.advance(k)

    def mixed_step(self, can_admit: bool) -> None:
        """One step with prefill chunks (and admissions): the decoders' tokens first, then chunks."""
        dn0, k0 = self.dn, self.s0 + self.dn * self.step
        budget = max(0, self.max_tokens - self.dn)
        p = done_now = 0
        while budget > 0 and (self.prefilling or can_admit):
            if not self.prefilling:
                self.admit()
            item = self.prefilling[0]
            take = min(budget, item[0])
            item[0] -= take
            budget -= take
            p += take
            if item[0] == 0:
                self.prefilling.popleft()
                done_now += item[1].n
                self.prefilled(item)
            can_admit = self.can_admit()
        self.t += self.model.step_time(p, dn0 + done_now, k0)
        self.prompt_tokens += p
        self.advance(1)


def simulate_schedule(
    reqs: Any,
    model: Any,
    max_num_seqs: int,
    max_batched_tokens: int,
    kv_tokens: int | None,
    block_size: int = 16,
) -> SimResult:
    """Seconds the engine takes over ``reqs`` (:class:`SimRequest`, in feed order) when each step costs
    ``model.step_time(prompt tokens, sampled sequences, context tokens)`` (module docstring); ``kv_tokens``:
    the KV pool in tokens (None: unbounded), in blocks of ``block_size``."""
    return _Schedule(reqs, model, max_num_seqs, max_batched_tokens, kv_tokens, block_size).run()
