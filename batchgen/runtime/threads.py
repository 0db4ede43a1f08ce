"""The engine's CPU thread policy: how many intra-op threads, how idle OpenMP threads wait, whether threads are
bound to CPUs. One decision (:func:`decide`), for the Python API and the command line alike.

Why: on cores shared with other processes, a parallel region waits for its slowest thread, and a thread that
shares its core runs only part of the time; OpenMP threads that spin while they wait (libgomp's default) take
time slices from the working ones besides. A generation loop then runs several times slower (BENCHMARKS.md,
"Thread policy"). So the engine runs as many threads as there are CPUs other processes leave free (at least
one), and on busy cores idle threads sleep (``OMP_WAIT_POLICY=PASSIVE``); on idle cores spinning is faster.

The constraint: libgomp reads ``OMP_WAIT_POLICY`` once, when torch loads it (``import torch``); setting it later
changes nothing. So the decision is taken twice with the same function:

* :func:`prepare` runs when ``batchgen`` is imported (before batchgen imports torch): if torch is not loaded
  yet and the cores are busy, it exports ``OMP_WAIT_POLICY=PASSIVE`` so that OpenMP starts with it;
* :func:`apply` runs where the engine is built (CPU engines): it sets the thread count
  (``torch.set_num_threads``) from the same decision, with the load measured then.

What the user set wins: ``OMP_WAIT_POLICY``, ``OMP_NUM_THREADS`` and ``OMP_PROC_BIND`` in the environment are
kept as they are, and the engine never uses more threads than torch had before it. Threads are not bound by
default: on a shared machine a bound thread cannot move off a core another process has taken.

The load of other processes is measured, not read from the 1-minute load average (which lags both ways: a
load that just started is not in it yet, one that just ended still is): over a short window, the CPU time the
CPUs this process may run on spent busy, less this process's own, and the runnable threads of other processes
(``procs_running`` less this process's running threads), whichever is larger. "Busy": at least the CPUs this
process may run on.

While the engine runs, a :class:`ThreadMonitor` takes the thread decision again every few seconds from the CPU
time other processes took since the last look, and the engine changes its thread count when two looks in a row
agree on a new one (a job of hours outlives the load it started under). The wait policy cannot change once
OpenMP runs.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
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


def decide(
    cpus: int,
    load: float | None,
    env: Mapping[str, str],
    openmp_wait: str | None = None,
    started: bool = False,
    max_threads: int | None = None,
) -> ThreadPolicy:
    """The policy for `cpus` CPUs while other processes keep `load` of them busy (None: unknown, taken as
    idle), with environment `env`.

    Threads: the CPUs left free, ``round(cpus - load)``, at least 1 and at most `max_threads` (torch's own
    count before the engine changed it: its default is the physical cores, or what the user set with
    ``torch.set_num_threads``). Each parallel region waits for its slowest thread, and a thread sharing a
    core with another process runs a fraction of the time: fewer threads on free cores beat more on shared
    ones (BENCHMARKS.md, "Thread policy"). Wait policy: ``PASSIVE`` when `load` >= `cpus` ("busy").
    `started`: OpenMP is already running, with ``OMP_WAIT_POLICY`` = `openmp_wait` (None: unset, spinning);
    then the wait policy is what OpenMP has.
    """
    cap = min(cpus, max_threads) if max_threads else cpus
    busy = load is not None and load >= cpus
    binding = env.get("OMP_PROC_BIND", "none")
    if started:  # what OpenMP has; unset = libgomp's default (spin, then sleep)
        wait = (openmp_wait or "default").upper()
    else:
        wait = (env.get("OMP_WAIT_POLICY") or ("PASSIVE" if busy else "default")).upper()
    wait = "default" if wait == "DEFAULT" else wait
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        n, why = int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS set"
    else:
        n = free_threads(cpus, load or 0.0, cap)
        why = f"{n} of {cap} thread(s): the CPUs other processes leave free"
    state = f"load {load:.2f} on {cpus} CPU(s)" if load is not None else f"{cpus} CPU(s), load unknown"
    state += ": busy" if busy else ""
    return ThreadPolicy(n, wait, binding, busy, f"{state}; {why}; wait policy {wait}; binding {binding}")


def free_threads(cpus: int, load: float, cap: int) -> int:
    """The CPUs other processes leave free while they keep ``load`` of ``cpus`` busy: at least 1, at most
    ``cap``."""
    return max(1, min(cap, round(cpus - load)))


def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable), from /proc/self/task (Linux; 0 elsewhere)."""
    count = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    count += f.read().rpartition(")")[2].split()[0] == "R"
            except (OSError, IndexError):
                continue
    except OSError:
        return 0
    return count


def running_now(samples: int = 1, interval: float = 0.0) -> float | None:
    """Other processes' runnable threads right now: the median of `samples` readings of ``procs_running`` in
    /proc/stat (Linux) less this process's running threads; None where unreadable."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                line = next(ln for ln in f if ln.startswith("procs_running"))
            counts.append(max(0, int(line.split()[1]) - max(1, _own_running_threads())))
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(interval)
    return float(statistics.median(counts))


@dataclass(frozen=True)
class CpuSample:
    """At wall time ``wall`` (monotonic seconds): the busy CPU-seconds since boot of the CPUs this process may
    run on (``busy``), and this process's own CPU-seconds, every thread (``own``)."""

    wall: float
    busy: float
    own: float


def cpu_sample() -> CpuSample | None:
    """The CPU time counters now (/proc/stat's per-CPU lines: user, nice, system, irq, softirq, steal); None
    where unreadable (not Linux)."""
    try:
        allowed = os.sched_getaffinity(0)
        ticks = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, *fields = line.split()
                if name[3:].isdigit() and int(name[3:]) in allowed:
                    v = [int(x) for x in fields[:8]]
                    ticks += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        hz = os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError, IndexError):
        return None
    t = os.times()
    return CpuSample(time.monotonic(), ticks / hz, t.user + t.system)


def others_between(a: CpuSample, b: CpuSample) -> float:
    """CPUs other processes kept busy on average between two samples (CPU-seconds less this process's, per
    wall second), at least 0."""
    wall = b.wall - a.wall
    if wall <= 0:
        return 0.0
    return max(0.0, ((b.busy - a.busy) - (b.own - a.own)) / wall)


def other_load(window: float = 0.2, samples: int = 5) -> float | None:
    """How many CPUs other processes keep busy now: over `window` seconds, the larger of the CPU time they
    took (:func:`others_between`) and the median of `samples` readings of their runnable threads
    (:func:`running_now`: it sees processes that wait for a CPU, which CPU time cannot); None where neither
    can be read."""
    a = cpu_sample()
    running = running_now(samples, window / max(1, samples - 1))
    b = cpu_sample()
    values = [v for v in (others_between(a, b) if a and b else None, running) if v is not None]
    return max(values) if values else None


@dataclass
class ThreadMonitor:
    """Takes the thread decision again while the engine runs: :meth:`poll` (cheap: a clock read) looks every
    ``period`` seconds at the CPU time other processes took since its last look and returns a new policy
    when two looks in a row agree on a thread count other than the current one (None otherwise).

    Invariants: the thread count stays within [1, ``cap``]; the wait policy, binding and a count the user set
    (``OMP_NUM_THREADS``) never change (such a policy gets no monitor)."""

    policy: ThreadPolicy
    cpus: int
    cap: int
    period: float = 2.0
    _last: CpuSample | None = None
    _pending: int | None = None
    _looked: ThreadPolicy | None = None

    def look_now(self) -> None:
        """Take the decision afresh from a look at the load now (:func:`other_load`, 0.2 s), for the next
        :meth:`poll` to return at once (the count is set in the thread that runs the forwards): for a caller
        about to time steps after a pause in which the load may have changed (a dry run tokenizes its whole
        input between building the engine and calibrating it)."""
        load = other_load()
        if load is not None:
            self._looked = self._decide(free_threads(self.cpus, load, self.cap), load, "looked again")
            self._last, self._pending = None, None

    def poll(self) -> ThreadPolicy | None:
        if self._looked is not None:
            policy, self._looked = self._looked, None
            return policy
        now = time.monotonic()
        if self._last is not None and now - self._last.wall < self.period:
            return None
        sample = cpu_sample()
        last, self._last = self._last, sample
        if last is None or sample is None:
            return None
        others = others_between(last, sample)
        n = free_threads(self.cpus, others, self.cap)
        if n == self.policy.num_threads or self._pending != n:
            self._pending = None if n == self.policy.num_threads else n
            return None
        self._pending = None
        return self._decide(n, others, "re-decided while running")

    def _decide(self, n: int, others: float, how: str) -> ThreadPolicy | None:
        """The policy of `n` threads while other processes take `others` CPUs (None: the count in force)."""
        if n == self.policy.num_threads:
            return None
        reason = (
            f"{how}: other processes took {others:.2f} of {self.cpus} CPU(s); "
            f"{n} of {self.cap} thread(s); wait policy {self.policy.wait_policy}; binding {self.policy.binding}"
        )
        self.policy = ThreadPolicy(
            n, self.policy.wait_policy, self.policy.binding, others >= self.cpus, reason
        )
        return self.policy


def openmp_started() -> bool:
    """Whether torch (and with it libgomp, which read OMP_WAIT_POLICY when it loaded) is loaded."""
    return "torch" in sys.modules


def prepare() -> ThreadPolicy | None:
    """Before torch loads: export the decided ``OMP_WAIT_POLICY`` (PASSIVE on busy cores: busy on two looks,
    0.1 s then 0.3 s, since the choice lasts as long as the process and a passing burst, such as another
    program exiting, must not make it). No-op (None) when torch is already loaded. Called when ``batchgen`` is
    imported."""
    global _wait_policy_at_start, _prepared_before_openmp
    if openmp_started():
        return None
    cpus = cpus_available()
    # a wait policy the user set is kept whatever the load: nothing to measure
    load = None if "OMP_WAIT_POLICY" in os.environ else other_load(window=0.1)
    policy = decide(cpus, load, os.environ)
    if policy.busy and "OMP_WAIT_POLICY" not in os.environ:  # a second look before a lasting choice
        policy = decide(cpus, other_load(window=0.3), os.environ)
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
    max_threads = _torch_threads() if started else None
    # Once OpenMP runs its wait policy is fixed; with one thread at most, or the count set by OMP_NUM_THREADS,
    # the count is too: the load would change nothing, so it is not measured (a 0.2 s window per engine).
    fixed = started and (max_threads == 1 or _threads_set_by_user(os.environ))
    return decide(cpus_available(), None if fixed else other_load(), os.environ, wait, started, max_threads)


def _threads_set_by_user(env: Mapping[str, str]) -> bool:
    value = env.get("OMP_NUM_THREADS", "").strip()
    return value.isdigit() and int(value) > 0


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


def monitor(policy: ThreadPolicy, device: object) -> ThreadMonitor | None:
    """The monitor that keeps `policy` up to date while a CPU engine runs; None where the count is not ours to
    change (another device, ``OMP_NUM_THREADS`` set by the user)."""
    if getattr(device, "type", str(device)) != "cpu":
        return None
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return None
    return ThreadMonitor(policy, cpus_available(), min(cpus_available(), _torch_threads()))


def set_threads(policy: ThreadPolicy) -> None:
    """Apply a re-decided policy in the thread that runs the forwards (OpenMP's thread count is per thread)."""
    import torch

    torch.set_num_threads(policy.num_threads)
    logger.info("CPU threads: %d (%s)", policy.num_threads, policy.reason)
