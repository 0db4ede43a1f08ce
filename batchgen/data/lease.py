"""A lease object: one writer per output location on object stores, which have no ``flock``.

``_lease.json`` holds the holder (``pid N on host``), a random token and an expiry (unix time, the holder's
clock). Invariants:
- A conditional write whose answer was lost (the store acted, the client's retry then failed the condition
  against it) is read back: a lease object holding this holder's token is its own write, and the job goes on.
- Acquiring creates the object only if absent (``If-None-Match: *``); an existing lease that has not expired
  refuses the second job (:class:`~batchgen.errors.ConfigError` naming the holder and the expiry); an expired
  one (a killed job) — or one whose holder ran on this host and whose process is gone (pid and start time)
  — is replaced only if it is still the object read (``If-Match`` its ETag), so of two jobs
  taking over the same stale lease exactly one wins.
- While held, a background thread renews it every ``ttl/3`` seconds, conditioned on the ETag of its own last
  write. A renewal that fails (another job took the lease over after it expired) marks the lease lost:
  :meth:`Lease.check` raises from then on, so the job stops before its next commit.
- Releasing deletes the object only if it is still this holder's.
- Each holder has an epoch one above every epoch it could see (the previous lease's, and the output's commit
  log's, :mod:`batchgen.data.commit_log`): commit records carry it, and a record of a lower epoch after a
  holder's ``open`` record is ignored — a stale holder can no longer commit.
- The holder counts its lease lost by its own clock too: when no renewal succeeded for ``ttl_s`` (a partition,
  a paused process) :meth:`Lease.check` raises, so it never deletes or commits after another job could have
  taken over.
Expiry compares the holder's clock with the taker's: hosts writing the same output need clocks within a small
fraction of the TTL (NTP); ``docs/storage.md`` explains why the manifest's conditional writes keep the output
consistent even when they are not.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import uuid
from typing import Any

from batchgen.data.storage import Location, PreconditionFailed
from batchgen.errors import ConfigError

LEASE_NAME = "_lease.json"
logger = logging.getLogger("batchgen.job")


class LeaseLost(RuntimeError):
    """Another job took this job's lease over (it had expired), or this job could not renew it in time: this
    job stops writing and exits 75; the rows it committed are kept."""


class Lease:
    """The lease on `loc` (``_lease.json`` in it), valid `ttl_s` seconds after each renewal."""

    def __init__(self, loc: Location, ttl_s: float) -> None:
        self.loc, self.ttl_s = loc, float(ttl_s)
        self.owner = f"pid {os.getpid()} on {os.uname().nodename}"
        self.process = {"host": os.uname().nodename, "pid": os.getpid(), "start": _start_time(os.getpid())}
        self.token = uuid.uuid4().hex
        self.etag: str | None = None
        self.lost: str | None = None
        self.previous_epoch = 0
        """The epoch of the lease this one replaced (0 when there was none)."""
        self.epoch = 0
        """This holder's epoch: set by the output directory once it has read the commit log."""
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        d = {
            "owner": self.owner,
            "token": self.token,
            "expires_at": time.time() + self.ttl_s,
            "ttl_s": self.ttl_s,
            "process": self.process,
            "epoch": max(self.epoch, self.previous_epoch),
        }
        return (json.dumps(d) + "\n").encode()

    def acquire(self) -> None:
        """Hold the lease (taking over an expired one) and start renewing it; ConfigError when another job holds
        it."""
        t0 = time.monotonic()
        try:
            self.etag = self.loc.put(LEASE_NAME, self._body(), if_absent=True)
        except PreconditionFailed:
            self.etag = self._landed()
            if self.etag is None:
                self._take_over()
        self._valid_until = t0 + self.ttl_s
        self._thread = threading.Thread(target=self._renew_loop, name="batchgen-lease", daemon=True)
        self._thread.start()

    def _take_over(self) -> None:
        info = self.loc.info(LEASE_NAME)
        raw = self.loc.read_bytes(LEASE_NAME) if info is not None else None
        held = _parse(raw)
        if held is not None:
            self.previous_epoch = int(held.get("epoch") or 0)
        now = time.time()
        dead = held is not None and _holder_is_dead(held)
        if info is not None and held is not None and float(held.get("expires_at", 0)) > now and not dead:
            left = float(held["expires_at"]) - now
            raise ConfigError(
                f"another batchgen job ({held.get('owner', 'unknown')}) holds the lease on {self.loc.url!r} for "
                f"{left:.0f} s more ({LEASE_NAME}); wait for it to finish or stop it — the lease of a killed job "
                "expires after data.lease_ttl_s and is then taken over"
            )
        try:
            if info is None:
                self.etag = self.loc.put(LEASE_NAME, self._body(), if_absent=True)
            else:
                self.etag = self.loc.put(LEASE_NAME, self._body(), if_match=info.etag)
        except PreconditionFailed:
            self.etag = self._landed()
            if self.etag is not None:
                return
            raise ConfigError(
                f"another batchgen job took over the lease on {self.loc.url!r} at the same moment; wait for it to "
                "finish or stop it"
            ) from None
        if held is not None:
            ago = now - float(held.get("expires_at", now))
            why = "whose process is gone" if dead else f"which expired {ago:.0f} s ago"
            logger.warning(
                "%s: took over the lease of %s, %s (a job that was killed)",
                self.loc.url, held.get("owner", "an unknown job"), why,
            )  # fmt: skip

    def _landed(self) -> str | None:
        """After a conditional write of the lease failed its condition: the version of the lease object when it
        holds this holder's token (our own write landed and the client's retry met it: the answer was lost),
        else None. Only this holder writes its token, so the object holding it is this holder's write."""
        info = self.loc.info(LEASE_NAME)
        held = _parse(self.loc.read_bytes(LEASE_NAME)) if info is not None else None
        if info is None or held is None or held.get("token") != self.token:
            return None
        return info.etag or ""

    def renew(self) -> None:
        """Extend the lease by ``ttl_s`` from now; marks it lost when another job replaced it."""
        with self._lock:
            if self.lost is not None or self.etag is None:
                return
            t0 = time.monotonic()
            try:
                self.etag = self.loc.put(LEASE_NAME, self._body(), if_match=self.etag)
                self._valid_until = t0 + self.ttl_s
            except PreconditionFailed:
                landed = self._landed()
                if landed is not None:  # our renewal landed, its answer was lost
                    self.etag, self._valid_until = landed, t0 + self.ttl_s
                    return
                held = _parse(self.loc.read_bytes(LEASE_NAME)) or {}
                self.lost = (
                    f"lost the lease on {self.loc.url!r} to another job ({held.get('owner', 'unknown')}) after it "
                    "expired: this job stops; the rows it committed are kept"
                )
                logger.error("%s", self.lost)
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried at the next period
                logger.warning("could not renew the lease on %s: %s", self.loc.url, e)

    def _renew_loop(self) -> None:
        while not self._stop.wait(max(0.05, self.ttl_s / 3)):
            self.renew()

    def check(self) -> None:
        """Raise LeaseLost when the lease was taken over (before a commit)."""
        if self.lost is None and self.etag is not None and time.monotonic() > self._valid_until:
            self.lost = (
                f"could not renew the lease on {self.loc.url!r} for {self.ttl_s:g} s (data.lease_ttl_s): another "
                "job may have taken over; this job stops; the rows it committed are kept"
            )
        if self.lost is not None:
            raise LeaseLost(self.lost)

    @staticmethod
    def is_held(loc: Location) -> bool:
        """Whether a live job holds the lease on `loc` (an unexpired lease object)."""
        held = _parse(loc.read_bytes(LEASE_NAME))
        return (
            held is not None and float(held.get("expires_at", 0)) > time.time() and not _holder_is_dead(held)
        )

    def release(self) -> None:
        """Stop renewing; delete the lease object if it is still this holder's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            if self.lost is None and self.etag is not None:
                try:
                    info = self.loc.info(LEASE_NAME)
                    if (
                        info is not None
                        and (_parse(self.loc.read_bytes(LEASE_NAME)) or {}).get("token") == self.token
                    ):
                        self.loc.delete(LEASE_NAME)
                except Exception as e:  # noqa: BLE001 - it expires by itself
                    logger.warning("could not release the lease on %s: %s", self.loc.url, e)
            self.etag = None


class FileLock:
    """The holder of a local output directory: an exclusive ``flock`` on its lock file, opened without
    following links (a planted link is refused, never truncated through). The same interface as
    :class:`Lease`; a local lock cannot be lost while the process lives."""

    def __init__(self, directory: str | os.PathLike, name: str) -> None:
        self.file = os.path.join(os.fspath(directory), name)
        self.previous_epoch = 0
        self.epoch = 0
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(
                    f"data.output: {self.file!r} is a symbolic link; batchgen never writes its lock through a "
                    "link: remove it"
                ) from None
            raise
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = "?"
            os.close(fd)
            raise ConfigError(
                f"another batchgen process ({holder or 'unknown pid'}) is writing "
                f"{os.path.dirname(self.file)!r}; wait for it to finish or stop it (in a sweep, give each job its "
                "own data.output, e.g. data.output=out/${hydra:job.num})"
            ) from None
        except (ImportError, OSError) as e:  # no flock on this filesystem: carry on unlocked
            logger.warning("cannot lock %s (%s); make sure no other job writes the same output", self.file, e)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        self._fd = fd

    def check(self) -> None:
        """A flock held by this process is never lost."""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    @staticmethod
    def is_held(directory: str | os.PathLike, name: str) -> bool:
        """Whether a live process holds the lock of `directory` (tried without waiting)."""
        path = os.path.join(os.fspath(directory), name)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return False
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        except (ImportError, OSError):
            return False
        finally:
            os.close(fd)


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, from /proc), or None where unknown: with the
    pid it names a process across pid reuse."""
    st = _stat(pid)
    return st[19].decode() if st is not None and len(st) > 19 else None


def _holder_is_dead(held: dict[str, Any]) -> bool:
    """Whether the lease's holder ran on this host and its process no longer exists (a job killed here: its
    lease need not wait for the expiry; a zombie counts as gone). False whenever that cannot be known."""
    proc = held.get("process")
    if (
        not isinstance(proc, dict)
        or proc.get("host") != os.uname().nodename
        or not isinstance(proc.get("pid"), int)
    ):
        return False
    pid = proc["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    st = _stat(pid)
    if st is not None and st[0] in (b"Z", b"X"):  # killed, not yet reaped by its parent
        return True
    start = _start_time(pid)
    return proc.get("start") is not None and start is not None and start != proc["start"]


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None
