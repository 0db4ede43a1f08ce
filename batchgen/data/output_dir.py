"""The output directory of one shard: policy (resume checks, layout ownership, the commit protocol) over a
storage location (a local directory or an object-store prefix, :func:`batchgen.data.storage.open_location`).

File names are those of :mod:`batchgen.data.layout`; the commit protocol is that of
:mod:`batchgen.data.commit_log`. Invariants:
- One holder per shard location: a ``flock`` locally, a lease object on object stores. Opening takes it,
  writes an ``open`` record of a new epoch (fencing every earlier holder), then checks every committed piece,
  part and checkpoint file (size, store version, else sha256): a missing or changed one is dropped from the
  state and its windows recomputed, never reported complete (a part: with the parts after it).
- A commit writes the window's piece (or checkpoint file) whole, then one commit record naming it with its
  size and sha256. A roll (:mod:`batchgen.data.part_roll`) writes a part whole, then one ``part`` record naming
  it and the windows it holds: only from then on are those windows' pieces garbage. Nothing the state names is
  ever deleted; a failed or ambiguous write deletes nothing: the next holder resolves it by reading the log
  back. Garbage (temp files, pieces, parts and checkpoint files the state does not name, records already
  compacted) is removed only by the current holder, after its ``open`` record.
- ``_manifest.json`` is rewritten (conditionally, resolved by read-back) only on open and close.
- ``data.output`` names its shard layout in ``_layout.json``; a job of another layout is refused unless
  ``data.overwrite`` or the other layout holds no successful row and no live holder.
- A different configuration, input or shard is refused (ConfigError) unless ``overwrite`` (which deletes
  batchgen's own files only, :func:`~batchgen.data.layout.is_own_file`) or that output holds no successful
  row (then taken over, said in the log).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.commit_log import CommitLog, apply, put_resolved, read_state, sha256
from batchgen.data.layout import (
    CHECKPOINT_DIR,
    CHECKPOINT_RE,
    COMMITS_DIR,
    LAYOUT_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    PART_RE,
    PIECE_RE,
    REPORT_NAME,
    SHARD_RE,
    TEMP_PREFIX,
    WINDOWS_DIR,
    checkpoint_name,
    is_own_checkpoint,
    is_own_file,
    part_name,
    shard_dir_name,
)
from batchgen.data.lease import FileLock, Lease, LeaseLost
from batchgen.data.manifest import Manifest, PartRecord, WindowRecord, describe_model_change, diff_config
from batchgen.data.storage import PreconditionFailed, Writer, is_url, open_location, table_to_parquet_bytes
from batchgen.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 120.0
_RESUME_HINT = (
    "Rerun with the original settings to resume, choose another data.output, or pass "
    "data.overwrite=true to discard the existing output."
)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def output_os_error(e: OSError, path: Path, doing: str) -> ConfigError:
    """A one-line ConfigError for an OSError met while setting up the output directory."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        p = Path(path)
        blocker = next((q for q in [p, *p.parents] if q.exists() and not q.is_dir()), None)
        if blocker is not None:
            return ConfigError(
                f"data.output: {str(path)!r} cannot be a directory: {str(blocker)!r} is a file"
            )
    if e.errno == errno.EROFS:
        why = "read-only file system"
    elif e.errno in (errno.EACCES, errno.EPERM):
        why = "permission denied"
    return ConfigError(f"data.output: cannot {doing} {str(path)!r}: {why}; choose a writable data.output")


@contextlib.contextmanager
def _setup_errors(path: Path, doing: str) -> Iterator[None]:
    """OSErrors of the block as one-line ConfigErrors (:func:`output_os_error`); a full disk stays an OSError
    (the job maps it to its own exit status)."""
    try:
        yield
    except OSError as e:
        if e.errno in DISK_FULL_ERRNOS:
            raise
        raise output_os_error(e, path, doing) from e


class OutputDir:
    """One shard's output: ``output`` itself, or its shard sub-directory when ``shard_count > 1``. ``path`` is a
    Path for a local directory, the redacted URL for an object store."""

    def __init__(
        self,
        output: str | os.PathLike,
        shard_index: int = 0,
        shard_count: int = 1,
        storage_options: dict[str, Any] | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        self.shard_index, self.shard_count = int(shard_index), int(shard_count)
        self.root_loc = open_location(output, storage_options, key="data.output")
        self.loc = self.root_loc.child(shard_dir_name(self.shard_index, self.shard_count))
        self.remote = is_url(output)
        self.root: Any = self.root_loc.display
        self.path: Any = self.loc.display
        self.holder: Any = Lease(self.loc, lease_ttl_s) if self.remote else FileLock(self.loc.dir, LOCK_NAME)
        self.log = CommitLog(self.loc)
        self.manifest: Manifest | None = None
        self._manifest_version: str | None = None
        self._held = False
        self._named: set[str] = set()
        """Every part or checkpoint file a committed record named (never deleted)."""
        self.took_over: str | None = None
        """Why :meth:`open` discarded the previous output of another configuration (None when it did not)."""
        self.previous_input: dict[str, Any] = {}
        """The input description of the manifest :meth:`open` resumed ({} when it started anew)."""

    # ------------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def checkpoint_dir(self) -> Any:
        return self.path / CHECKPOINT_DIR if isinstance(self.path, Path) else f"{self.path}/{CHECKPOINT_DIR}"

    def open(
        self,
        fresh: Manifest,
        overwrite: bool = False,
        retry_keys: tuple[str, ...] = (),
        retry_errors: bool = False,
    ) -> Manifest:
        """Take the holder, fence earlier holders, check and clean, and return the state to continue (or
        `fresh`).

        Raises ConfigError when the directory holds output of another configuration, input or shard layout
        (unless `overwrite`, which discards it, or that output holds no successful row: taken over).
        `retry_keys` are the dotted config keys (``engine.max_model_len``) that may change when `retry_errors`
        (rows already generated keep their output, error rows are recomputed).
        """
        with _setup_errors(self.path, "create the output directory"):
            self.loc.prepare()
        with _setup_errors(self.path, "write into"):
            self.holder.acquire()
        self._held = True
        try:
            with _setup_errors(self.path, "write into"):
                self._claim_layout(overwrite)
                m = self._manifest_to_continue(fresh, overwrite, retry_keys, retry_errors)
                self._fence(m)
                self._verify(m)
                self._remove_leftovers(m)
                self._compact(m, prune=False)
        except BaseException:
            self._release()
            raise
        self.manifest = m
        return m

    def close(self) -> None:
        """Compact the log into the manifest (when this job still holds the output) and release it."""
        if self._held and self.manifest is not None:
            try:
                self.holder.check()
                self._catch_up(self.manifest)
                self._remove_leftovers(self.manifest)
                self._compact(self.manifest)
            except Exception as e:  # noqa: BLE001 - the log stays authoritative; the next open compacts
                logger.warning(
                    "could not compact the commit log of %s: %s", self.path, " ".join(str(e).split())
                )
        self._release()

    def _release(self) -> None:
        if self._held:
            self._held = False
            self.holder.release()

    # --------------------------------------------------------------------------------- the state
    def _load(self, loc: Any) -> Manifest | None:
        m, version, log = read_state(loc)
        if loc is self.loc:
            self._manifest_version, self.log = version, log
        return m

    def _existing_manifest(self, overwrite: bool) -> Manifest | None:
        """The state to resume from: None when there is none or `overwrite` discards it (and the files)."""
        try:
            existing = self._load(self.loc)
        except (ValueError, KeyError, TypeError) as e:
            if not overwrite:
                raise ConfigError(
                    f"{self.path}/{MANIFEST_NAME} is unreadable ({e}); use data.overwrite=true to start over"
                ) from e
            existing = None
        if overwrite:
            n = self._clear(self.loc)
            if n:
                logger.info("data.overwrite=true: removed %d file(s) of a previous run from %s", n, self.path)
            return None
        return existing

    def _manifest_to_continue(
        self, fresh: Manifest, overwrite: bool, retry_keys: tuple[str, ...], retry_errors: bool
    ) -> Manifest:
        """The existing manifest when `fresh` may resume it, else `fresh` (an output holding no successful row
        is taken over); ConfigError when the existing output must not be touched."""
        existing = self._existing_manifest(overwrite)
        self.previous_input = dict(existing.input) if existing is not None else {}
        if existing is None:
            return fresh
        problem = self._incompatibility(existing, fresh, retry_keys, retry_errors)
        if problem is None:
            return existing
        if _manifest_holds_results(existing):
            raise ConfigError(problem)
        self.took_over = " ".join(problem.split("\n")[:2])
        n = self._clear(self.loc)
        diff = "; ".join(x.strip() for x in problem.split("\n") if x.startswith("  "))
        logger.warning(
            "%s: a new configuration takes over this output directory, which holds no successful row "
            "of its previous run (%d file(s) of it removed; what differs: %s)",
            self.path, n, diff or problem.split("\n")[0],
        )  # fmt: skip
        return fresh

    def manifest_to_resume(
        self, fresh: Manifest, overwrite: bool, retry_keys: tuple[str, ...], retry_errors: bool
    ) -> Manifest | None:
        """The manifest :meth:`open` would continue for `fresh` (the existing one, every later record applied),
        found by reading only: no holder is taken and nothing is written. None when it would start afresh (no
        output yet, `overwrite`, an output it takes over), refuse the output (:meth:`resume_problem` says why),
        or the output's state cannot be read."""
        if overwrite:
            return None
        try:
            existing = read_state(self.loc)[0]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if existing is None or self._incompatibility(existing, fresh, retry_keys, retry_errors) is not None:
            return None
        return existing

    def resume_problem(
        self, fresh: Manifest, overwrite: bool, retry_keys: tuple[str, ...], retry_errors: bool
    ) -> str | None:
        """Why :meth:`open` would refuse this output for `fresh` (the ConfigError's message), found by reading
        only: no holder is taken and nothing is written. None when it would resume it, start it, take it over
        (it holds no successful row) or discard it (`overwrite`)."""
        if overwrite:
            return None
        try:
            existing = read_state(self.loc)[0]
        except (ValueError, KeyError, TypeError) as e:
            return f"{self.path}/{MANIFEST_NAME} is unreadable ({e}); use data.overwrite=true to start over"
        except OSError:
            return None  # not there yet: the job creates it
        if existing is None:
            return None
        problem = self._incompatibility(existing, fresh, retry_keys, retry_errors)
        return problem if problem is not None and _manifest_holds_results(existing) else None

    def _incompatibility(
        self,
        old: Manifest,
        new: Manifest,
        retry_keys: tuple[str, ...],
        retry_errors: bool,
    ) -> str | None:
        """Why `old` cannot be resumed by `new`, or None (then `old` takes `new`'s configuration where a
        retry allowed a difference)."""
        if old.fingerprint != new.fingerprint or old.window_rows != new.window_rows:
            diffs = diff_config(old.config, new.config)
            keys = [d.split(":", 1)[0] for d in diffs]
            retry_only = (
                bool(diffs) and all(k in retry_keys for k in keys) and old.window_rows == new.window_rows
            )
            if retry_only and retry_errors:
                for d in diffs:
                    logger.warning(
                        "%s; allowed by data.retry_errors=true: rows already generated keep their output, error "
                        "rows are recomputed with the new setting", d,
                    )  # fmt: skip
                old.fingerprint, old.config = new.fingerprint, new.config
            else:
                model_line = describe_model_change(old.model, new.model)
                if model_line:
                    diffs = [model_line] + diffs
                hint = (
                    "\nTo keep the rows already generated and recompute only the error rows with the new "
                    "setting, add data.retry_errors=true."
                    if retry_only
                    else ""
                )
                return (
                    f"{str(self.path)!r} holds output of a different configuration:\n  "
                    + "\n  ".join((diffs or ["(configuration fingerprint differs)"])[:20])
                    + hint
                    + f"\n{_RESUME_HINT}"
                )
        if old.input.get("fingerprint") != new.input.get("fingerprint"):
            return (
                f"{str(self.path)!r} holds output of different input data (files, sizes or content changed: "
                f"{old.input.get('num_files')} files / {old.input.get('num_rows')} rows before, "
                f"{new.input.get('num_files')} files / {new.input.get('num_rows')} rows now).\n{_RESUME_HINT}"
            )
        if old.shard != new.shard or old.num_windows != new.num_windows:
            return f"{str(self.path)!r} holds another shard of the input ({old.shard}).\n{_RESUME_HINT}"
        if old.batchgen_version != new.batchgen_version:
            logger.warning(
                "resuming output written by batchgen %s with batchgen %s",
                old.batchgen_version,
                new.batchgen_version,
            )
        old.model = new.model or old.model
        old.input = new.input  # same fingerprint; the path may have moved (batchgen-merge reads it from here)
        old.batchgen_version = new.batchgen_version
        return None

    def _fence(self, m: Manifest) -> None:
        """Write this holder's ``open`` record, of an epoch above every one seen: from now on no earlier holder
        can commit. Records another writer created meanwhile are applied to `m` first."""
        self._named = {r.part for r in m.windows.values()} | {f for p in m.partial.values() for f in p.files}
        self._named |= {p.name for p in m.parts}
        epoch = max(m.epoch, self.holder.previous_epoch) + 1
        self.holder.epoch = epoch
        self.log.append({"kind": "open", "epoch": epoch}, m)
        m.epoch = epoch

    def _catch_up(self, m: Manifest) -> None:
        """Apply records created after the last one this job knows (a write of ours whose answer was lost)."""
        for rec in self.log.read_from(self.log.next_seq):
            if apply(m, rec):
                self._named |= set(_names(rec))
                if rec.get("kind") == "part":
                    self._named -= {
                        part_name(w) for w in range(rec["part"]["first"], rec["part"]["last"] + 1)
                    }

    def _compact(self, m: Manifest, prune: bool = True) -> None:
        """``_manifest.json`` := the state up to the last record; then (`prune`) the records it holds go. On
        open they stay: a stale holder then finds every number up to this holder's ``open`` record taken."""
        self.holder.check()
        m.log_seq = self.log.next_seq - 1
        data = m.to_json().encode()
        try:
            if self._manifest_version is None:
                self._manifest_version = put_resolved(self.loc, MANIFEST_NAME, data, if_absent=True)
            else:
                self._manifest_version = put_resolved(
                    self.loc, MANIFEST_NAME, data, if_match=self._manifest_version
                )
        except PreconditionFailed:
            raise LeaseLost(
                f"{self.loc.url_of(MANIFEST_NAME)} was changed by another job (this job's lease was taken over): "
                "this job stops; the rows committed before are kept"
            ) from None
        if prune:
            self.holder.check()
            self.log.delete_through(m.log_seq)
            self.loc.remove_dir(COMMITS_DIR)

    def _verify(self, m: Manifest) -> None:
        """Drop from `m` every window whose part, and every checkpoint file, that is missing or changed since
        its commit (the window is recomputed); what the record names is kept on disk."""
        parts = self.loc.list()
        self._verify_parts(m, parts)
        rolled = {p.name for p in m.parts}
        pieces = self.loc.list(WINDOWS_DIR)
        for w, rec in sorted(m.windows.items()):
            if rec.part in rolled:
                continue
            why = self._changed(
                pieces,
                rec.part,
                rec.size,
                rec.sha256,
                rec.version,
                pieces.get(rec.part[len(WINDOWS_DIR) + 1 :]),
            )
            if why:
                logger.warning(
                    "%s/%s %s since it was committed: window %d is recomputed", self.path, rec.part, why, w
                )
                del m.windows[w]
        cks = self.loc.list(CHECKPOINT_DIR)
        for w, p in sorted(m.partial.items()):
            for f in p.files:
                size, digest, version = (p.checks.get(f) or [0, "", None])[:3]
                why = self._changed(cks, f"{CHECKPOINT_DIR}/{f}", size, digest, version, cks.get(f))
                if why:
                    logger.warning("%s/%s/%s %s: its rows are recomputed", self.path, CHECKPOINT_DIR, f, why)
                    del m.partial[w]
                    break

    def _verify_parts(self, m: Manifest, listing: dict) -> None:
        """Drop from `m` the first rolled part that is missing or changed since its ``part`` record, the parts
        after it and the windows they hold (recomputed: parts stay contiguous from window 0)."""
        for k, part in enumerate(m.parts):
            why = self._changed(listing, part.name, part.size, part.sha256, part.version)
            if why:
                dropped = {p.name for p in m.parts[k:]}
                logger.warning(
                    "%s/%s %s since it was committed: windows %d..%d are recomputed",
                    self.path, part.name, why, part.first, m.parts[-1].last,
                )  # fmt: skip
                for w in [w for w, rec in m.windows.items() if rec.part in dropped]:
                    del m.windows[w]
                del m.parts[k:]
                self._named -= (
                    dropped  # garbage now (a reader must not see their rows twice once rolled again)
                )
                return

    def _changed(
        self, listing: dict, name: str, size: int, digest: str, version: str | None, info: Any = None
    ) -> str | None:
        info = info if info is not None else listing.get(name)
        if info is None:
            return "is missing"
        if not digest:
            return None  # recorded without a checksum
        if size and info.size != size:
            return f"changed size ({size} -> {info.size} bytes)"
        if version is not None and info.etag == version:
            return None
        data = self.loc.read_bytes(name)
        return None if data is not None and sha256(data) == digest else "changed content"

    def _remove_leftovers(self, m: Manifest) -> None:
        """Garbage no committed record names: temp files (of parts, window pieces, checkpoints and records),
        parts, checkpoint files, compacted records. Only the current holder (after its ``open`` record) runs
        this."""
        self.holder.check()
        for w in [w for w in m.partial if w in m.windows]:
            del m.partial[w]
        keep = {r.part for r in m.windows.values()} | {p.name for p in m.parts} | self._named
        for name in self.loc.list():
            if name.startswith(TEMP_PREFIX) or (PART_RE.match(name) and name not in keep):
                self.loc.delete(name)
        for name in self.loc.list(WINDOWS_DIR):
            if name.startswith(TEMP_PREFIX) or (PIECE_RE.match(name) and f"{WINDOWS_DIR}/{name}" not in keep):
                self.loc.delete(f"{WINDOWS_DIR}/{name}")
        if not any(PIECE_RE.match(n) for n in self.loc.list(WINDOWS_DIR)):
            self.loc.remove_dir(WINDOWS_DIR)
        listed = {f for rec in m.partial.values() for f in rec.files} | self._named
        for name in self.loc.list(CHECKPOINT_DIR):
            if is_own_checkpoint(name) and name not in listed:
                self.loc.delete(f"{CHECKPOINT_DIR}/{name}")
        if not m.partial:
            self.loc.remove_dir(CHECKPOINT_DIR)
        for name in self.loc.list(COMMITS_DIR):  # a record whose write was killed: never a record
            if name.startswith(TEMP_PREFIX):
                self.loc.delete(f"{COMMITS_DIR}/{name}")

    def _clear(self, loc: Any) -> int:
        """Delete batchgen's files in `loc`, its checkpoints and commit log (never anything else)."""
        count = 0
        for name in loc.list():
            if is_own_file(name):
                loc.delete(name)
                count += 1
        for sub, own in (
            (CHECKPOINT_DIR, is_own_checkpoint),
            (COMMITS_DIR, lambda n: n.endswith(".json") or n.startswith(TEMP_PREFIX)),
            (WINDOWS_DIR, lambda n: bool(PIECE_RE.match(n)) or n.startswith(TEMP_PREFIX)),
        ):
            for name in loc.list(sub):
                if own(name):
                    loc.delete(f"{sub}/{name}")
                    count += 1
            loc.remove_dir(sub)
        if loc is self.loc:
            self._manifest_version = None
            self.log = CommitLog(self.loc)
        return count

    # ------------------------------------------------------------------------------ layout ownership
    def _claim_layout(self, overwrite: bool) -> None:
        """Make this job's shard layout the owner of data.output (``_layout.json``), or refuse."""
        mine = (json.dumps({"shard_count": self.shard_count}) + "\n").encode()
        raw = self.root_loc.read_bytes(LAYOUT_NAME)
        owner = _parse_layout(raw)
        if owner == self.shard_count:
            return
        others = self._other_layouts()
        valuable = [loc for loc in others if _holds_results(loc) or self._held_by_other(loc)]
        if owner is not None and not valuable and not others and not overwrite:
            valuable = []  # the owner's output is gone: take it over
        if valuable and not overwrite:
            where = ", ".join(str(loc.display) for loc in valuable)
            shown = f"data.shard.count={owner}" if owner is not None else "another shard layout"
            raise ConfigError(
                f"data.output {str(self.root)!r} already holds output of another shard layout ({shown}: {where}); "
                f"this job's is data.shard.count={self.shard_count}: use another data.output or "
                "data.overwrite=true to discard it"
            )
        for loc in others:
            if not overwrite:
                logger.warning(
                    "taking over %s: the output of another shard layout there holds no successful row",
                    loc.display,
                )
            self._clear(loc)
        try:
            if raw is None:
                put_resolved(self.root_loc, LAYOUT_NAME, mine, if_absent=True)
            else:
                self.root_loc.put(LAYOUT_NAME, mine)
        except PreconditionFailed:  # another job claimed it at the same moment
            if _parse_layout(self.root_loc.read_bytes(LAYOUT_NAME)) != self.shard_count:
                raise ConfigError(
                    f"data.output {str(self.root)!r} was claimed by a job of another shard layout at the same "
                    "moment; use another data.output"
                ) from None

    def _other_layouts(self) -> list[Any]:
        """Locations under data.output holding a manifest of a different shard layout than ours."""
        found = []
        if self.shard_count > 1 and self.root_loc.info(MANIFEST_NAME) is not None:
            found.append(self.root_loc)
        for name in self.root_loc.list_dirs():
            m = SHARD_RE.match(name)
            if m and int(m.group(2)) != self.shard_count:
                loc = self.root_loc.child(name)
                if loc.info(MANIFEST_NAME) is not None:
                    found.append(loc)
        return found

    def _held_by_other(self, loc: Any) -> bool:
        return Lease.is_held(loc) if self.remote else FileLock.is_held(loc.dir, LOCK_NAME)

    # -------------------------------------------------------------------------------------- writing
    def _put_unit(self, name: str, data: bytes) -> list:
        """Write a part or checkpoint file whole; returns ``[size, sha256, version]``. A name no record names
        is created only if absent, so a stale holder's late write cannot replace it; an object found there
        that no record names (such a late write) is replaced."""
        self.holder.check()
        try:
            if name in self._named:
                version = self.loc.put(name, data)
            else:
                version = put_resolved(self.loc, name, data, if_absent=True)
        except (
            PreconditionFailed
        ):  # an object no record names (a stale holder's late write): ours replaces it
            self.holder.check()
            version = self.loc.put(name, data)
        return [len(data), sha256(data), version]

    def commit(self, window: int, table: pa.Table, record: WindowRecord) -> None:
        """Make a finished window durable: its part, then its commit record; then its checkpoint files go.
        On a failure nothing is deleted and the state in memory stays what the log holds."""
        assert self.manifest is not None, "open() first"
        m = self.manifest
        name = part_name(window)
        record.part = name
        record.size, record.sha256, record.version = self._put_unit(name, _table_bytes(name, table))
        self.holder.check()
        rec = {"kind": "window", "epoch": m.epoch, "window": window, "record": _asdict(record)}
        done = list(m.partial[window].files) if window in m.partial else []
        self.log.append(rec)
        apply(m, rec)
        self._named.add(name)
        for f in done:
            self.holder.check()
            self.loc.delete(f"{CHECKPOINT_DIR}/{f}")
            self._named.discard(f)
        if done and not m.partial:
            self.loc.remove_dir(CHECKPOINT_DIR)

    def _put_stream_unit(self, name: str, write: Writer) -> list:
        """:meth:`_put_unit` of the file ``write(file)`` writes, streamed (never whole in memory)."""
        self.holder.check()
        try:
            return list(self.loc.put_stream(name, write, if_absent=name not in self._named))
        except (
            PreconditionFailed
        ):  # an object no record names (a stale holder's late write): ours replaces it
            self.holder.check()
            return list(self.loc.put_stream(name, write))

    def commit_part(self, part: PartRecord, write: Writer) -> None:
        """Roll-up: write the Parquet file of `part` (windows ``part.first..last``) streamed from ``write(file)``
        and complete, then the ``part`` record naming it; only then are the covered windows' pieces garbage,
        deleted here (by the current holder). On a failure before the record nothing is deleted: the pieces
        stay what the state names, and the part file (a temporary file, an aborted upload, or a complete file
        named by no record) is the next holder's garbage."""
        assert self.manifest is not None, "open() first"
        m = self.manifest
        part.size, part.sha256, part.version = self._put_stream_unit(part.name, write)
        self.holder.check()
        rec = {"kind": "part", "epoch": m.epoch, "part": _asdict(part)}
        pieces = [
            w.part
            for i, w in sorted(m.windows.items())
            if part.first <= i <= part.last and w.part != part.name
        ]
        self.log.append(rec)
        apply(m, rec)
        self._named.add(part.name)
        for name in pieces:
            self.holder.check()
            self._named.discard(name)
            self.loc.delete(name)

    def read_piece(self, name: str) -> pa.Table:
        """A committed piece or part (by name)."""
        return self._read_table(name)

    def piece_size(self, window: int) -> int:
        """The size of `window`'s committed piece (0 when a part holds it)."""
        assert self.manifest is not None, "open() first"
        rec = self.manifest.windows.get(window)
        return rec.size if rec is not None and rec.part.startswith(WINDOWS_DIR) else 0

    def write_part(self, window: int, table: pa.Table) -> str:
        """Write `table` as the window's part file (not committed); returns its name."""
        name = part_name(window)
        self._put_unit(name, _table_bytes(name, table))
        return name

    def write_checkpoint(
        self, window: int, table: pa.Table, rows: int, rows_ok: int, input_sha256: str | None
    ) -> str:
        """Add `table` (finished rows of an unfinished window, with the extra piece columns) as a checkpoint
        file of `window` and commit it; returns the file name."""
        assert self.manifest is not None, "open() first"
        m = self.manifest
        prev = m.partial.get(window)
        seq = 1 + max((int(CHECKPOINT_RE.match(f).group(2)) for f in prev.files), default=-1) if prev else 0  # type: ignore[union-attr]
        name = checkpoint_name(window, seq)
        size, digest, version = self._put_unit(f"{CHECKPOINT_DIR}/{name}", _table_bytes(name, table))
        self.holder.check()
        rec = {
            "kind": "checkpoint", "epoch": m.epoch, "window": window, "file": name, "rows": rows,
            "rows_ok": rows_ok, "input_sha256": input_sha256, "size": size, "sha256": digest, "version": version,
        }  # fmt: skip
        self.log.append(rec)
        apply(m, rec)
        self._named.add(name)
        return name

    def checkpoint_pieces(self, window: int, manifest: Manifest | None = None) -> list[pa.Table]:
        """The checkpointed rows of `window` (tables with the extra piece columns), as this holder's manifest
        records them, or `manifest` (one read without opening: :meth:`manifest_to_resume`)."""
        m = manifest if manifest is not None else self.manifest
        assert m is not None, "open() first"
        rec = m.partial.get(window)
        return [
            self._read_table(f"{CHECKPOINT_DIR}/{name}") for name in (rec.files if rec is not None else [])
        ]

    def read_part(self, window: int) -> pa.Table:
        """The committed part of `window`."""
        assert self.manifest is not None, "open() first"
        return self._read_table(self.manifest.windows[window].part)

    def _read_table(self, name: str) -> pa.Table:
        raw = self.loc.read_bytes(name)
        if raw is None:
            raise FileNotFoundError(f"{self.loc.url_of(name)} is missing")
        if name.endswith(".parquet"):
            return pq.read_table(io.BytesIO(raw))
        return pa.ipc.open_file(pa.BufferReader(raw)).read_all()

    # --------------------------------------------------------------------------------------- report
    @property
    def report_path(self) -> Any:
        return self.path / REPORT_NAME if isinstance(self.path, Path) else self.loc.url_of(REPORT_NAME)

    @property
    def report_location(self) -> str:
        """Where ``_report.json`` is (a path or a URL), for messages."""
        return str(self.report_path)

    def has_report(self) -> bool:
        return self.loc.info(REPORT_NAME) is not None

    def save_report(self, text: str) -> None:
        """Write ``_report.json`` (one atomic write)."""
        self.loc.put(REPORT_NAME, text.encode())


def _names(rec: dict[str, Any]) -> list[str]:
    if rec.get("kind") == "window":
        return [rec["record"]["part"]]
    if rec.get("kind") == "checkpoint":
        return [rec["file"]]
    if rec.get("kind") == "part":
        return [rec["part"]["name"]]
    return []


def _asdict(record: WindowRecord) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(record)


def _table_bytes(name: str, table: pa.Table) -> bytes:
    """`table` as file bytes: Parquet for ``.parquet``, else Arrow IPC."""
    if name.endswith(".parquet"):
        return table_to_parquet_bytes(table, compression="zstd")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _parse_layout(raw: bytes | None) -> int | None:
    try:
        return int(json.loads(raw)["shard_count"]) if raw is not None else None
    except (ValueError, KeyError, TypeError):
        return None


def _manifest_holds_results(m: Manifest) -> bool:
    """Whether an output holds any successful row (then only data.overwrite may discard it)."""
    return any(r.rows_ok for r in m.windows.values()) or any(p.rows_ok for p in m.partial.values())


def _holds_results(loc: Any) -> bool:
    try:
        m = read_state(loc)[0]
    except (ValueError, KeyError, TypeError, OSError):
        return True  # unreadable: do not assume it is worthless
    return m is not None and _manifest_holds_results(m)


def on_disk_full(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is a full disk or an exceeded quota."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in DISK_FULL_ERRNOS:
            return True
        if "No space left on device" in str(cur) or "Disk quota exceeded" in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def open_output_dir(
    output: str,
    shard_index: int = 0,
    shard_count: int = 1,
    storage_options: dict[str, Any] | None = None,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
) -> OutputDir:
    """The output directory of a shard: a local path or a URL of an object store."""
    return OutputDir(output, shard_index, shard_count, storage_options, lease_ttl_s)
