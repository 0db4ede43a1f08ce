"""Atomic file writes: readers see the old content or the new one, never a mix, and a rename is durable.

Every file batchgen commits (parts, manifest, report, merged output, cached checkpoints, benchmark results)
goes through :func:`atomic_write` or its byte/text shorthands: write a temporary file beside the target, fsync
it, rename it over the target, fsync the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_mode() -> int:
    """Permissions of a new regular file under the current umask (mkstemp alone gives 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit fsync it, rename it to ``path`` and fsync the
    directory. On an exception the temporary file is removed and ``path`` is untouched.

    The temporary name starts with ``.tmp-`` so dataset readers (which skip names starting with ``.`` or
    ``_``) never see it.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, file_mode())
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)


def remove_stale_temps(path: str | os.PathLike) -> int:
    """Remove the temporary files :func:`atomic_write` left beside ``path`` when a process writing it was killed
    (``.tmp-<name>.*``: only names it makes); call it only while no other process writes ``path``. Returns how
    many it removed."""
    path = Path(path)
    prefix = f".tmp-{path.name}."
    count = 0
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return 0
    for e in entries:
        if e.name.startswith(prefix) and e.is_file(follow_symlinks=False):
            _unlink_quietly(e.path)
            count += 1
    return count


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def build_dir_once(target: Path, marker: str, build: Callable[[Path], object]) -> str:
    """``target`` as a string, built by ``build(tmp)`` unless it already holds ``marker`` (a file the build
    writes). The build goes into a temporary directory beside ``target``, renamed into place, so concurrent
    first uses never see (or leave) a half-built directory: the loser of the rename race discards its copy."""
    if (target / marker).is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
