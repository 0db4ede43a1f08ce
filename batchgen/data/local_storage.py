"""A directory on the local disk behind the storage location interface of :class:`batchgen.data.storage.Location`.

Invariants:
- :meth:`LocalLocation.put` (and :meth:`~LocalLocation.put_stream`, from a writer function: memory holds
  nothing of the file) writes a temporary file beside the target, fsyncs it, then makes it the target in
  one step and fsyncs the directory: ``os.link`` for a create-exclusive write (``if_absent``; EEXIST is
  PreconditionFailed), ``os.replace`` otherwise. Readers see the old content or the new one, never a part.
- Nothing is read or written through a symbolic link: files are opened with ``O_NOFOLLOW`` and a target that
  is a link is refused (StorageError), so a link planted in an output directory never redirects a write.
- An object's version is ``inode-mtime_ns-size``: any replacement gives a new one.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path
from typing import Any

from batchgen.data.storage import HashingWriter, ObjectInfo, PreconditionFailed, StorageError, Writer
from batchgen.runtime.atomic import file_mode, fsync_dir

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
TEMP_PREFIX = ".tmp-"


def _version(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


class LocalLocation:
    """A directory of the local file system; names passed to the methods are relative to it."""

    conditional = True
    protocol = "file"

    def __init__(self, path: str | os.PathLike, key: str = "data.output") -> None:
        self.dir = Path(path)
        self.key = key

    @property
    def url(self) -> str:
        return str(self.dir)

    @property
    def display(self) -> Path:
        """What messages and callers show for this location (a path)."""
        return self.dir

    def child(self, sub: str) -> LocalLocation:
        return LocalLocation(self.dir / sub, self.key) if sub else self

    def path(self, name: str = "") -> str:
        return str(self.dir / name) if name else str(self.dir)

    def url_of(self, name: str = "") -> str:
        return self.path(name)

    def _refuse_link(self, name: str) -> StorageError:
        return StorageError(
            f"{self.key}: {self.path(name)!r} is a symbolic link; batchgen never reads or writes its bookkeeping "
            "through a link: remove it (or choose another data.output)"
        )

    # ------------------------------------------------------------------------------------------ reads
    def info(self, name: str) -> ObjectInfo | None:
        try:
            st = os.lstat(self.path(name))
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise self._refuse_link(name)
        if not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(st.st_size, _version(st))

    def read_bytes(self, name: str) -> bytes | None:
        try:
            fd = os.open(self.path(name), os.O_RDONLY | _NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._refuse_link(name) from e
            raise
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def open_read(self, name: str) -> Any:
        fd = os.open(self.path(name), os.O_RDONLY | _NOFOLLOW)
        return os.fdopen(fd, "rb")

    def list(self, sub: str = "") -> dict[str, ObjectInfo]:
        d = self.dir / sub if sub else self.dir
        out = {}
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        for e in entries:
            if e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                out[e.name] = ObjectInfo(st.st_size, _version(st))
        return out

    def list_dirs(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.dir) if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    # ----------------------------------------------------------------------------------------- writes
    def put(
        self, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str | None:
        return self.put_stream(name, lambda f: f.write(data), if_absent=if_absent, if_match=if_match)[2]

    def put_stream(
        self, name: str, write: Writer, *, if_absent: bool = False, if_match: str | None = None
    ) -> tuple[int, str, str | None]:
        """Write file `name` from ``write(file)`` (module doc); ``(size, sha256, version)``."""
        target = Path(self.path(name))
        target.parent.mkdir(parents=True, exist_ok=True)
        cur = self.info(name)  # refuses a planted link
        if if_match is not None and (cur is None or cur.etag != if_match):
            raise PreconditionFailed(self.path(name))
        if if_absent and cur is not None:
            raise PreconditionFailed(self.path(name))
        tmp = target.parent / f"{TEMP_PREFIX}{target.name}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, file_mode())
        try:
            with os.fdopen(fd, "wb") as f:
                sink = HashingWriter(f)
                write(sink)
                f.flush()
                os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, target)
                except FileExistsError:
                    raise PreconditionFailed(self.path(name)) from None
                os.unlink(tmp)
            else:
                os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(target.parent)
        return sink.size, sink.hexdigest(), _version(os.lstat(target))

    def delete(self, name: str) -> None:
        try:
            os.unlink(self.path(name))  # a link is removed itself, never what it points to
        except (FileNotFoundError, NotADirectoryError):
            pass

    def remove_dir(self, sub: str) -> None:
        """Remove the empty directory `sub` (nothing when it is not empty)."""
        try:
            os.rmdir(self.dir / sub)
        except OSError:
            pass
