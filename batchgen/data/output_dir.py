"""The output directory of one shard: the lock, resume checks, cleanup of a killed run, atomic commits.

File names are those of :mod:`batchgen.data.layout`. Invariants:
- A part file appears under its final name only complete and fsynced (:func:`batchgen.atomic.atomic_write`);
  the manifest is updated (atomically) only after that rename, so every window it lists has its part.
- Opening removes temp files and part files the manifest does not list (leftovers of a killed run), and
  refuses (ConfigError) an output written with a different configuration, input or shard layout unless
  ``overwrite``, which deletes batchgen's own files only (:func:`~batchgen.data.layout.is_own_file`).
- One process per shard directory: an exclusive ``flock`` on the lock file, held until :meth:`OutputDir.close`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.atomic import atomic_write
from batchgen.data.layout import (
    LOCK_NAME,
    MANIFEST_NAME,
    PART_RE,
    REPORT_NAME,
    SHARD_RE,
    TEMP_PREFIX,
    is_own_file,
    part_name,
    shard_dir_name,
)
from batchgen.data.manifest import Manifest, WindowRecord, diff_config
from batchgen.errors import ConfigError

logger = logging.getLogger(__name__)

_RESUME_HINT = (
    "Rerun with the original settings to resume, choose another data.output, or pass "
    "data.overwrite=true to discard the existing output."
)


class OutputDir:
    """One shard's output directory: ``output`` itself, or its shard sub-directory when ``shard_count > 1``."""

    def __init__(self, output: str | os.PathLike, shard_index: int = 0, shard_count: int = 1) -> None:
        self.root = Path(output)
        self.shard_index, self.shard_count = int(shard_index), int(shard_count)
        sub = shard_dir_name(self.shard_index, self.shard_count)
        self.path = self.root / sub if sub else self.root
        self._lock_fd: int | None = None
        self.manifest: Manifest | None = None

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
                "wait for it to finish or stop it"
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

    def _clear(self, directory: Path) -> int:
        """Delete batchgen's files in `directory` (never anything else); returns how many."""
        count = 0
        if not directory.is_dir():
            return 0
        for p in directory.iterdir():
            if p.is_file() and is_own_file(p.name):
                p.unlink(missing_ok=True)
                count += 1
        return count

    def _other_layouts(self) -> list[Path]:
        """Directories under data.output holding a manifest of a different shard layout than ours."""
        found = []
        if self.shard_count > 1 and (self.root / MANIFEST_NAME).is_file():
            found.append(self.root)
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                m = SHARD_RE.match(p.name)
                if m and p.is_dir() and int(m.group(2)) != self.shard_count and (p / MANIFEST_NAME).is_file():
                    found.append(p)
        return found

    def _clear_other_layouts(self, overwrite: bool) -> None:
        others = self._other_layouts()
        if others and not overwrite:
            where = ", ".join(str(p) for p in others)
            raise ConfigError(
                f"data.output {str(self.root)!r} already holds output of another shard layout ({where}); "
                "use another data.output or data.overwrite=true to discard it"
            )
        for p in others:
            self._clear(p)

    def _existing_manifest(self, overwrite: bool) -> Manifest | None:
        """The manifest to resume from: None when there is none or `overwrite` discards it (and the files)."""
        try:
            existing = Manifest.load(self.path)
        except (ValueError, KeyError, TypeError) as e:
            if not overwrite:
                raise ConfigError(
                    f"{self.path / MANIFEST_NAME} is unreadable ({e}); use data.overwrite=true to start over"
                ) from e
            existing = None
        if overwrite:
            n = self._clear(self.path)
            if n:
                logger.info("data.overwrite=true: removed %d file(s) of a previous run from %s", n, self.path)
            return None
        return existing

    def _remove_leftovers(self, manifest: Manifest) -> None:
        """A killed run's unfinished temp files, and parts written whose window never reached the manifest."""
        keep = {r.part for r in manifest.windows.values()}
        for p in self.path.iterdir():
            if p.name.startswith(TEMP_PREFIX) and p.is_file():
                p.unlink(missing_ok=True)
            elif PART_RE.match(p.name) and p.name not in keep:
                p.unlink(missing_ok=True)

    def open(self, fresh: Manifest, overwrite: bool = False) -> Manifest:
        """Lock the directory, clean leftovers, and return the manifest to continue (or `fresh`).

        Raises ConfigError when the directory holds output of another configuration, input or shard
        layout (unless `overwrite`, which discards it).
        """
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._clear_other_layouts(overwrite)
            existing = self._existing_manifest(overwrite)
            if existing is not None:
                self._check_compatible(existing, fresh)
            manifest = existing if existing is not None else fresh
            self._remove_leftovers(manifest)
            manifest.save(self.path)  # atomic; its directory fsync also makes the removals durable
            self.manifest = manifest
            return manifest
        except BaseException:
            self.close()
            raise

    def _check_compatible(self, old: Manifest, new: Manifest) -> None:
        if old.fingerprint != new.fingerprint or old.window_rows != new.window_rows:
            diffs = diff_config(old.config, new.config) or ["(configuration fingerprint differs)"]
            raise ConfigError(
                f"{str(self.path)!r} holds output of a different configuration:\n  "
                + "\n  ".join(diffs[:20])
                + f"\n{_RESUME_HINT}"
            )
        if old.input.get("fingerprint") != new.input.get("fingerprint"):
            raise ConfigError(
                f"{str(self.path)!r} holds output of different input data (files, sizes or content changed: "
                f"{old.input.get('num_files')} files / {old.input.get('num_rows')} rows before, "
                f"{new.input.get('num_files')} files / {new.input.get('num_rows')} rows now).\n{_RESUME_HINT}"
            )
        if old.shard != new.shard or old.num_windows != new.num_windows:
            raise ConfigError(
                f"{str(self.path)!r} holds another shard of the input ({old.shard}).\n{_RESUME_HINT}"
            )
        if old.batchgen_version != new.batchgen_version:
            logger.warning(
                "resuming output written by batchgen %s with batchgen %s",
                old.batchgen_version,
                new.batchgen_version,
            )

    # -------------------------------------------------------------------------------------- writing
    def write_part(self, window: int, table: pa.Table) -> str:
        """Write `table` as the window's part file (atomically); returns its name."""
        name = part_name(window)
        with atomic_write(self.path / name) as tmp:
            pq.write_table(table, tmp, compression="zstd")
        return name

    def commit(self, window: int, table: pa.Table, record: WindowRecord) -> None:
        """Make a finished window durable: its part first, then the manifest entry."""
        assert self.manifest is not None, "open() first"
        record.part = self.write_part(window, table)
        self.manifest.windows[window] = record
        self.manifest.save(self.path)

    @property
    def report_path(self) -> Path:
        return self.path / REPORT_NAME
