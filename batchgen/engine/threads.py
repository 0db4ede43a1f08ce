"""The engine's CPU thread policy: how many intra-op threads, how idle OpenMP threads wait, whether threads are
bound to CPUs. One decision (:func:`decide`), for the Python API and the command line alike.

Why: on cores already busy with other processes, OpenMP threads that spin while they wait for work
(libgomp's default) steal the time slices the working threads need; a generation loop then runs several times
slower (measured in BENCHMARKS.md, "Thread policy"). Sleeping waiters (``OMP_WAIT_POLICY=PASSIVE``) avoid it;
on idle cores spinning is faster.

The constraint: libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it (``import torch``); setting it later
changes nothing. So the decision is taken twice with the same function:

* :func:`prepare` runs when ``batchgen`` is imported (before batchgen imports torch): if torch is not loaded
  yet and the cores are busy, it exports ``OMP_WAIT_POLICY=PASSIVE`` so that OpenMP starts with it;
* :func:`apply` runs where the engine is built (CPU engines): it sets the thread count
  (``torch.set_num_threads``) from the same decision, knowing the wait policy OpenMP actually started with.
  When the cores are busy but OpenMP already spins (torch was imported before batchgen, with no
  ``OMP_WAIT_POLICY``), the one lever left is the thread count: one thread, which never waits on another.

What the user set wins: ``OMP_WAIT_POLICY``, ``OMP_NUM_THREADS`` and ``OMP_PROC_BIND`` in the environment are
kept as they are. Threads are not bound by default: on a shared machine a bound thread cannot move off a core
another process has taken.

"Busy": the 1-minute load average is at least the number of CPUs this process may run on (measured before the
engine starts working, so it counts other processes).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_wait_policy_at_start: str | None = None
"""OMP_WAIT_POLICY as OpenMP saw it when it started, once :func:`prepare` ran before torch loaded."""
_prepared_before_openmp = False


@dataclass(frozen=True)
class ThreadPolicy:
    """One decision. ``num_threads``: torch intra-op threads; ``wait_policy``: ``PASSIVE`` (idle threads
    sleep), ``ACTIVE`` or ``default`` (libgomp's: spin a while, then sleep); ``binding``: ``OMP_PROC_BIND``'s
    value, or ``none``; ``reason``: why, in words (logged)."""

    num_threads: int
    wait_policy: str
    binding: str
    busy: bool
    reason: str


def cpus_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def decide(
    cpus: int,
    load: float | None,
    env: Mapping[str, str],
    openmp_wait: str | None = None,
    started: bool = False,
    max_threads: int | None = None,
) -> ThreadPolicy:
    """The policy for `cpus` CPUs at 1-minute load `load` (None: unknown, taken as idle) with environment `env`.

    `started`: OpenMP is already running, with ``OMP_WAIT_POLICY`` = `openmp_wait` (None: unset, spinning).
    Before it starts the wait policy is chosen; after, it is what OpenMP has, and the thread count adapts.
    `max_threads`: torch's own count before the engine changed it (its default is the physical cores, or what
    the user set with ``torch.set_num_threads``); the policy never uses more.
    """
    cpus = min(cpus, max_threads) if max_threads else cpus
    busy = load is not None and load >= cpus
    binding = env.get("OMP_PROC_BIND", "none")
    if started:  # what OpenMP has; unset = libgomp's default (spin, then sleep)
        wait = (openmp_wait or "default").upper()
    else:
        wait = (env.get("OMP_WAIT_POLICY") or ("PASSIVE" if busy else "default")).upper()
    wait = "default" if wait == "DEFAULT" else wait
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        n, why = int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS set"
    elif busy and wait != "PASSIVE":
        n, why = 1, "cores busy and OpenMP already spins (torch imported before batchgen): one thread"
    else:
        n, why = cpus, f"{cpus} CPU(s) available"
    state = (
        f"load {load:.2f} on {cpus} CPU(s): {'busy' if busy else 'idle'}" if load is not None else "no load"
    )
    return ThreadPolicy(n, wait, binding, busy, f"{state}; {why}; wait policy {wait}; binding {binding}")


def openmp_started() -> bool:
    """Whether torch (and with it libgomp, which read OMP_WAIT_POLICY when it loaded) is loaded."""
    return "torch" in sys.modules


def prepare() -> ThreadPolicy | None:
    """Before torch loads: export the decided ``OMP_WAIT_POLICY`` (PASSIVE on busy cores). No-op (None) when
    torch is already loaded. Called when ``batchgen`` is imported."""
    global _wait_policy_at_start, _prepared_before_openmp
    if openmp_started():
        return None
    policy = decide(cpus_available(), load_average(), os.environ)
    if policy.wait_policy == "PASSIVE" and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _wait_policy_at_start = os.environ.get("OMP_WAIT_POLICY")
    _prepared_before_openmp = True
    return policy


def current() -> ThreadPolicy:
    """The decision now, for this process (what :func:`apply` sets)."""
    if _prepared_before_openmp:
        wait = _wait_policy_at_start
    else:  # torch was loaded before batchgen: assume it saw the environment as it is now
        wait = os.environ.get("OMP_WAIT_POLICY")
    started = openmp_started()
    return decide(
        cpus_available(), load_average(), os.environ, wait, started, _torch_threads() if started else None
    )


_torch_threads_before: int | None = None


def _torch_threads() -> int:
    """torch's thread count before the first :func:`apply` changed it."""
    global _torch_threads_before
    if _torch_threads_before is None:
        import torch

        _torch_threads_before = torch.get_num_threads()
    return _torch_threads_before


def apply(device: object) -> ThreadPolicy:
    """Where the engine is built: on a CPU device set torch's thread count from :func:`current`; returns the
    policy (on other devices nothing is changed)."""
    policy = current()
    if getattr(device, "type", str(device)) == "cpu":
        import torch

        if torch.get_num_threads() != policy.num_threads:
            torch.set_num_threads(policy.num_threads)
        logger.info("CPU threads: %d (%s)", policy.num_threads, policy.reason)
    return policy
