"""Start-up phase markers: with ``BATCHGEN_TRACE_STARTUP=1``, each phase of a run prints one line to stderr,

    batchgen-startup: <phase> <seconds since the process started> <unix time>

at most once per phase per process (``imports``, ``config``, ``plan``, ``model_loaded``, ``first_token``,
``done``; see :mod:`batchgen.bench.startup`, which reads them). Without the variable :func:`mark` is one
dictionary lookup and prints nothing.

The process start is read from ``/proc/self/stat`` (start time in clock ticks since boot, 10 ms resolution)
against ``CLOCK_BOOTTIME``, so the figure includes the interpreter's own start; where that is unavailable
(not Linux) the seconds count from the first import of this module instead. The unix time lets a parent that
noted ``time.time()`` before spawning the process place the phases on its own clock.
"""

from __future__ import annotations

import os
import sys
import time

ENV_VAR = "BATCHGEN_TRACE_STARTUP"
PREFIX = "batchgen-startup:"
PHASES = ("imports", "config", "plan", "model_loaded", "first_token", "done")

enabled: bool = os.environ.get(ENV_VAR, "") not in ("", "0")
_seen: set[str] = set()


def _process_age() -> float:
    """Seconds since this process started (since this module's import where /proc is unavailable)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


_t0_mono = time.monotonic() - (
    _process_age() if enabled else 0.0
)  # the process start, on the monotonic clock


def mark(phase: str) -> None:
    """Print ``phase``'s line the first time it is reached in this process, when tracing is on."""
    if not enabled or phase in _seen:
        return
    _seen.add(phase)
    sys.stderr.write(f"{PREFIX} {phase} {time.monotonic() - _t0_mono:.4f} {time.time():.4f}\n")
    sys.stderr.flush()
