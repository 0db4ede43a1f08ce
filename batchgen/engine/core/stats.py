"""Running totals of an engine: the figures the job report and progress bar print.

Each component owns its counters and alone writes them: the scheduler its :class:`SchedulerCounters`, the
engine its :class:`EngineCounters`, the KV cache manager its :class:`~batchgen.engine.kv.kv_cache.KVCacheStats`.
One :class:`StatsCollector` snapshots them into the public :class:`EngineStats` (once per step, and whenever
``llm.engine.stats`` is read), where it also keeps the peaks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.engine.kv.kv_cache import KVCacheManager


@dataclass
class EngineStats:
    """Counters since the engine started.

    ``prompt_tokens_cached`` counts prompt tokens whose KV blocks the prefix cache shared at admission (whole
    blocks, like each output's ``num_cached_tokens``); ``prompt_tokens_copied`` the tokens of a cached prefix
    ending inside a block, copied from a cached block at admission instead of computed;
    ``prompt_tokens_computed`` counts tokens run through the model as prefill (recomputation after a
    preemption included). ``num_preemptions`` counts preempted request groups (each with all its sequences);
    ``num_swapped_out_blocks`` / ``num_swapped_in_blocks`` count KV blocks copied to / from CPU memory by
    swap-mode preemption (``swapped_seqs``: sequences swapped out now). KV figures: ``kv_usage`` is blocks in use ÷ pool size; ``kv_utilization`` is token
    slots holding live tokens ÷ slots in allocated blocks; ``kv_fragmentation`` is 1 − kv_utilization.
    """

    num_blocks: int = 0
    block_size: int = 0
    bytes_per_block: int = 0
    max_model_len: int = 0
    num_requests: int = 0
    num_finished_requests: int = 0
    num_error_requests: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_copied: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_cow_copies: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    running_seqs: int = 0
    waiting_seqs: int = 0
    swapped_seqs: int = 0
    peak_running_seqs: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    peak_kv_usage: float = 0.0
    kv_utilization: float = 1.0
    min_kv_utilization: float = 1.0
    kv_fragmentation: float = 0.0
    peak_kv_fragmentation: float = 0.0
    async_steps: int = 0
    """engine.async_scheduling: steps scheduled and prepared while the previous step's forward ran."""
    drained_steps: int = 0
    """engine.async_scheduling: steps scheduled with nothing in flight (the first after idling, or after
    the pipeline drained: a request needing synchronous steps, swapping, a pool too full to rule out
    preemption); with async_steps, every step that ran a forward."""

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens whose blocks the prefix cache shared."""
        return self.prompt_tokens_cached / self.prompt_tokens if self.prompt_tokens else 0.0

    def delta(self, before: EngineStats) -> EngineStats:
        """The work done since ``before`` (an earlier snapshot of the same engine): counters are differences,
        gauges and peaks (running/waiting sequences, KV usage, utilization, sizes) are this snapshot's."""
        out = replace(self)
        for name in _COUNTERS:
            setattr(out, name, getattr(self, name) - getattr(before, name))
        return out

    def snapshot(self) -> EngineStats:
        """A copy that later steps do not change."""
        return replace(self)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d


_COUNTERS = (
    "num_requests",
    "num_finished_requests",
    "num_error_requests",
    "prompt_tokens",
    "prompt_tokens_cached",
    "prompt_tokens_copied",
    "prompt_tokens_computed",
    "generated_tokens",
    "num_steps",
    "num_preemptions",
    "num_cow_copies",
    "num_swapped_out_blocks",
    "num_swapped_in_blocks",
    "async_steps",
    "drained_steps",
)
"""Fields that only grow: :meth:`EngineStats.delta` subtracts these and keeps the others as they are."""


@dataclass
class SchedulerCounters:
    """What the scheduler counts: prefix hits and prefill tokens at admission and scheduling, tokens
    generated, steps, preemptions, copies (on write, swaps), and its queue sizes after the last step."""

    prompt_tokens_cached: int = 0
    prompt_tokens_copied: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_cow_copies: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    running_seqs: int = 0
    waiting_seqs: int = 0
    swapped_seqs: int = 0


@dataclass
class EngineCounters:
    """What the engine counts: requests in and out, prompt tokens queued, async and drained steps."""

    num_requests: int = 0
    num_finished_requests: int = 0
    num_error_requests: int = 0
    prompt_tokens: int = 0
    async_steps: int = 0
    drained_steps: int = 0


_SCHEDULER_FIELDS = tuple(f.name for f in fields(SchedulerCounters))
_ENGINE_FIELDS = tuple(f.name for f in fields(EngineCounters))


class StatsCollector:
    """Snapshots the components' counters into one :class:`EngineStats` (``stats``, updated in place)."""

    def __init__(
        self, stats: EngineStats, scheduler: SchedulerCounters, kv: KVCacheManager, engine: EngineCounters
    ) -> None:
        self.stats = stats
        self._scheduler = scheduler
        self._kv = kv
        self._engine = engine

    def collect(self) -> EngineStats:
        st = self.stats
        for source, names in ((self._scheduler, _SCHEDULER_FIELDS), (self._engine, _ENGINE_FIELDS)):
            for name in names:
                setattr(st, name, getattr(source, name))
        st.peak_running_seqs = max(st.peak_running_seqs, st.running_seqs)
        kvs = self._kv.stats()
        st.kv_blocks_used = kvs.blocks_used
        st.kv_usage = kvs.blocks_used / self._kv.num_blocks
        st.peak_kv_usage = max(st.peak_kv_usage, st.kv_usage)
        st.kv_utilization = kvs.kv_utilization
        st.kv_fragmentation = kvs.internal_fragmentation
        if kvs.blocks_used:
            st.min_kv_utilization = min(st.min_kv_utilization, kvs.kv_utilization)
            st.peak_kv_fragmentation = max(st.peak_kv_fragmentation, kvs.internal_fragmentation)
        return st
