"""The output directory of one shard: the lock, resume checks, cleanup of a killed run, atomic commits.

File names are those of :mod:`batchgen.data.layout`. Invariants:
- A part or checkpoint file appears under its final name only complete and fsynced
  (:func:`batchgen.atomic.atomic_write`); the manifest is updated (atomically) only after that rename, so every
  file it lists is complete. A window's checkpoint files are deleted only after the manifest lists its part.
- Opening removes temp files, parts and checkpoint files the manifest does not list (leftovers of a killed
  run), and refuses (ConfigError) an output written with a different configuration, input or shard layout
  unless ``overwrite`` (which deletes batchgen's own files only, :func:`~batchgen.data.layout.is_own_file`) —
  or unless that output holds no successful row at all (a failed start, a run whose every row failed): then
  the new configuration takes it over, saying so in the log.
- One process per shard directory: an exclusive ``flock`` on the lock file, held until :meth:`OutputDir.close`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.atomic import atomic_write, atomic_write_text
from batchgen.data.layout import (
    CHECKPOINT_DIR,
    CHECKPOINT_RE,
    LOCK_NAME,
    MANIFEST_NAME,
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
from batchgen.data.manifest import Manifest, PartialRecord, WindowRecord, describe_model_change, diff_config
from batchgen.data.parts import part_as_piece, part_stats
from batchgen.errors import ConfigError

logger = logging.getLogger(__name__)

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
    """One shard's output directory: ``output`` itself, or its shard sub-directory when ``shard_count > 1``."""

    def __init__(self, output: str | os.PathLike, shard_index: int = 0, shard_count: int = 1) -> None:
        self.root = Path(output)
        self.shard_index, self.shard_count = int(shard_index), int(shard_count)
        sub = shard_dir_name(self.shard_index, self.shard_count)
        self.path = self.root / sub if sub else self.root
        self._lock_fd: int | None = None
        self.manifest: Manifest | None = None
        self.took_over: str | None = None
        """Why :meth:`open` discarded the previous output of another configuration (None when it did not)."""
        self.previous_input: dict[str, Any] = {}
        """The input description of the manifest :meth:`open` resumed ({} when it started anew)."""

    # ------------------------------------------------------------------------------------ lifecycle
    def _lock(self) -> None:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
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
                f"another batchgen process ({holder or 'unknown pid'}) is writing {str(self.path)!r}; "
                "wait for it to finish or stop it (in a sweep, give each job its own data.output, e.g. "
                "data.output=out/${hydra:job.num})"
            ) from None
        except (ImportError, OSError) as e:  # no flock on this filesystem: carry on unlocked
            logger.warning("cannot lock %s (%s); make sure no other job writes the same output", self.path, e)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINT_DIR

    def _clear(self, directory: Path) -> int:
        """Delete batchgen's files in `directory` and its checkpoint directory (never anything else)."""
        count = 0
        if not directory.is_dir():
            return 0
        for p in directory.iterdir():
            if p.is_file() and is_own_file(p.name):
                p.unlink(missing_ok=True)
                count += 1
        ck = directory / CHECKPOINT_DIR
        if ck.is_dir():
            for p in ck.iterdir():
                if p.is_file() and is_own_checkpoint(p.name):
                    p.unlink(missing_ok=True)
                    count += 1
            try:
                ck.rmdir()
            except OSError:
                pass
        return count

    def _other_layouts(self) -> list[Path]:
        """Directories under data.output holding a manifest of a different shard layout than ours."""
        found = []
        if self.shard_count > 1 and Manifest.path_in(self.root) is not None:
            found.append(self.root)
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                m = SHARD_RE.match(p.name)
                if m and p.is_dir() and int(m.group(2)) != self.shard_count and Manifest.path_in(p):
                    found.append(p)
        return found

    def _clear_other_layouts(self, overwrite: bool) -> None:
        others = self._other_layouts()
        valuable = [p for p in others if self._holds_results_at(p)]
        if valuable and not overwrite:
            where = ", ".join(str(p) for p in valuable)
            raise ConfigError(
                f"data.output {str(self.root)!r} already holds output of another shard layout ({where}); "
                "use another data.output or data.overwrite=true to discard it"
            )
        for p in others:
            if not overwrite:
                logger.warning(
                    "taking over %s: the output of another shard layout there holds no successful row", p
                )
            self._clear(p)

    def _existing_manifest(self, overwrite: bool) -> Manifest | None:
        """The manifest to resume from: None when there is none or `overwrite` discards it (and the files)."""
        try:
            existing = self._load_manifest()
        except (ValueError, KeyError, TypeError) as e:
            if not overwrite:
                raise ConfigError(
                    f"{self.path}/{MANIFEST_NAME} is unreadable ({e}); use data.overwrite=true to start over"
                ) from e
            existing = None
        if overwrite:
            n = self._clear(self.path)
            if n:
                logger.info("data.overwrite=true: removed %d file(s) of a previous run from %s", n, self.path)
            return None
        return existing

    def _remove_leftovers(self, manifest: Manifest) -> None:
        """A killed run's unfinished temp files, parts written whose window never reached the manifest, and
        checkpoint files the manifest does not list (or of windows already finished)."""
        keep = {r.part for r in manifest.windows.values()}
        for name in self._files():  # the parts are batchgen.data.part_roll's to check
            if name.startswith(TEMP_PREFIX):
                self._delete(name)
        for name in self._files(WINDOWS_DIR):  # window pieces (part_name)
            if name.startswith(TEMP_PREFIX) or (PIECE_RE.match(name) and f"{WINDOWS_DIR}/{name}" not in keep):
                self._delete(f"{WINDOWS_DIR}/{name}")
        listed = {f for w, rec in manifest.partial.items() if w not in manifest.windows for f in rec.files}
        for w in [w for w in manifest.partial if w in manifest.windows]:
            del manifest.partial[w]
        for name in self._files(CHECKPOINT_DIR):
            if is_own_checkpoint(name) and name not in listed:
                self._delete(f"{CHECKPOINT_DIR}/{name}")
        for w, rec in manifest.windows.items():
            if rec.rewriting:  # killed while replacing the part: count what the part holds now
                self._rederive(w, rec, manifest)

    def _rederive(self, w: int, rec: WindowRecord, manifest: Manifest) -> None:
        n = int((manifest.config.get("sampling") or {}).get("n", 1) or 1)
        st = part_stats(part_as_piece(self._read_table(rec.part), n), n)
        for name, value in asdict(st).items():  # a part's stats are its record's counts, field for field
            setattr(rec, name, value)
        rec.rows_by_adapter = None  # the part holds no adapter names: no longer known
        rec.rewriting = False

    def open(
        self,
        fresh: Manifest,
        overwrite: bool = False,
        retry_keys: tuple[str, ...] = (),
        retry_errors: bool = False,
    ) -> Manifest:
        """Lock the directory, clean leftovers, and return the manifest to continue (or `fresh`).

        Raises ConfigError when the directory holds output of another configuration, input or shard layout
        (unless `overwrite`, which discards it, or that output holds no successful row: taken over).
        `retry_keys` are the dotted config keys (``engine.max_model_len``) that may change when `retry_errors`
        (rows already generated keep their output, error rows are recomputed).
        """
        with _setup_errors(self.path, "create the output directory"):
            self._makedirs()
        with _setup_errors(self.path, "write into"):
            self._lock()
        try:
            with _setup_errors(self.path, "write into"):
                self._clear_other_layouts(overwrite)
                manifest = self._manifest_to_continue(fresh, overwrite, retry_keys, retry_errors)
                self._remove_leftovers(manifest)
                self._save_manifest(manifest)  # atomic; its directory fsync also makes the removals durable
        except BaseException:
            self.close()
            raise
        self.manifest = manifest
        return manifest

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
        n = self._clear(self.path)
        diff = "; ".join(x.strip() for x in problem.split("\n") if x.startswith("  "))
        logger.warning(
            "%s: a new configuration takes over this output directory, which holds no successful row "
            "of its previous run (%d file(s) of it removed; what differs: %s)",
            self.path, n, diff or problem.split("\n")[0],
        )  # fmt: skip
        return fresh

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

    # -------------------------------------------------------------------------------------- writing
    def write_part(self, window: int, table: pa.Table) -> str:
        """Write `table` as the window's part file (atomically); returns its name."""
        name = part_name(window)
        self._write_table(name, table)
        return name

    def commit(self, window: int, table: pa.Table, record: WindowRecord) -> None:
        """Make a finished window durable: its part first, then the manifest entry, then its checkpoint files
        go. Replacing a committed part (a retry) flags the record first, so a crash in between is repaired on
        the next open."""
        assert self.manifest is not None, "open() first"
        m = self.manifest
        prev = m.windows.get(window)
        if prev is not None:
            prev.rewriting = True
            self._save_manifest(m)
        record.part = self.write_part(window, table)
        m.windows[window] = record
        done = m.partial.pop(window, None)
        try:
            self._save_manifest(m)
        except BaseException:
            # not recorded (a full disk...): readers must not see the part, and the manifest in memory stays
            # what is on disk; a replaced part is a complete part of the window either way (rewriting=True)
            if prev is None:
                del m.windows[window]
                self._delete(record.part)
            else:
                m.windows[window] = prev
            if done is not None:
                m.partial[window] = done
            raise
        for name in done.files if done is not None else []:
            self._delete(f"{CHECKPOINT_DIR}/{name}")
        if done is not None and not m.partial:
            self._checkpoint_dir_done()

    def write_checkpoint(
        self, window: int, table: pa.Table, rows: int, rows_ok: int, input_sha256: str | None
    ) -> str:
        """Add `table` (finished rows of an unfinished window, with the extra piece columns) as a checkpoint
        file of `window` and record it in the manifest; returns the file name."""
        assert self.manifest is not None, "open() first"
        m = self.manifest
        rec = m.partial.get(window)
        seq = 1 + max((int(CHECKPOINT_RE.match(f).group(2)) for f in rec.files), default=-1) if rec else 0  # type: ignore[union-attr]
        name = checkpoint_name(window, seq)
        self._write_table(f"{CHECKPOINT_DIR}/{name}", table)
        new = rec is None
        if rec is None:
            rec = m.partial[window] = PartialRecord(files=[], rows=0, rows_ok=0, input_sha256=input_sha256)
        rec.files.append(name)
        rec.rows += rows
        rec.rows_ok += rows_ok
        try:
            self._save_manifest(m)
        except BaseException:
            rec.files.pop()
            rec.rows -= rows
            rec.rows_ok -= rows_ok
            if new:
                del m.partial[window]
            self._delete(f"{CHECKPOINT_DIR}/{name}")
            raise
        return name

    def checkpoint_pieces(self, window: int) -> list[pa.Table]:
        """The checkpointed rows of `window` (tables with the extra piece columns)."""
        assert self.manifest is not None, "open() first"
        rec = self.manifest.partial.get(window)
        out = []
        for name in rec.files if rec is not None else []:
            out.append(self._read_table(f"{CHECKPOINT_DIR}/{name}"))
        return out

    def read_part(self, window: int) -> pa.Table:
        """The committed part of `window`."""
        assert self.manifest is not None, "open() first"
        return self._read_table(self.manifest.windows[window].part)

    @property
    def report_path(self) -> Path:
        return self.path / REPORT_NAME

    @property
    def report_location(self) -> str:
        """Where ``_report.json`` is (a path or a URL), for messages."""
        return str(self.report_path)

    def has_report(self) -> bool:
        return self.report_path.is_file()

    def save_report(self, text: str) -> None:
        """Write ``_report.json`` (atomically)."""
        atomic_write_text(self.report_path, text)

    # ------------------------------------------------------------------- storage (local files; see RemoteOutputDir)
    def _makedirs(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def _load_manifest(self) -> Manifest | None:
        return Manifest.load(self.path)

    def _save_manifest(self, m: Manifest) -> None:
        m.save(self.path)

    def _files(self, sub: str = "") -> list[str]:
        """Names of the files directly in the directory (or its sub-directory `sub`)."""
        d = self.path / sub if sub else self.path
        return [p.name for p in d.iterdir() if p.is_file()] if d.is_dir() else []

    def _delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def _write_table(self, name: str, table: pa.Table) -> None:
        """`table` as file `name` (Parquet for ``.parquet``, else Arrow IPC), atomically."""
        target = self.path / name
        target.parent.mkdir(exist_ok=True)
        with atomic_write(target) as tmp:
            if name.endswith(".parquet"):
                pq.write_table(table, tmp, compression="zstd")
            else:
                opts = pa.ipc.IpcWriteOptions(compression="zstd")
                with (
                    pa.OSFile(str(tmp), "wb") as sink,
                    pa.ipc.new_file(sink, table.schema, options=opts) as w,
                ):
                    w.write_table(table)

    def _read_table(self, name: str) -> pa.Table:
        if name.endswith(".parquet"):
            return pq.read_table(self.path / name)
        with pa.memory_map(str(self.path / name)) as src:
            return pa.ipc.open_file(src).read_all()

    def _checkpoint_dir_done(self) -> None:
        """Every checkpoint of the directory is folded into its part: remove the (empty) checkpoint directory."""
        with contextlib.suppress(OSError):
            self.checkpoint_dir.rmdir()  # only when empty

    def _holds_results_at(self, directory: Any) -> bool:
        return _holds_results(directory)


def _manifest_holds_results(m: Manifest) -> bool:
    """Whether an output holds any successful row (then only data.overwrite may discard it)."""
    return any(r.rows_ok for r in m.windows.values()) or any(p.rows_ok for p in m.partial.values())


def _holds_results(directory: Path) -> bool:
    try:
        m = Manifest.load(directory)
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
