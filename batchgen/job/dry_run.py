"""The dry run (``run.dry_run=true``, ``LLM.plan``): what a job will cost before it runs.

The input is read exactly as the job reads it (streamed, this shard's windows, any store), every row rendered
and tokenized by the job's own code (or an even sample of whole windows with ``plan.sample_rows``: the plan
says so and scales its totals), and each window grouped as the job groups it. From those rows:

- rows, and the rows that would be error rows, by reason with the first ids of each (the engine's refusals
  included: a KV pool too small for a row, an adapter that cannot be read), and ``warnings`` when they, or an
  output the job would refuse, would end the job with exit status 2 or 3;
- prompt tokens (total, p50/p90/p99/max) and those left to compute after prefix sharing, from a simulation
  of the engine's block-level prefix cache over the job's feed order (:mod:`.prefix_sim`; image tokens keyed
  by the image, one cache per replica, a sample's cold windows counted once): the predicted
  ``tokens.prefix_hit_rate``; where sharing is lost (the first token position at which rows differ, mapped
  back to the column, chat message or image and the characters there; a long run of text most rows share
  after a per-row part, chat rows as rendered) and which order would share more;
- the output-token bound, and the output tokens expected from a calibration (:mod:`.calibrate`: the real
  engine over a stratified sample of rows, at most ``plan.calibration_fraction`` of the predicted time);
- KV bytes per token, sequences that fit, recommended ``engine.max_num_seqs``, ``data.window_rows``,
  ``engine.kv_cache_memory``, tensor parallelism and replicas;
- the predicted wall time of the run's work (what the report's ``run.wall_time_s`` measures: engine start-up
  excluded) with a low-high range, device-hours and, with ``plan.cost_per_hour``, a cost; per replica.

The plan is printed and written to ``_plan.json`` in the shard's output directory; the output's rows and
manifest are never touched (no lock, lease or manifest is taken: a job may be running into it).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import time
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.engine.config import parse_bytes
from batchgen.job.calibrate import (
    Calibration,
    CalibrationRow,
    StepCache,
    StepModel,
    compute_threads,
    load_average,
    output_bound,
    relative_spread,
    run_calibration,
    sampling_signature,
    strata_order,
)
from batchgen.job.prefix_sim import common_prefix_len, shared_run_after_start, simulate_prefix_cache
from batchgen.job.schedule_sim import SimRequest, simulate_schedule
from batchgen.job.tally import error_key

logger = logging.getLogger("batchgen.job")

NUM_ERROR_IDS = 5
"""Ids shown per error reason."""
SHARING_SAMPLE = 256
"""Rows the sharing analysis (where rows stop sharing) looks at."""


@dataclass
class PlanRow:
    """One row as the plan sees it: its tokens and parameters, or its error."""

    index: int
    id: Any
    token_ids: list[int] | None
    params: Any
    """Its SamplingParams (a prompt-only job's: what its model needs of the row, :mod:`.prefill_plan`)."""
    error: str | None = None
    lora: Any = None
    source: Any = None
    """The row's prompt as given (the column's text, or its chat messages), for the sharing analysis."""
    images: tuple[tuple[str, int, int], ...] = ()
    """The row's images in prompt order: (content hash, first placeholder position, placeholder tokens)."""
    cache_ids: list[int] | None = None
    """The tokens as the prefix cache keys them: ``token_ids`` with each image's placeholder positions keyed
    by the image (as the engine does: the same image shares, different images never do); None for a row
    without images (its ``token_ids``)."""

    @property
    def keyed(self) -> list[int] | None:
        """The token ids the prefix cache sees (``cache_ids``, else ``token_ids``)."""
        return self.cache_ids if self.cache_ids is not None else self.token_ids


def lookup_tokens(params: Any) -> int | None:
    """The prompt's first tokens the engine may serve from the prefix cache for a row with ``params`` (None:
    all): a row asking for its prompt's logprobs needs every prompt token's logits, so it reads nothing from
    the cache (it still fills it), as :class:`~batchgen.engine.features.prompt_logprobs.PromptLogprobsAddOn`
    limits it."""
    return 1 if getattr(params, "prompt_logprobs", None) is not None else None


IMAGE_KEY_BITS = 16
"""Offset bits of a simulated image token id: ``-((key << IMAGE_KEY_BITS) + offset) - 1`` (negative, so never a
vocabulary id)."""


def engine_sequences(params: Any) -> int:
    """Sequences the engine runs for a row: its ``n`` samples, or its ``beam_width`` beams under beam search
    (the engine generates every beam's tokens, and counts them in ``tokens.generated``)."""
    n = getattr(params, "n", 1) or 1
    return max(1, n, getattr(params, "beam_width", 1) or 1)


def image_keyed_ids(token_ids: list[int], images: Any, keys: dict[str, int]) -> list[int] | None:
    """``token_ids`` with each image's placeholder positions replaced by ids unique to its content hash
    (``keys``: hash -> small key, extended as new images appear), as the engine's prefix cache keys them;
    None when the row has no image."""
    if not images:
        return None
    ids = list(token_ids)
    for item in images:
        key = keys.setdefault(item.hash, len(keys))
        offsets = item.offsets if item.offsets is not None else range(item.num_tokens)
        for k, off in enumerate(offsets):
            pos = item.start + off
            if 0 <= pos < len(ids):
                ids[pos] = -((key << IMAGE_KEY_BITS) + k) - 1
    return ids


KEEP_ROWS = 4096
"""Rows whose tokens the dry run keeps (an even sample of the fed rows): the calibration's candidates and the
sample of the sharing analysis across windows. Every other row is reduced to its counts as it is read."""
SORTED_ANALYSIS_ROWS = 50_000
"""Up to this many rows, the order that would share most is simulated over all of them; above, over the kept
sample."""


@dataclass
class PlanInput:
    """The rows the dry run read, reduced as they are read (:meth:`add_window`) to per-row counts in the job's
    feed order, the prefix cache simulated over them; only an even sample of rows keeps its tokens."""

    rows_total: int
    block_size: int
    max_model_len: int
    num_blocks: int | None = None
    prompt_column: str | None = None
    messages_column: str | None = None
    image_column: str | None = None
    group_by_prefix: bool = True
    prefix_caching: bool = True
    """engine.enable_prefix_caching: without it nothing is shared."""
    shard: dict[str, Any] = field(default_factory=dict)
    keep_every: int = 1
    rows_read: int = 0
    read_seconds: float = 0.0
    window_reads: list[tuple[int, float]] = field(default_factory=list)
    """Each window read, in order: (its rows, the seconds its reading, rendering, tokenizing and grouping took).
    The first holds the one-time set-up the job pays before its work (a chat template's tokenizer loaded on
    the first row); the others time what the job does beside the engine (:attr:`reading_beside_s`)."""
    lens: array = field(default_factory=lambda: array("q"))
    """Per fed row (the job's order; 8 bytes a row each): prompt tokens; then tokens the cache serves, tokens
    copied, the output bound per sequence, sequences (:func:`engine_sequences`), and a hash of the first block
    (the row's prefix group)."""
    cached: array = field(default_factory=lambda: array("q"))
    copied: array = field(default_factory=lambda: array("q"))
    bounds: array = field(default_factory=lambda: array("q"))
    ns: array = field(default_factory=lambda: array("q"))
    heads: array = field(default_factory=lambda: array("q"))
    kept: dict[int, PlanRow] = field(default_factory=dict)
    """Fed index -> row (with its tokens), every ``keep_every``-th."""
    first: list[PlanRow] = field(default_factory=list)
    """The first rows fed (with their source text): the sample of the sharing analysis."""
    errors: dict[str, dict[str, Any]] = field(default_factory=dict)
    window_sizes: list[int] = field(default_factory=list)
    grouped_cached: int = 0
    """Tokens the cache would serve with each window ordered by tokens (data.group_by_prefix=true)."""
    all_tokens: list[tuple[Any, list[int]]] | None = field(default_factory=list)
    """(root, tokens) of every fed row while there are at most SORTED_ANALYSIS_ROWS; then None."""
    replicas: int = 1
    """Engine replicas (engine.data_parallel_size): each has its own prefix cache, and takes whole windows in
    turn (window k to replica k mod replicas, as :func:`_simulate_parts` divides the work)."""
    cold_rows_read: int = 0
    """Rows read in the first window of each replica (the windows that start on an empty prefix cache)."""
    cold_fed: int = 0
    """Fed rows of those windows: the first ``cold_fed`` entries of the per-row arrays."""
    max_num_seqs: int | None = None
    """engine.max_num_seqs (a beam search wider than it cannot run)."""
    batch_file: bool = False
    """The rows are an OpenAI batch file's requests (the chat messages are their bodies', not a column's)."""
    _sims: list[Any] = field(default_factory=list)
    _grouped_sims: list[Any] = field(default_factory=list)

    @property
    def messages_label(self) -> str:
        """Where the chat messages come from, in the user's words."""
        if self.batch_file:
            return "the requests' body.messages"
        return f"data.messages_column {self.messages_column!r}"

    def unservable(self, num_tokens: int, params: Any) -> str | None:
        """Why the engine would refuse a row of ``num_tokens`` prompt tokens with ``params`` (its longest
        sequence, or its beams, need more KV blocks than the pool holds), in the engine's words; None when it
        fits, or when the pool is not known before the engine starts (an accelerator)."""
        bs, cap = self.block_size, self.num_blocks
        if cap is None or params is None:
            return None
        longest = num_tokens + output_bound(num_tokens, params, self.max_model_len)
        k = getattr(params, "beam_width", 1) or 1
        if k > 1:
            if self.max_num_seqs is not None and k > self.max_num_seqs:
                return f"beam_width={k} exceeds engine.max_num_seqs={self.max_num_seqs}"
            need = -(-num_tokens // bs) + k * (-(-(longest - num_tokens) // bs) + 1)
            what = f"prompt ({num_tokens} tokens) plus max_tokens for {k} beams"
        else:
            need, what = -(-longest // bs), f"prompt ({num_tokens} tokens) plus max_tokens"
        if need <= cap:
            return None
        return (f"{what} needs {need} KV blocks but the pool holds {cap}; raise engine.kv_cache_memory / "
                "num_blocks or lower max_tokens")  # fmt: skip

    def add_window(
        self, rows: list[PlanRow], feed: list[int], skip: frozenset[int] = frozenset(), unseen: int = 0
    ) -> None:
        """One window's rows (input order) and the positions the job feeds, in its order; a fed row the engine
        would refuse (:meth:`unservable`) is an error row, as in the job. ``skip``: positions an earlier run
        into the output already did (not fed, not counted). ``unseen``: rows of the windows a sample left out
        since the last one (the job admits them meanwhile)."""
        from batchgen.job.prefix_sim import PrefixCacheSim

        if skip:
            rows_counted = [r for pos, r in enumerate(rows) if pos not in skip]
        else:
            rows_counted = rows

        kept_feed = []
        for pos in feed:
            r = rows[pos]
            why = self.unservable(len(r.token_ids), r.params) if r.token_ids is not None else None
            if why is None:
                kept_feed.append(pos)
            else:
                r.error = why
        feed = kept_feed

        if not self._sims:
            n = max(1, self.replicas)
            delay = self.max_num_seqs or 1  # the rows admitted with one come before its output fills a block
            self._sims = [PrefixCacheSim(self.block_size, self.num_blocks, delay) for _ in range(n)]
            self._grouped_sims = [PrefixCacheSim(self.block_size, self.num_blocks, delay) for _ in range(n)]
        sim = self._sims[len(self.window_sizes) % len(self._sims)]
        grouped_sim = self._grouped_sims[len(self.window_sizes) % len(self._sims)]
        sim.elapse(unseen // len(self._sims))
        if len(self.window_sizes) < len(self._sims):
            self.cold_rows_read += len(rows_counted)
            self.cold_fed += len(feed)
        self.rows_read += len(rows_counted)
        self.window_sizes.append(len(feed))
        bs = self.block_size
        for r in rows_counted:
            if r.error is not None:
                e = self.errors.setdefault(
                    error_key(r.error), {"rows": 0, "example": r.error, "first_ids": []}
                )
                e["rows"] += 1
                if len(e["first_ids"]) < NUM_ERROR_IDS:
                    e["first_ids"].append(r.id if r.id is not None else r.index)
        for pos in feed:
            r = rows[pos]
            toks = r.keyed
            assert toks is not None
            root = _root(r)
            bound = output_bound(len(toks), r.params, self.max_model_len)
            c, k = sim.admit(toks, root, lookup_tokens(r.params), bound) if self.prefix_caching else (0, 0)
            i = len(self.lens)
            self.lens.append(len(toks))
            self.cached.append(c)
            self.copied.append(k)
            self.bounds.append(bound)
            self.ns.append(engine_sequences(r.params))
            self.heads.append(hash(tuple(toks[:bs])))
            if i % self.keep_every == 0:
                self.kept[i] = r
            if len(self.first) < SHARING_SAMPLE:
                self.first.append(r)
            if self.all_tokens is not None:
                self.all_tokens.append((root, toks))
                if len(self.all_tokens) > SORTED_ANALYSIS_ROWS:
                    self.all_tokens = None
        if not self.group_by_prefix and self.prefix_caching:
            for pos in sorted(feed, key=lambda p: rows[p].keyed):  # type: ignore[arg-type,return-value]
                r = rows[pos]
                self.grouped_cached += grouped_sim.admit(r.keyed, _root(r), lookup_tokens(r.params))[0]

    @property
    def first_window_s(self) -> float:
        """Seconds the first window's reading took (the job reads it before its work starts); without
        per-window times, the mean window's."""
        if self.window_reads:
            return self.window_reads[0][1]
        return self.read_seconds / max(1, len(self.window_sizes))

    @property
    def reading_beside_s(self) -> float:
        """Seconds the job spends reading its windows after the first (beside the engine, within its wall
        time): the shard's rows past the first window at the per-row time of the windows read after the first
        one (the first's one-time set-up is not the other windows'); at the first window's own rate when it is
        the only one read."""
        reads = self.window_reads
        if not reads:
            n = len(self.window_sizes)
            return (
                self.read_seconds * (self.rows_total / max(1, self.rows_read)) * (1 - 1 / n) if n > 1 else 0.0
            )
        later = reads[1:] or reads[:1]
        rows = sum(r for r, _ in later)
        per_row = sum(t for _, t in later) / rows if rows else 0.0
        return per_row * max(0, self.rows_total - reads[0][0])

    @property
    def saved(self) -> list[int]:
        """Prompt tokens each fed row does not compute (cached or copied)."""
        return [c + k for c, k in zip(self.cached, self.copied)]

    @property
    def warm_weight(self) -> float:
        """How many rows of the shard each fed row stands for, past the cold windows (each replica's first,
        which start on an empty cache and are read whatever the sample): 1 when every row was read. The cold
        windows stand for themselves only, so a sample of a few windows does not count their misses once per
        sampled window."""
        rest = self.rows_read - self.cold_rows_read
        return (self.rows_total - self.cold_rows_read) / rest if rest > 0 else 1.0

    def weighted(self, per_row: Sequence[int]) -> float:
        """The shard's total of a per-fed-row figure: the cold windows' rows once, the others weighted by
        :attr:`warm_weight`."""
        k = self.cold_fed
        return sum(per_row[:k]) + self.warm_weight * sum(per_row[k:])

    @property
    def hit_rate(self) -> float:
        """The predicted ``tokens.prefix_hit_rate``: cached over admitted prompt tokens, both as
        :meth:`weighted` totals."""
        total = self.weighted(self.lens)
        return self.weighted(self.cached) / total if total else 0.0


@dataclass
class Plan:
    """A dry run's plan (``_plan.json``): ``plan.data`` is its dict; the main figures are attributes."""

    data: dict[str, Any]

    @property
    def wall_time_s(self) -> float | None:
        return self.data["predicted"].get("wall_time_s")

    @property
    def wall_time_range_s(self) -> list[float] | None:
        return self.data["predicted"].get("wall_time_range_s")

    @property
    def prefix_hit_rate(self) -> float:
        return self.data["predicted"]["prefix_hit_rate"]

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def __str__(self) -> str:
        from batchgen.job.plan_report import format_plan

        return format_plan(self.data)


# ------------------------------------------------------------------------------------------- reading
def _sample_windows(n_windows: int, window_rows: list[int], sample_rows: int | None) -> list[int]:
    """Indices of the windows to read: all, or evenly spaced ones holding about ``sample_rows`` rows."""
    total = sum(window_rows)
    if sample_rows is None or sample_rows >= total or n_windows == 0:
        return list(range(n_windows))
    mean = total / n_windows
    k = max(1, min(n_windows, math.ceil(sample_rows / max(mean, 1))))
    return sorted({int(i * n_windows / k) for i in range(k)})


def shard_facts(plan: Any, windows: int) -> dict[str, Any]:
    """The plan's ``shard``: this shard's index and count, its rows and windows."""
    d = plan.cfg.data
    return {"index": d.shard.index, "count": d.shard.count, "row_start": plan.row_start, "row_end": plan.row_end,
            "windows": windows}  # fmt: skip


@dataclass
class WorkLeft:
    """What a run into an output an earlier run started has left to do (read only, as the job will resume it):
    the windows without a part (and, with ``data.retry_errors``, those with retryable error rows), less the
    rows already done in them (checkpointed, or ok in the part being retried)."""

    specs: list[Any]
    """The windows the run works on, in order."""
    skip: dict[int, frozenset[int]]
    """Window index -> positions already done (not run again)."""
    rows: int
    """Rows the run works on."""
    rows_done: int
    windows_done: int

    def facts(self, windows: int) -> dict[str, Any]:
        """The plan's ``resume`` section (``windows``: the shard's)."""
        return {"windows_done": self.windows_done, "rows_done": self.rows_done, "windows_left": len(self.specs),
                "rows_left": self.rows, "windows": windows,
                "note": f"this output holds {self.rows_done} row(s) of an earlier run: the plan covers the "
                        f"{self.rows} row(s) the job has left to do"}  # fmt: skip


def work_left(plan: Any, outdir: Any) -> WorkLeft | None:
    """What the job has left to do in ``outdir`` (read only); None when it would run every row of the shard
    (a fresh output, ``data.overwrite``, an output it would take over or refuse)."""
    import pyarrow.compute as pc

    from batchgen.job.plan import RETRY_KEYS, fresh_manifest
    from batchgen.job.resume import WindowsTodo

    d = plan.cfg.data
    m = outdir.manifest_to_resume(fresh_manifest(plan), d.overwrite, RETRY_KEYS, d.retry_errors)
    if m is None or not (m.windows or m.partial):
        return None
    specs, skip = [], {}
    for t in WindowsTodo(plan, m):
        done: set[int] = set()
        if t.retry_part:  # the part's rows other than those retried stay as they are
            retry = set(t.retry_rows)
            done.update(p for p in range(t.spec.num_rows) if p not in retry)
        try:
            pieces = outdir.checkpoint_pieces(t.spec.index, m)
        except OSError:  # a checkpoint that cannot be read: its rows are planned (the job says what is wrong)
            pieces = []
        for piece in pieces:
            if d.retry_errors:  # checkpointed error rows caused by settings are recomputed too
                piece = piece.filter(pc.invert(piece.column("_retryable")))
            done.update(piece.column("_position").to_pylist())
        specs.append(t.spec)
        if done:
            skip[t.spec.index] = frozenset(done)
    rows = sum(s.num_rows for s in specs) - sum(len(v) for v in skip.values())
    return WorkLeft(specs, skip, rows, m.rows_done, len(m.windows))


def read_job_rows(
    plan: Any, tokenizer: Any, sample_rows: int | None = None, left: WorkLeft | None = None
) -> PlanInput:
    """This shard's rows read, rendered, tokenized and grouped exactly as :func:`batchgen.job.run.run_job`
    does (module docstring); with ``left``, only the rows a resumed run has left to do."""
    from batchgen.data.prompts import build_prompts
    from batchgen.data.reader import iter_windows
    from batchgen.data.values import sanitize_utf8
    from batchgen.job.feeder import ReadAhead, WindowWork
    from batchgen.job.openai_batch import is_batch_requests

    cfg = plan.cfg
    plan.prompt_spec.max_model_len = cfg.engine.max_model_len or plan.model_max_len
    specs = list(plan.windows) if left is None else list(left.specs)
    skip = {} if left is None else left.skip
    pick = _sample_windows(len(specs), [w.num_rows for w in specs], cfg.plan.sample_rows)
    chosen = [specs[i] for i in pick]
    source_col = cfg.data.messages_column or cfg.data.prompt_column
    extra_cols = list(dict.fromkeys([f.name for f in plan.part_layout.kept] + (
        [cfg.data.id_column] if cfg.data.id_column else [])))  # fmt: skip
    d = cfg.data
    rows_total = plan.row_end - plan.row_start if left is None else left.rows
    rows_chosen = sum(w.num_rows for w in chosen)
    inp = PlanInput(
        rows_total=rows_total,
        block_size=cfg.engine.block_size,
        max_model_len=plan.prompt_spec.max_model_len,
        num_blocks=_pool_blocks(cfg, plan.model_path),
        prompt_column=None if d.messages_column else d.prompt_column,
        prefix_caching=cfg.engine.enable_prefix_caching,
        messages_column=d.messages_column,
        batch_file=is_batch_requests(d.input),
        image_column=d.image_column,
        group_by_prefix=d.group_by_prefix,
        replicas=max(1, cfg.engine.data_parallel_size),
        max_num_seqs=cfg.engine.max_num_seqs,
        shard=shard_facts(plan, len(specs)),
        keep_every=max(1, rows_chosen // KEEP_ROWS),
    )
    t0 = time.perf_counter()

    def prepared() -> Any:
        """Each window read, rendered, tokenized and grouped: in a thread one window ahead of the prefix
        simulation (the fast tokenizer releases the GIL)."""
        t = time.perf_counter()
        for win in iter_windows(plan.input, chosen, plan.columns, schema=plan.read_schema):
            rows = build_prompts(win.table, win.spec.row_start, plan.prompt_spec, tokenizer, win.unreadable)
            for r in rows:  # an adapter the engine cannot read: its rows are error rows, as in the job
                problem = _adapter_problem(r.lora, adapter_problems) if r.error is None else None
                if problem is not None:
                    r.fail(problem)
            for name in extra_cols:  # as the job does: text that is not UTF-8 makes the row an error row
                _fixed, bad = sanitize_utf8(win.table.column(name))
                for pos, byte in bad.items():
                    rows[pos].fail(f"column {name!r} is not valid UTF-8 at byte {byte}")
                    rows[pos].token_ids = rows[pos].params = None
            work = WindowWork.create(
                win.spec, rows, cfg.data.group_by_prefix, skip=skip.get(win.spec.index, frozenset())
            )
            inp.window_reads.append((len(rows), time.perf_counter() - t))
            yield win, rows, work
            t = time.perf_counter()

    adapter_problems: dict[Any, str | None] = {}
    ahead = ReadAhead(prepared())
    image_keys: dict[str, int] = {}
    ends = dict(zip((w.index for w in specs), itertools.accumulate(w.num_rows for w in specs)))
    seen_end = 0  # rows up to the end of the last window planned, in the shard's order
    for win, rows, work in ahead:
        unseen, seen_end = ends[win.spec.index] - win.spec.num_rows - seen_end, ends[win.spec.index]
        need_src = len(inp.first) < SHARING_SAMPLE
        src = win.table.column(source_col).to_pylist() if need_src else [None] * len(rows)
        prs = []
        for r in rows:
            ok = r.error is None and r.token_ids is not None
            items = [i for i in (r.images or ()) if hasattr(i, "hash")] if ok else []
            prs.append(PlanRow(
                r.row_index, r.id, r.token_ids, r.params, r.error, r.lora, src[r.position],
                tuple((i.hash, i.start + (i.offsets[0] if i.offsets else 0), i.num_tokens) for i in items),
                image_keyed_ids(r.token_ids, items, image_keys) if items else None,  # type: ignore[arg-type]
            ))  # fmt: skip
        inp.add_window(prs, list(work.feed), skip.get(win.spec.index, frozenset()), unseen)
    inp.read_seconds = time.perf_counter() - t0
    return inp


def _adapter_problem(lora: Any, seen: dict[Any, str | None]) -> str | None:
    """Why the engine could not read ``lora``'s adapter (its files checked once per adapter, as loading
    checks them before the weights); None for the base model, a readable adapter or a remote one."""
    if lora is None:
        return None
    key = (lora.lora_name, str(lora.lora_path))
    if key not in seen:
        from batchgen.models.lora_adapter import LoRAAdapterError, check_adapter_files

        seen[key] = None
        if "://" not in str(lora.lora_path):
            try:
                check_adapter_files(lora.lora_name, lora.lora_path)
            except LoRAAdapterError as e:
                seen[key] = str(e)
    return seen[key]


def _on_cpu(device: str) -> bool:
    try:
        import torch

        return device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    except ImportError:
        return True


def _pool_blocks(cfg: Any, model_path: str | None) -> int | None:
    """The KV pool's blocks as the engine will size it: ``engine.num_blocks``, else on the CPU
    ``engine.kv_cache_memory`` over the model's bytes per block (in ``engine.kv_cache_dtype``); None (no
    eviction simulated) on an accelerator, whose pool is only known once the engine has measured its memory."""
    e = cfg.engine
    if e.num_blocks:
        return e.num_blocks
    on_cpu = _on_cpu(e.device)
    kv = _kv_bytes_per_token(
        None, model_path, kv_element_bytes(e.kv_cache_dtype, cfg.model.dtype, model_path, on_cpu)
    )
    if not on_cpu or not kv:
        return None
    return max(1, parse_bytes(e.kv_cache_memory) // (kv * e.block_size))


def prompt_rows(
    tokenizer: Any,
    prompts: Sequence[Any],
    params: Any,
    max_model_len: int,
    block_size: int,
    lora: Any = None,
    num_blocks: int | None = None,
    prefix_caching: bool = True,
    engine: Any = None,
) -> PlanInput:
    """The Python API's prompts (``LLM.generate``'s forms) as one window fed in input order, as
    ``LLM.generate`` feeds them; a prompt with images is prepared on ``engine``'s image side as ``generate``
    prepares it (placeholders expanded; an image that cannot be used makes it an error row)."""
    from batchgen.llm import _per_prompt
    from batchgen.prompt_inputs import parse_prompts
    from batchgen.sampling_params import SamplingParams

    t0 = time.perf_counter()
    parsed = parse_prompts(prompts)
    if params is None or isinstance(params, SamplingParams):
        plist = [params or SamplingParams()] * len(parsed)
    else:
        plist = list(params)
        if len(plist) != len(parsed):
            raise ValueError(f"got {len(plist)} sampling params for {len(parsed)} prompts")
    loras = _per_prompt(lora, len(parsed))
    tokens = [p.token_ids or list(tokenizer.encode(p.text)) for p in parsed]
    prepared: dict[int, Any] = {}
    with_images = [i for i, p in enumerate(parsed) if p.images]
    if with_images:
        from batchgen.multimodal import prepare

        side = prepare.image_prompts_for(engine) if engine is not None else "no engine to prepare images on"
        ready = prepare.prepare_many(side, [(tokens[i], parsed[i].images) for i in with_images])
        prepared = dict(zip(with_images, ready))
    rows = []
    image_keys: dict[str, int] = {}
    for i, (p, sp, lr) in enumerate(zip(parsed, plist, loras)):
        ids, items, err = tokens[i], [], None
        if isinstance(prepared.get(i), str):
            err = prepared[i]
        elif i in prepared:
            ids, items = prepared[i].token_ids, list(prepared[i].images)
        if err is not None:
            pass
        elif not ids:
            err = "empty prompt"
        elif len(ids) >= max_model_len:
            err = f"prompt of {len(ids)} tokens does not fit max_model_len={max_model_len}"
        spans = tuple((x.hash, x.start + (x.offsets[0] if x.offsets else 0), x.num_tokens) for x in items)
        keyed = image_keyed_ids(ids, items, image_keys) if items and err is None else None
        rows.append(PlanRow(i, i, None if err else ids, sp, err, lr, p.text, spans, keyed))
    inp = PlanInput(
        rows_total=len(rows), block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks,
        prefix_caching=prefix_caching, max_num_seqs=getattr(getattr(engine, "config", None), "max_num_seqs", None),
        prompt_column="prompt", group_by_prefix=False, keep_every=max(1, len(rows) // KEEP_ROWS),
        shard={"index": 0, "count": 1, "row_start": 0, "row_end": len(rows), "windows": 1},
    )  # fmt: skip
    inp.add_window(rows, [r.index for r in rows if r.error is None])
    inp.read_seconds = time.perf_counter() - t0
    return inp


# ------------------------------------------------------------------------------------------ analysis
def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0, "mean": 0.0}
    a = np.asarray(values)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": int(a.max()),
        "mean": float(a.mean()),
    }


def _root(r: PlanRow) -> Any:
    """The row's prefix-cache root: its adapter (None: the base model)."""
    return None if r.lora is None else getattr(r.lora, "lora_int_id", r.lora)


def _where_rows_differ(rows: list[PlanRow], tokenizer: Any, inp: PlanInput, lcp: int) -> str | None:
    """The first token position at which the sampled rows differ, in the words of the input."""
    r0 = rows[0]
    if tokenizer is None or r0.token_ids is None:
        return None
    head = tokenizer.decode(r0.token_ids[:lcp])
    nxt = tokenizer.decode(r0.token_ids[: min(len(r0.token_ids), lcp + 8)])[len(head) :]
    where = f"token {lcp}"
    for r in rows:
        for k, (_h, start, n) in enumerate(r.images):
            if start <= lcp < start + n:
                origin = (f"data.image_column {inp.image_column!r}" if inp.image_column
                          else f"the chat messages of {inp.messages_label}"
                          if inp.messages_column else "the prompt's multi_modal_data")  # fmt: skip
                return (f"rows differ from {where}: image {k} (from {origin}) starts at token {start}, before "
                        f"text the rows share; different images share nothing after them: put the image "
                        f"after the shared text (the shared text first)")  # fmt: skip
    src = r0.source
    if inp.messages_column and isinstance(src, (list, str)):
        msgs = src
        if isinstance(msgs, str):
            import json

            try:
                msgs = json.loads(msgs)
            except ValueError:
                msgs = []
        rendered = tokenizer.decode(r0.token_ids)
        c = len(head)
        for k, m in enumerate(msgs or []):
            content = (m or {}).get("content") if isinstance(m, dict) else None
            if not isinstance(content, str) or not content:
                continue
            at = rendered.find(content)
            if at >= 0 and at <= c < at + len(content):
                return (f"rows differ from {where}: message {k} ({m.get('role')}) of {inp.messages_label}, "
                        f"at character {c - at} of its content ({nxt!r}...)")  # fmt: skip
            if at > c:
                return (f"rows differ from {where}, in the chat template's text before message {k} "
                        f"({nxt!r}...): a per-row value (a date, an id) in the system prompt or template")  # fmt: skip
        return f"rows differ from {where} of the rendered chat prompt ({nxt!r}...)"
    col = inp.prompt_column or "prompt"
    texts = [r.source for r in rows if isinstance(r.source, str)]
    at = min((common_prefix_len(texts[0], t) for t in texts[1:]), default=len(head))
    if texts:
        nxt = texts[0][at : at + 20]
    return f"rows differ from {where}: character {at} of column {col!r} ({nxt!r}...)"


def _messages(src: Any) -> list[Any]:
    """A chat row's messages (a list, or its JSON text), or [] when they cannot be read."""
    if isinstance(src, str):
        import json

        try:
            src = json.loads(src)
        except ValueError:
            return []
    return list(src) if isinstance(src, (list, tuple)) else []


def _run_location(run: str, row: PlanRow, inp: PlanInput) -> str:
    """Where a shared run of text sits, in the words of the input: the column, or the chat message holding
    its start (else the rendered chat prompt: the run starts in the template's text)."""
    if not inp.messages_column:
        return f"column {inp.prompt_column or 'prompt'!r}"
    head = run.strip()[:40]
    for k, m in enumerate(_messages(row.source)):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and head and head in content:
            return f"the rendered chat prompt, in message {k} ({m.get('role')}) of {inp.messages_label}"
    return f"the rendered chat prompt of {inp.messages_label}, in the template's text"


def sharing_analysis(inp: PlanInput, tokenizer: Any, hit_rate: float, rows: list[PlanRow]) -> dict[str, Any]:
    """Where sharing is lost and what would share more (module docstring)."""
    bs = inp.block_size
    notes: list[str] = []
    out: dict[str, Any] = {"notes": notes}
    sample = [r for r in rows if r.token_ids][:SHARING_SAMPLE]
    if len(sample) < 2:
        return out
    lcp = min(common_prefix_len(sample[0].keyed, r.keyed) for r in sample[1:])  # type: ignore[arg-type]
    mean_len = float(np.mean([len(r.token_ids) for r in sample]))  # type: ignore[arg-type]
    out["common_prefix_tokens"] = lcp
    out["common_prefix_blocks"] = lcp // bs
    where = _where_rows_differ(sample, tokenizer, inp, lcp)
    if where:
        out["first_difference"] = where
        blocks = f"{lcp // bs} whole block{'s' if lcp // bs != 1 else ''} of {bs}"
        notes.append(f"{where}; the {lcp} tokens before it are shared ({blocks})")
    # a long run of text most rows hold, after a per-row part: moving it first would share it. Chat rows are
    # looked at as rendered (the template's text between the messages included)
    chat = bool(inp.messages_column)
    if chat and tokenizer is not None:
        texts = [tokenizer.decode(r.token_ids) for r in sample[:64] if not r.images]  # type: ignore[arg-type]
    else:
        texts = [r.source for r in sample if isinstance(r.source, str)]
    if texts and tokenizer is not None:
        found = shared_run_after_start(texts[:64])
        if found is not None:
            run, held, first_char = found
            run_tokens = len(tokenizer.encode(run, add_special_tokens=False))
            if held >= 0.5 and run_tokens >= 2 * bs and first_char > 0:
                moved = [tokenizer.encode(run + t.replace(run, "", 1), add_special_tokens=not chat)
                         for t in texts if run in t]  # fmt: skip
                better = simulate_prefix_cache(sorted(moved), bs).hit_rate
                where = _run_location(run, sample[0], inp)
                out["shared_run"] = {"text": run[:200], "tokens": run_tokens, "rows_fraction": held,
                                     "first_char": first_char, "where": where,
                                     "hit_rate_if_first": better}  # fmt: skip
                if better > hit_rate + 0.01:  # advice only where it shares more (rows of one image share the
                    # text after it already: moving the text before the image may share less)
                    notes.append(f"{run_tokens} tokens ({run[:40]!r}...) are held by {held:.0%} of the rows "
                                 f"but start at character {first_char} of {where}, after per-row text: put that "
                                 f"text after them (the shared part first) and the hit rate becomes about "
                                 f"{better:.0%}")  # fmt: skip
    # orders that would share more
    if not inp.group_by_prefix and inp.lens:
        rate = inp.grouped_cached / sum(inp.lens)
        out["hit_rate_grouped"] = rate
        if rate > hit_rate + 0.01:
            notes.append(f"data.group_by_prefix=true (order each window by tokens) would share {rate:.0%}")
    if len(inp.window_sizes) > 1 and inp.lens:
        pairs = (
            inp.all_tokens if inp.all_tokens is not None else [(_root(r), r.keyed) for r in inp.kept.values()]
        )
        flat = sorted(pairs, key=lambda x: x[1])  # type: ignore[arg-type,return-value]
        rate = simulate_prefix_cache([t for _, t in flat], bs, [r for r, _ in flat]).hit_rate  # type: ignore[misc]
        out["hit_rate_input_sorted"] = rate
        if inp.all_tokens is None:
            out["hit_rate_input_sorted_sample_rows"] = len(pairs)
        if rate > hit_rate + 0.05:
            notes.append(f"rows sharing a prefix sit in different windows: sorting the input by prompt (or a "
                         f"larger data.window_rows) would share {rate:.0%}")  # fmt: skip
    if not notes or (lcp < bs and mean_len > 2 * bs and hit_rate < 0.05):
        notes.append(f"rows share {lcp} leading tokens: less than a block of {bs}, so nothing is shared")
    return out


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
"""Bytes per element of each ``engine.kv_cache_dtype`` / ``model.dtype`` name."""


def _model_config(model_path: str | None) -> dict[str, Any]:
    import json

    if not model_path:
        return {}
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def checkpoint_dtype(model_path: str | None) -> str:
    """The dtype the checkpoint's floating-point weights are stored in (its config's ``torch_dtype``)."""
    c = _model_config(model_path)
    d = c.get("torch_dtype") or c.get("dtype") or (c.get("text_config") or {}).get("torch_dtype")
    return d if d in DTYPE_BYTES else "float32"


def kv_element_bytes(kv_cache_dtype: str, model_dtype: str, model_path: str | None, on_cpu: bool) -> int:
    """Bytes of one K or V element: ``engine.kv_cache_dtype``'s, or for ``auto`` the model's activations'
    (on the CPU a bfloat16/float16 model computes in float32)."""
    if kv_cache_dtype != "auto":
        return DTYPE_BYTES.get(kv_cache_dtype, 4)
    weights = model_dtype if model_dtype != "auto" else checkpoint_dtype(model_path)
    if on_cpu and weights in ("bfloat16", "float16"):
        return 4
    return DTYPE_BYTES.get(weights, 4)


def _kv_bytes_per_token(engine: Any, model_path: str | None, dtype_bytes: int = 4) -> int | None:
    """K and V bytes one token takes in the pool: the started engine's, else from the checkpoint's facts (the
    KV shape the loader will build, a GGUF file's included) with ``dtype_bytes`` per element."""
    st = getattr(engine, "stats", None) if engine is not None else None
    if st is not None and st.block_size and st.bytes_per_block:
        return st.bytes_per_block // st.block_size
    if not model_path:
        return None
    from batchgen.models.checkpoint_facts import checkpoint_facts

    try:
        f = checkpoint_facts(model_path)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    return 2 * f.num_layers * f.num_kv_heads * f.head_dim * dtype_bytes


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{math.ceil(n / div * 10) / 10:g}{unit}"
    return f"{int(n)}"


def _weights_bytes(model_path: str | None, model_dtype: str = "auto", engine: Any = None) -> int:
    """Bytes the weights take loaded: a started single-rank engine's parameters as they are held; else the
    checkpoint's safetensors as stored (a quantized checkpoint's packed weights included), scaled to
    ``model.dtype`` when it differs from the checkpoint's float dtype (a quantized checkpoint is held as
    stored), or a GGUF file's tensors as the loader holds them (:func:`_gguf_weights_bytes`)."""
    model = getattr(engine, "model", None) if engine is not None else None
    if model is not None and getattr(engine.config, "tensor_parallel_size", 1) == 1:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    if not model_path:
        return 0
    p = Path(model_path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _gguf_weights_bytes(p)
    stored = sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else 0
    c = _model_config(model_path)
    if (
        model_dtype == "auto"
        or c.get("quantization_config")
        or (c.get("text_config") or {}).get("quantization_config")
    ):
        return stored
    return stored * DTYPE_BYTES.get(model_dtype, 4) // DTYPE_BYTES[checkpoint_dtype(model_path)]


def _gguf_weights_bytes(path: Path) -> int:
    """A GGUF file's tensors as the loader holds them: projections (and a quantized head, experts) in a block
    format the GEMM multiplies as stored, everything else (float tensors, the token embedding, norms) widened to
    float32; without an ``output.weight`` the head holds the embedding again (its packed blocks when quantized,
    else float32). 0 when unreadable."""
    try:
        import gguf

        from batchgen.kernels.cpu_quant_linear import FORMATS

        tensors = gguf.GGUFReader(str(path)).tensors
    except (ImportError, OSError, ValueError):
        return 0
    names = {t.name for t in tensors}
    total = 0
    for t in tensors:
        if t.name.startswith("rope_freqs"):  # not used by the model (docs/quantization.md)
            continue
        packed = int(t.tensor_type) in FORMATS
        widened = not packed or t.name.startswith("token_embd") or "norm" in t.name
        total += int(t.n_elements) * 4 if widened else int(t.n_bytes)
        if t.name == "token_embd.weight" and "output.weight" not in names:  # the head is a copy of it
            total += int(t.n_bytes) if packed else int(t.n_elements) * 4
    return total


def _device_memory(engine: Any) -> tuple[str, int | None, int]:
    """(device name, memory bytes of one device or None, devices visible)."""
    try:
        import torch

        dev = str(getattr(engine, "device", "cpu")) if engine is not None else "cpu"
        if dev.startswith("cuda") and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.name, int(props.total_memory), torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no device information: CPU figures
        pass
    return "cpu", None, 1


# ----------------------------------------------------------------------------------------- the plan
def build_plan(
    inp: PlanInput,
    engine_cfg: Any,
    *,
    tokenizer: Any,
    engine: Any = None,
    plan_cfg: Any = None,
    model: str | None = None,
    model_path: str | None = None,
    replicas: int = 1,
    model_dtype: str = "auto",
    runs_on_this_engine: bool = False,
) -> Plan:
    """The plan of the rows ``inp`` (module docstring); ``engine`` (started) runs the calibration; without
    one, memory is sized from the checkpoint's config in ``model_dtype`` and ``engine_cfg.kv_cache_dtype``.
    ``runs_on_this_engine``: the rows will run on ``engine`` itself (``LLM.plan``), whose one-time costs the
    calibration paid (not predicted again); else on a fresh engine of the same configuration (the job)."""
    from batchgen.job.config import PlanOptions

    pc = plan_cfg or PlanOptions()
    bs = inp.block_size
    scale = inp.rows_total / inp.rows_read if inp.rows_read else 1.0
    lens, bounds, ns = inp.lens, inp.bounds, inp.ns
    saved = inp.saved  # prompt tokens not computed, per fed row
    hit_rate = inp.hit_rate
    errors = dict(sorted(inp.errors.items(), key=lambda kv: -kv[1]["rows"]))
    n_err = sum(e["rows"] for e in errors.values())
    n_fed = len(lens)
    pct = _percentiles(lens)
    data: dict[str, Any] = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "shard": inp.shard,
        "rows": {
            "total": inp.rows_total,
            "sampled": inp.rows_read,
            "valid": round(n_fed * scale),
            "error": round(n_err * scale),
        },
        "errors": errors,
        "prompt_tokens": {"total": round(sum(lens) * scale), **pct},
        "sharing": sharing_analysis(inp, tokenizer, hit_rate, inp.first),
        "read_seconds": round(inp.read_seconds, 3),
    }
    bound_total = sum(b * n for b, n in zip(bounds, ns))
    # ----- calibration and time
    strata = _strata(lens, inp.heads)
    cal: Calibration | None = None
    if engine is not None and pc.calibrate and n_fed:
        cache = None
        if pc.reuse_step_model:
            dev = _device_memory(engine)[0]
            # the threads and the sampling too: steps timed at another count (the thread policy follows the
            # machine's other load) or through another sampler path run at another speed
            cache = StepCache.for_setup(
                model,
                model_path,
                _config_text(model_path),
                model_dtype,
                repr(engine_cfg),
                dev,
                compute_threads(),
                sampling_signature([r.params for r in inp.kept.values()]),
            )
        cal = _calibrate(engine, strata, saved, inp, engine_cfg, pc, scale, replicas, cache)
        cal.first_calls_paid = runs_on_this_engine
    expected = _expected_outputs(bounds, cal)
    out_expected = sum(e * n for e, n in zip(expected, ns))
    data["output_tokens"] = {
        "bound": round(bound_total * scale),
        "expected": round(out_expected * scale),
        "source": "calibration" if cal is not None and cal.observations else "the bound (no calibration)",
    }
    predicted: dict[str, Any] = {
        "prefix_hit_rate": hit_rate,
        "prompt_tokens": round(sum(lens) * scale),
        "prompt_tokens_to_compute": round(sum(lens) * scale - inp.weighted(saved)),
        "prompt_tokens_copied": round(inp.weighted(inp.copied)),
        "output_tokens": round(out_expected * scale),
    }
    data["predicted"] = predicted
    # ----- memory and recommendations
    on_cpu = (
        str(getattr(engine, "device", "cpu")).startswith("cpu")
        if engine is not None
        else _on_cpu(engine_cfg.device)
    )
    kv_el = kv_element_bytes(engine_cfg.kv_cache_dtype, model_dtype, model_path, on_cpu)
    kv_tok = _kv_bytes_per_token(engine, model_path, kv_el)
    st = getattr(engine, "stats", None) if engine is not None else None
    pool_tokens = st.num_blocks * st.block_size if st is not None and st.num_blocks else None
    if pool_tokens is None and engine_cfg.num_blocks:
        pool_tokens = engine_cfg.num_blocks * bs
    if pool_tokens is None and kv_tok:
        pool_tokens = parse_bytes(engine_cfg.kv_cache_memory) // kv_tok
    mean_seq = (sum(lens) - sum(saved) + out_expected) / max(1, n_fed) if n_fed else 1.0
    fit = int(pool_tokens // max(mean_seq, 1)) if pool_tokens and n_fed else None  # nothing runs: no advice
    dev_name, dev_mem, n_dev = _device_memory(engine)
    data["memory"] = {"kv_cache_dtype": engine_cfg.kv_cache_dtype, "kv_bytes_per_token": kv_tok, "kv_pool_tokens": pool_tokens, "sequences_that_fit": fit,
                      "weights_bytes": _weights_bytes(model_path, model_dtype, engine), "device": dev_name, "device_memory": dev_mem}  # fmt: skip
    data["recommended"] = _recommend(data, fit, kv_tok, pct, bounds, engine_cfg, inp, dev_mem, n_dev)
    if cal is not None:
        _predict_time(data, predicted, cal, lens, saved, expected, ns, inp, engine_cfg, scale,
                      replicas, pool_tokens, pc, dev_name)  # fmt: skip
    elif not n_fed:  # no row reaches the engine: no work to time
        predicted.update(wall_time_s=0.0, wall_time_range_s=[0.0, 0.0], device_hours=0.0,
                         cost=0.0 if pc.cost_per_hour is not None else None)  # fmt: skip
    else:
        predicted["wall_time_s"] = None
        predicted["wall_time_range_s"] = None
    return Plan(data)


def outcome_warnings(rows: dict[str, Any], max_error_fraction: float) -> list[str]:
    """What the plan's error rows mean for the job's exit status (``run.max_error_fraction``)."""
    total, errors = rows["total"], rows["error"]
    if not total or not errors:
        return []
    if not rows["valid"] and max_error_fraction < 1.0:
        return ["every row would be an error row: the job would stop before writing anything (exit status 2); "
                "fix the input or the configuration, or set run.max_error_fraction=1 to write them as error "
                "rows"]  # fmt: skip
    if errors / total > max_error_fraction:
        return [f"{errors / total:.1%} of the rows would be error rows, more than run.max_error_fraction="
                f"{max_error_fraction:g}: the job would end with exit status 3"]  # fmt: skip
    return []


def _strata(lens: list[int], heads: list[int]) -> list[tuple[int, int]]:
    """Each fed row's stratum: (prompt-length quartile, prefix group among the 3 largest, else 3)."""
    if not lens:
        return []
    qs = np.percentile(np.asarray(lens), [25, 50, 75]).tolist()
    counts: dict[int, int] = {}
    for h in heads:
        counts[h] = counts.get(h, 0) + 1
    top = {h: i for i, (h, _) in enumerate(sorted(counts.items(), key=lambda kv: -kv[1])[:3])}
    return [(bisect.bisect_left(qs, n), top.get(h, 3)) for n, h in zip(lens, heads)]


def _sim_requests(lens, saved, outputs, ns) -> list[SimRequest]:  # noqa: ANN001
    return [SimRequest(n - c, n, max(1, int(round(o))), k) for n, c, o, k in zip(lens, saved, outputs, ns)]


def _config_text(model_path: str | None) -> str | None:
    """The checkpoint's config.json (what the step time depends on: the shapes), when it is a local folder."""
    try:
        return (Path(model_path) / "config.json").read_text() if model_path else None
    except OSError:
        return None


def _calibrate(engine, strata, saved, inp: PlanInput, ecfg, pc, scale, replicas, cache) -> Calibration:  # noqa: ANN001
    rows = [CalibrationRow(i, r.token_ids, r.params, strata[i], r.lora, inp.lens[i] - saved[i])  # type: ignore[arg-type]
            for i, r in inp.kept.items()]  # fmt: skip
    order = strata_order(rows)
    bs = engine.stats.block_size or ecfg.block_size
    pool = engine.stats.num_blocks * bs or None

    def budget(cal: Calibration) -> float:
        # the job's time predicted from what is measured so far, output lengths at their estimate (which does
        # not err long: :class:`OutputLengths`); before any length is seen, at their bound
        expected = _expected_outputs(inp.bounds, cal)
        reqs = _sim_requests(inp.lens, saved, expected, inp.ns)
        t = simulate_schedule(
            reqs, cal.model, ecfg.max_num_seqs, ecfg.max_num_batched_tokens, pool, bs
        ).seconds
        return pc.calibration_fraction * t * cal.overhead * scale / max(1, replicas)

    # batches at the job's concurrency (its samples count against engine.max_num_seqs): the decode steps
    # are timed at the batch sizes the job runs
    mean_n = sum(inp.ns) / max(1, len(inp.ns))
    batch = max(1, min(len(order), int(ecfg.max_num_seqs / max(1.0, mean_n))))
    max_rows = min(pc.calibration_rows, len(order))
    reused = cache.load(load_average()) if cache is not None else []
    cal = run_calibration(engine, order, max_rows, budget, batch, reused)
    if cache is not None:
        cache.store(cal, cal.timed_steps)
    return cal


def _expected_outputs(
    bounds, cal: Calibration | None, lower: bool = False, upper: bool = False
) -> list[float]:  # noqa: ANN001
    """Each row's output tokens per sample: its bound without a calibration; else ``min(L, bound)`` at evenly
    spread quantiles of the calibrated length distribution (:class:`OutputLengths`), so the simulation sees
    the spread of lengths (the long tail that keeps a batch running) and their total is the expectation.
    ``lower``: the least the samples seen so far allow (every sample still running ends at once; one token
    each before any was seen): the low end of the range. ``upper``: the most they allow (every sample still
    running goes on to its bound): the high end."""
    if cal is None or not cal.lengths.observations:
        return [1.0 if b > 0 else 0.0 for b in bounds] if lower else [float(b) for b in bounds]
    lengths = cal.lengths.at_least() if lower else cal.lengths.at_most() if upper else cal.lengths
    return [float(x) for x in lengths.quantiles(bounds)]


def _simulate_parts(reqs, cal, inp, ecfg, scale, replicas, pool) -> tuple[list[float], list[Any], list[int]]:  # noqa: ANN001
    """Each replica's predicted seconds, simulation and rows: replicas take whole windows in turn, each replica's
    part simulated on its own."""
    parts: list[list[SimRequest]] = [[] for _ in range(max(1, replicas))]
    i = 0
    for wi, n in enumerate(inp.window_sizes):
        parts[wi % len(parts)].extend(reqs[i : i + n])
        i += n
    times, sims = [], []
    for part in parts:
        sim = simulate_schedule(
            part, cal.model, ecfg.max_num_seqs, ecfg.max_num_batched_tokens, pool, inp.block_size
        )
        first = 0.0 if cal.first_calls_paid else cal.first_calls_s  # each replica's fresh engine pays it
        times.append(sim.seconds * cal.overhead * scale + first)
        sims.append(sim)
    return times, sims, [len(p) for p in parts]


def _predict_time(
    data, predicted, cal, lens, cached, expected, ns, inp, ecfg, scale, replicas, pool, pc, dev_name
) -> None:  # noqa: ANN001
    times, sims, rows = _simulate_parts(
        _sim_requests(lens, cached, expected, ns), cal, inp, ecfg, scale, replicas, pool
    )
    wall = max(times) if times else 0.0

    # the least the calibration's samples allow (outputs still running when it stopped end at once): where
    # it stopped short of the lengths, the range reaches down to it
    # and the most (outputs still running when it stopped run to their bounds): where a short calibration
    # saw few ends, the range reaches up to it
    def simulated(outputs: list[float]) -> float:
        return max(_simulate_parts(_sim_requests(lens, cached, outputs, ns), cal, inp, ecfg, scale, replicas,
                                   pool)[0], default=0.0)  # fmt: skip

    wall_min = simulated(_expected_outputs(inp.bounds, cal, lower=True))
    wall_max = simulated(_expected_outputs(inp.bounds, cal, upper=True))
    # reading and tokenizing the windows after the first runs beside the engine: on a CPU it competes for
    # the same cores, on an accelerator it is hidden
    if dev_name == "cpu":
        reading = inp.reading_beside_s
        wall, wall_min, wall_max = wall + reading, wall_min + reading, wall_max + reading
    typical = int(np.median(np.asarray(inp.bounds))) if len(inp.bounds) else 0
    e = relative_spread(cal, typical)
    e_time = relative_spread(cal, typical, lengths=False)  # the extremes' lengths carry their own error
    predicted["wall_time_s"] = wall
    # the simulated schedule (of the tokenized rows, scaled): the load-free part of the prediction, which the
    # report sets beside the engine's steps and preemptions; with replicas, all of them together (the report's
    # scheduler figures sum the replicas' engines)
    predicted["schedule"] = {
        "steps": round(sum(x.steps for x in sims) * scale),
        "preemptions": round(sum(x.preemptions for x in sims) * scale),
        "peak_running_seqs": sum(x.peak_running for x in sims),
        "peak_kv_blocks": sum(x.peak_blocks for x in sims) or None,
    }
    predicted["wall_time_range_s"] = [
        min(wall, wall_min) * (1 - e),
        max(wall * (1 + e), wall_max * (1 + e_time)),
    ]
    # what the engine computes: after prefix sharing, and again for a request preempted (recompute)
    predicted["prompt_tokens_to_compute"] = round(sum(x.prompt_tokens for x in sims) * scale)
    devices = max(1, replicas) * max(1, ecfg.tensor_parallel_size)
    predicted["device_hours"] = wall * devices / 3600.0
    predicted["cost"] = predicted["device_hours"] * pc.cost_per_hour if pc.cost_per_hour is not None else None
    if replicas > 1:
        data["shards"] = [{"index": k, "rows": round(p * scale), "wall_time_s": t}
                          for k, (p, t) in enumerate(zip(rows, times))]  # fmt: skip
    data["calibration"] = {
        "rows": cal.rows,
        "seconds": round(cal.seconds, 3),
        "warmup_seconds": round(cal.warmup_seconds, 3),
        "fraction_of_predicted": cal.seconds / wall if wall > 0 else None,
        "budget_fraction": pc.calibration_fraction,
        "budget_s": round(cal.budget, 3),
        "steps": cal.steps,
        "batch_steps": cal.batch_steps,
        "reused_steps": cal.reused_steps,
        "device": dev_name,
        "overhead": cal.overhead,
        "first_calls_s": round(cal.first_calls_s, 3),
        "probe_seqs": cal.probe_seqs,
        "probe_seconds": round(cal.probe_seconds, 3),
        "step_model": cal.model.to_dict(),
        "output_samples": cal.lengths.observations,
        "output_samples_ended": cal.lengths.events,
        "concurrency": cal.concurrency,
        "target_concurrency": cal.target_concurrency,
        "load": cal.load,
        "cpus": os.cpu_count(),
        "threads": compute_threads(),
        "relative_spread": e,
        "note": cal.note or None,
        "seconds_per_prefill_token": cal.model.coef[1] * cal.overhead or None,
        "seconds_per_output_token": _per_output_token(cal.model, ecfg.max_num_seqs) * cal.overhead,
    }


def _per_output_token(model: StepModel, concurrency: int) -> float:
    c = model.coef
    return c[2] + c[0] / max(1, concurrency)


def _recommend(data, fit, kv_tok, pct, bounds, ecfg, inp, dev_mem, n_dev) -> dict[str, Any]:  # noqa: ANN001
    rec: dict[str, Any] = {}
    if fit:
        seqs = max(1, min(512, fit))
        if seqs >= 8:
            seqs -= seqs % 8
        rec["engine.max_num_seqs"] = seqs
        rec["data.window_rows"] = int(min(max(inp.rows_total, 1), max(1024, 4 * seqs)))
        if kv_tok:
            p90_bound = float(np.percentile(np.asarray(bounds), 90)) if bounds else 0.0
            need = seqs * (pct["p90"] + p90_bound) * kv_tok * 1.1
            rec["engine.kv_cache_memory"] = _fmt_bytes(max(need, 16 * kv_tok * ecfg.block_size))
    weights = data["memory"]["weights_bytes"]
    tp = 1
    if dev_mem:
        while weights / tp > 0.6 * dev_mem and tp < 8:
            tp *= 2
    rec["engine.tensor_parallel_size"] = tp
    rec["engine.data_parallel_size"] = max(1, n_dev // tp)
    return rec


# ------------------------------------------------------------------------------------------ the job
def dry_run_job(plan: Any, engine: Any, print_summary: bool, t_start: float | None = None) -> Any:
    """``run.dry_run=true``: the plan of the job described by ``plan`` (a :class:`JobPlan`), printed and
    written to ``_plan.json``; returns the JobResult (exit status 0). ``t_start``: when the job began opening
    (``time.monotonic()``), for the start-up the job will pay."""
    from batchgen.job.config import POOLING_TASKS
    from batchgen.job.run import _load_tokenizer, _start_engine

    cfg = plan.cfg
    outdir = _output_dir(plan)
    left = work_left(plan, outdir)
    if cfg.task in POOLING_TASKS:
        from batchgen.job.prefill_plan import plan_pooling_job

        return _write_plan(plan, Plan(plan_pooling_job(plan, t_start, left)), print_summary, outdir, left)
    if cfg.task == "score":
        from batchgen.job.prefill_plan import plan_scoring_job

        return _write_plan(
            plan, Plan(plan_scoring_job(plan, engine, t_start, left)), print_summary, outdir, left
        )
    t_tokenizer = time.monotonic()
    tokenizer = engine.tokenizer if engine is not None else _load_tokenizer(plan)
    t_read = time.monotonic()
    inp = read_job_rows(plan, tokenizer, cfg.plan.sample_rows, left)
    logger.info("dry run: read and tokenized %d of %d rows in %.1f s", inp.rows_read, inp.rows_total,
                inp.read_seconds)  # fmt: skip
    engine_s = None
    replicas = max(1, cfg.engine.data_parallel_size)
    with _replica_threads(cfg):  # the engine computes as each replica will
        if engine is None and cfg.plan.calibrate and inp.lens:
            t0 = time.perf_counter()
            engine = _start_engine(plan)
            engine_s = time.perf_counter() - t0
        p = build_plan(inp, cfg.engine, tokenizer=tokenizer, engine=engine, plan_cfg=cfg.plan,
                       model=cfg.model.path or "tiny (embedded)", model_path=plan.model_path, replicas=replicas,
                       model_dtype=cfg.model.dtype)  # fmt: skip
    # what the job pays before its run.wall_time_s starts (the report's startup_s), as this dry run measured it:
    # opening the job and loading the tokenizer, reading its first window (the windows after it are read beside
    # the engine, in the wall time), and starting the engine (model load, pool allocation)
    startup_s = None
    if engine_s is not None:
        opening = t_tokenizer - t_start if t_start is not None else 0.0
        first_window = inp.first_window_s
        startup_s = opening + (t_read - t_tokenizer) + first_window + engine_s
    p.data["predicted"]["startup_s"] = startup_s
    return _write_plan(plan, p, print_summary, outdir, left)


@contextmanager
def _replica_threads(cfg: Any) -> Iterator[None]:
    """Within: the torch threads (and ``OMP_NUM_THREADS``, which fixes an engine started here to them) each of
    the job's CPU replicas will compute with (:func:`~batchgen.job.replicas.run.replica_threads`), so the
    calibration times steps as a replica runs them; unchanged for a job without replicas or on CUDA. Restored
    after."""
    from batchgen.job.replicas.run import replica_threads

    k = replica_threads(cfg)
    if k is None:
        yield
        return
    import torch

    saved_env, saved = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(k)
    torch.set_num_threads(k)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


def _output_dir(plan: Any) -> Any:
    """The shard's output directory, opened for reading (no holder taken: a job may be running into it)."""
    from batchgen.data.output_dir import open_output_dir

    d = plan.cfg.data
    return open_output_dir(d.output, d.shard.index, d.shard.count, dict(d.storage_options), d.lease_ttl_s)


def _write_plan(
    plan: Any, p: Plan, print_summary: bool, outdir: Any = None, left: WorkLeft | None = None
) -> Any:
    """The plan's job-level figures (start-up, the whole array, warnings, what an earlier run did: ``left``),
    then ``_plan.json`` written into ``outdir`` (None: the shard's output directory) and the plan printed;
    returns the JobResult (exit status 0)."""
    from batchgen.job.plan import RETRY_KEYS, fresh_manifest
    from batchgen.job.plan_report import format_plan, write_plan
    from batchgen.job.result import EXIT_OK, JobResult

    cfg = plan.cfg
    if left is not None:
        p.data["resume"] = left.facts(len(plan.windows))
    p.data["fingerprint"] = plan.fingerprint  # the report compares only a plan of the same configuration
    p.data["warnings"] = outcome_warnings(p.data["rows"], cfg.run.max_error_fraction)
    pred, count = p.data["predicted"], cfg.data.shard.count
    startup_s = pred.get("startup_s")
    if startup_s is not None and pred.get("wall_time_s") is not None:
        pred["total_time_s"] = startup_s + pred["wall_time_s"]
    if count > 1 and pred.get("device_hours") is not None:
        # a Slurm array: every task plans its own shard; the whole array, estimated from this one
        total = plan.input.num_rows
        share = total / max(1, p.data["rows"]["total"])  # the rows planned: the shard's, or what it has left
        pred["all_shards"] = {
            "shards": count,
            "rows": total,
            "device_hours": pred["device_hours"] * share,
            "cost": pred["cost"] * share if pred.get("cost") is not None else None,
            "note": "estimated from this shard; run the dry run in each array task for each shard's own plan",
        }
    d = cfg.data
    outdir = outdir if outdir is not None else _output_dir(plan)
    refused = outdir.resume_problem(fresh_manifest(plan), d.overwrite, RETRY_KEYS, d.retry_errors)
    if refused is not None:  # read only: the job would stop on it before running
        p.data["warnings"].insert(
            0, f"the job would refuse this output (exit status 2): {' '.join(refused.split())}"
        )
    where = write_plan(outdir, p.data)
    msg = f"dry run: plan written to {where} (nothing else was written)"
    if print_summary:
        print(format_plan(p.data))
        print(msg)
    logger.info(msg)
    return JobResult(EXIT_OK, "planned", str(outdir.path), None, None, msg)


def plan_prompts(engine: Any, prompts: Any, params: Any = None, lora_request: Any = None,
                 plan_cfg: Any = None) -> Plan:  # fmt: skip
    """``LLM.plan``: the plan of ``LLM.generate(prompts, params)`` on ``engine`` (calibrated on it)."""
    cfg = engine.config
    inp = prompt_rows(
        engine.tokenizer, prompts, params, engine.max_model_len, cfg.block_size, lora_request,
        engine.stats.num_blocks or cfg.num_blocks, cfg.enable_prefix_caching, engine,
    )  # fmt: skip
    return build_plan(inp, cfg, tokenizer=engine.tokenizer, engine=engine, plan_cfg=plan_cfg,
                      model=getattr(engine, "model_path", None), runs_on_this_engine=True)  # fmt: skip
