"""Small JSON results kept between runs under ``$BATCHGEN_CACHE`` (default ``~/.cache/batchgen``), so start-up
does not redo (and import transformers for) work whose inputs have not changed.

Invariants: an entry is named by a caller's key — the SHA-256 of everything the result depends on, always
including `environment_key` (the installed transformers and torch versions) and the source of the module
computing it; every read or write failure is silent (a miss): the cache can save time, never fail a run.
Entries are written atomically (:mod:`batchgen.runtime.atomic`), so a reader never sees a partial entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from batchgen.runtime.atomic import atomic_write_text


def cache_root() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE") or Path.home() / ".cache" / "batchgen")


@cache
def environment_key() -> str:
    """Versions of the libraries whose behaviour cached results depend on (read without importing them)."""
    versions = []
    for dist in ("transformers", "tokenizers", "torch"):
        try:
            versions.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist}=none")
    return ",".join(versions)


@cache
def source_key(module_file: str) -> str:
    """SHA-256 of a module's source (so editing the code computing a result invalidates it)."""
    return hashlib.sha256(Path(module_file).read_bytes()).hexdigest()


def make_key(*parts: Any) -> str:
    payload = json.dumps([environment_key(), *parts], sort_keys=True, default=repr)
    return hashlib.sha256(payload.encode()).hexdigest()


def read(kind: str, key: str) -> Any:
    """The entry's JSON value, or None when absent or unreadable."""
    try:
        return json.loads((cache_root() / kind / f"{key}.json").read_text())
    except (OSError, ValueError, RuntimeError):  # RuntimeError: Path.home() without a home directory
        return None


def write(kind: str, key: str, value: Any) -> None:
    """Store `value` (JSON-serialisable) as the entry (:func:`batchgen.runtime.atomic.atomic_write_text`); silently
    nothing on failure."""
    try:
        folder = cache_root() / kind
        text = json.dumps(value)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"{key}.json", text)
    except (OSError, TypeError, ValueError, RuntimeError):
        return
