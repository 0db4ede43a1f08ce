"""Progress over a job's rows: a tqdm bar on a terminal, periodic one-line log records otherwise.

The bar's postfix shows generated tokens/s, the prefix-cache hit rate and KV-cache usage. When stderr is not
a terminal (Slurm logs, pipes) carriage-return redraws would flood the log, so ``mode="auto"`` switches to a
``logging`` record every ``interval_s`` seconds (and one at the end).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from batchgen.engine.core.stats import EngineStats

logger = logging.getLogger("batchgen.progress")  # the name progress log lines carry


def _fmt_duration(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def resolve_mode(mode: str, stream: Any = None) -> str:
    """'bar' or 'log' (or 'off') for a configured mode; 'auto' → bar only on a terminal."""
    if mode != "auto":
        return mode
    stream = stream if stream is not None else sys.stderr
    try:
        return "bar" if stream.isatty() else "log"
    except (AttributeError, ValueError):
        return "log"


class Progress:
    """Counts finished rows out of `total` (`initial` already done by an earlier run)."""

    def __init__(
        self, total: int, initial: int = 0, mode: str = "auto", interval_s: float = 30.0, desc: str = "rows"
    ) -> None:
        self.total, self.done = total, initial
        self.initial = initial
        self.mode = resolve_mode(mode)
        self.interval_s = interval_s
        self.t0 = time.monotonic()
        self._last_log = self.t0
        self._gen_tokens = 0
        self._stats: EngineStats | None = None
        self.bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=desc, unit="row", dynamic_ncols=True, smoothing=0.05
            )

    def _postfix(self) -> dict[str, str]:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        out = {"gen tok/s": f"{self._gen_tokens / elapsed:.0f}"}
        st = self._stats
        if st is not None:
            out["prefix hit"] = f"{st.prefix_hit_rate:.0%}"
            out["KV"] = f"{st.kv_usage:.0%}"
        return out

    def update(
        self, rows: int = 0, stats: EngineStats | None = None, generated_tokens: int | None = None
    ) -> None:
        """Add finished `rows`; `stats` is the engine's EngineStats (its generated_tokens drive tok/s)."""
        if stats is not None:
            self._stats = stats
            if generated_tokens is None:
                generated_tokens = stats.generated_tokens
        if generated_tokens is not None:
            self._gen_tokens = generated_tokens
        self.done += rows
        now = time.monotonic()
        if self.bar is not None:
            if rows:
                self.bar.update(rows)
            if now - self._last_log >= 0.5:
                self.bar.set_postfix(self._postfix(), refresh=False)
                self._last_log = now
        elif self.mode == "log" and now - self._last_log >= self.interval_s:
            self._last_log = now
            self.log_line()

    def log_line(self) -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.done - self.initial) / elapsed
        left = self.total - self.done
        eta = left / rate if rate > 0 else float("inf")
        pct = self.done / self.total if self.total else 1.0
        pf = self._postfix()
        line = (
            f"progress: {self.done}/{self.total} rows ({pct:.1%}) | {rate:.1f} rows/s | "
            + " | ".join(f"{k} {v}" for k, v in pf.items())
            + f" | elapsed {_fmt_duration(elapsed)} | ETA {_fmt_duration(eta) if left else '0m00s'}"
        )
        logger.info(line)
        return line

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(self._postfix(), refresh=False)
            self.bar.close()
            self.bar = None
        elif self.mode == "log":
            self.log_line()
