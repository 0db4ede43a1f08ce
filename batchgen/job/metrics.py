"""Prometheus metrics of a running job: an HTTP ``/metrics`` endpoint (``run.metrics_port``) and a
node-exporter textfile (``run.metrics_file``), both from one ``prometheus_client`` registry.

Names follow vLLM's (``vllm:prompt_tokens_total`` ...) under a ``batchgen:`` prefix; the job adds its own
gauges (rows done, error rows, windows committed, ETA). Sources:

- engine counters and gauges: the engine's :class:`~batchgen.engine.core.stats.EngineStats`, read at scrape time
  from the last snapshot :meth:`JobMetrics.step` was given (so a scrape never touches the engine itself);
- ``time_per_output_token_seconds``: one observation per decoding sequence per step, the step's wall time
  (every running sequence gets at most one token per step); over ``engines`` replicas stepping side by side
  the step count is their sum, so a step's wall time is the time since the last update x engines / steps;
- ``time_to_first_token_seconds`` and ``e2e_request_latency_seconds``: per finished request, from the step at
  which its id was first seen in flight to the step of its first token (``len(outputs) - 1`` of its engine's
  decode steps before its last, ``engines`` summed steps each; exact without preemption on one engine, the
  last update at or before it when updates skip steps) and of its finish;
- job gauges: :meth:`JobMetrics.job` (the job's tally and progress).

A port that cannot be served (in use, not allowed) does not stop the job: one warning line names the port and
what to do, and the job runs on without the endpoint (the textfile, if set, is still written); likewise a
textfile that cannot be written is one warning, and the job runs on.

Invariant: counters only grow — each is the engine's running total since :meth:`JobMetrics.step` first saw
the engine (a later run starts from 0 again, as a restarted vLLM server does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.core.stats import EngineStats

logger = logging.getLogger("batchgen.metrics")

PREFIX = "batchgen:"
TEXTFILE_INTERVAL_S = 5.0
"""Seconds between rewrites of ``run.metrics_file`` (it is also written at the end)."""

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass
class JobFigures:
    """The job's own figures at the last update."""

    rows_total: int = 0
    rows_done: int = 0
    error_rows: int = 0
    windows_committed: int = 0
    eta_s: float = float("nan")


class _Collector:
    """Counters and gauges read at scrape time from the last snapshot (module docstring)."""

    def __init__(self, metrics: JobMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterable[Any]:
        with self.m.lock:
            st = self.m.stats
            job = JobFigures(**vars(self.m.figures))
        counters = (
            ("prompt_tokens", "Prefill tokens admitted (prompt tokens of every request).",
             st.prompt_tokens if st else 0),
            ("generation_tokens", "Generation tokens produced.", st.generated_tokens if st else 0),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st.prompt_tokens if st else 0),
            ("prefix_cache_hits", "Prompt tokens served by the prefix cache (whole blocks).",
             st.prompt_tokens_cached if st else 0),
            ("prompt_tokens_computed", "Prompt tokens run through the model (recomputation included).",
             st.prompt_tokens_computed if st else 0),
            ("num_preemptions", "Request groups preempted.", st.num_preemptions if st else 0),
            ("request_success", "Requests finished without an error.",
             (st.num_finished_requests - st.num_error_requests) if st else 0),
            ("engine_steps", "Engine steps run.", st.num_steps if st else 0),
        )  # fmt: skip
        for name, doc, value in counters:
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], float(value))
            yield c
        gauges = (
            ("num_requests_running", "Sequences in the running batch.", st.running_seqs if st else 0),
            ("num_requests_waiting", "Sequences waiting to be admitted.", st.waiting_seqs if st else 0),
            ("num_requests_swapped", "Sequences swapped out to CPU memory.", st.swapped_seqs if st else 0),
            ("kv_cache_usage_perc", "KV-cache usage: blocks in use / pool size (1 = 100 percent).",
             st.kv_usage if st else 0.0),
            ("prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / prompt tokens admitted.",
             st.prefix_hit_rate if st else 0.0),
            ("job_rows_total", "Rows of this shard.", job.rows_total),
            ("job_rows_done", "Rows of this shard finished (ok or error), earlier runs included.", job.rows_done),
            ("job_error_rows", "Error rows finished by this run.", job.error_rows),
            ("job_windows_committed", "Windows committed (part file written) by this run.", job.windows_committed),
            ("job_eta_seconds", "Predicted seconds until the job's rows are done (NaN: not known yet).", job.eta_s),
        )  # fmt: skip
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc)
            g.add_metric([], float(value))
            yield g


class _WithoutCreated:
    """The histograms of ``registry`` without prometheus_client's ``*_created`` timestamps, which the text format
    shows as extra gauge families (vLLM's endpoint has none)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Any]:
        for fam in self.registry.collect():
            fam.samples = [x for x in fam.samples if not x.name.endswith("_created")]
            yield fam


class JobMetrics:
    """The job's metrics registry, served on ``port`` (0 = a free one; None = not served) and/or written to
    ``textfile``. Feed it with :meth:`step` (after each engine step), :meth:`finished` (each finished request)
    and :meth:`job` (the job's figures); :meth:`close` writes the textfile a last time and stops the server."""

    def __init__(self, port: int | None = None, textfile: str | None = None) -> None:
        self.lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.stats: EngineStats | None = None
        self.figures = JobFigures()
        self.registry.register(_Collector(self))
        histograms = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              registry=histograms, buckets=TTFT_BUCKETS)  # fmt: skip
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token (inter-token "
                              "latency).", registry=histograms, buckets=TPOT_BUCKETS)  # fmt: skip
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency in the engine.",
                             registry=histograms, buckets=E2E_BUCKETS)  # fmt: skip
        self.registry.register(_WithoutCreated(histograms))
        self.textfile = textfile
        self._last_write = 0.0
        self._write_failed = False
        self._step_end: dict[int, float] = {}  # engine step number -> when it ended (steps of live requests)
        self._first_seen: dict[Any, int] = {}  # request id -> step number before which it was first seen
        self._last_step_t = time.monotonic()
        self._engines = 1  # engines whose steps the step count sums (replicas), at the last update
        self.server: Any = None
        self.port: int | None = None
        if port is not None:
            try:
                self.server, _thread = start_http_server(port, registry=self.registry)
            except OSError as e:
                logger.warning(
                    "run.metrics_port=%d cannot be served (%s): the job runs without /metrics; pick a free "
                    "port, or run.metrics_port=0 for any free one (logged)", port, e.strerror or e,
                )  # fmt: skip
            else:
                self.port = self.server.server_port
                logger.info("Prometheus metrics on http://0.0.0.0:%d/metrics", self.port)

    # ---------------------------------------------------------------------------------------- feeding
    def step(self, stats: EngineStats, in_flight: Iterable[Any] = (), engines: int = 1) -> None:
        """After an engine step: its stats (copied), the ids of the requests in flight (for latencies: an id
        not seen before was added just before this step ran) and how many engines stepped side by side
        (replicas: ``stats`` sums their steps)."""
        now = time.monotonic()
        snap = stats.snapshot()
        with self.lock:
            prev = self.stats
            self.stats = snap
        k = snap.num_steps
        self._engines = max(1, engines)
        if prev is not None and k > prev.num_steps:
            dt = (now - self._last_step_t) * min(self._engines, k - prev.num_steps) / (k - prev.num_steps)
            for _ in range(max(0, snap.generated_tokens - prev.generated_tokens)):
                self.tpot.observe(dt)
        self._last_step_t = now
        self._step_end[k] = now
        added = k - 1 if k - 1 in self._step_end else k
        for rid in in_flight:
            self._first_seen.setdefault(rid, added)
        self._maybe_write(now)

    def finished(self, out: RequestOutput, step: int) -> None:
        """A request that finished in engine step ``step``: its time to first token and end-to-end latency."""
        start = self._first_seen.pop(out.request_id, None)
        now = time.monotonic()
        if start is not None and start in self._step_end:
            t0 = self._step_end[start]
            self.e2e.observe(max(0.0, now - t0))
            n = max((len(c.token_ids) for c in out.outputs), default=0)
            if n and not out.error:
                first = step - (n - 1) * self._engines  # one token per step of its engine once decoding
                seen = [x for x in self._step_end if start <= x <= first]
                self.ttft.observe(max(0.0, (self._step_end[max(seen)] if seen else t0) - t0))
        oldest = min(self._first_seen.values(), default=step)
        for s in [s for s in self._step_end if s < oldest - 1]:
            del self._step_end[s]

    def job(self, **figures: Any) -> None:
        """Set job figures (fields of :class:`JobFigures`)."""
        with self.lock:
            for k, v in figures.items():
                setattr(self.figures, k, v)
        self._maybe_write(time.monotonic())

    # ---------------------------------------------------------------------------------------- output
    def text(self) -> str:
        """The metrics in Prometheus text format (what /metrics serves)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def _maybe_write(self, now: float) -> None:
        if self.textfile and now - self._last_write >= TEXTFILE_INTERVAL_S:
            self.write_textfile()

    def write_textfile(self) -> None:
        """Rewrite ``textfile`` atomically (node exporter never reads a half-written file)."""
        if not self.textfile:
            return
        self._last_write = time.monotonic()
        try:
            write_to_textfile(self.textfile, self.registry)
        except OSError as e:
            if not self._write_failed:  # once: it is retried at each interval, and works once the path does
                logger.warning("cannot write run.metrics_file=%s (%s): the job runs on without it",
                               self.textfile, e.strerror or e)  # fmt: skip
            self._write_failed = True
        else:
            self._write_failed = False

    def close(self) -> None:
        self.write_textfile()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def open_metrics(port: int | None, textfile: str | None) -> JobMetrics | None:
    """The job's metrics when ``run.metrics_port`` or ``run.metrics_file`` is set, else None."""
    if port is None and not textfile:
        return None
    return JobMetrics(port, textfile)
