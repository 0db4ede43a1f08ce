"""The shards of a job's output: where they are, which parts count, whether they belong together.

``data.output`` holds either one shard's output (``data.shard.count == 1``: its manifest at the top) or the
``shard-IIIII-of-NNNNN/`` directories of a sharded job (:mod:`batchgen.data.layout`). Only the parts a shard's
state lists count (``Manifest.parts``, :mod:`batchgen.data.part_roll`): any other is an unfinished leftover.

Invariant: :func:`find_shards` returns the shards sorted by index, or raises :class:`MergeError` when there are
none, when one has no readable manifest, or when they were written with different configurations, inputs or
shard counts, or a shard index appears twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from batchgen.data.layout import MANIFEST_NAME, SHARD_RE
from batchgen.data.manifest import Manifest


class MergeError(Exception):
    """The output or the input cannot be read as a batchgen job output (exit status 2)."""


@dataclass
class PartRef:
    """A part of a shard: its file, its first window and its global row range."""

    shard: int
    window: int
    path: Path
    row_start: int
    row_end: int


@dataclass
class Shard:
    """One shard's output directory and its manifest."""

    path: Path
    index: int
    count: int
    manifest: Manifest

    @property
    def parts(self) -> list[PartRef]:
        """The shard's parts (:mod:`batchgen.data.part_roll`) in input order; ``window``: a part's first."""
        windows = self.manifest.windows
        return [
            PartRef(
                self.index, p.first, self.path / p.name, windows[p.first].row_start, windows[p.last].row_end
            )
            for p in self.manifest.parts
        ]


def _shard_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        raise MergeError(f"{str(root)!r} is not a directory")
    dirs = [root] if Manifest.path_in(root) is not None else []
    dirs += sorted(p for p in root.iterdir() if p.is_dir() and SHARD_RE.match(p.name))
    if not dirs:
        raise MergeError(
            f"{str(root)!r} holds no batchgen output (no {MANIFEST_NAME} and no shard-IIIII-of-NNNNN/ directory)"
        )
    return dirs


def _load_shard(d: Path) -> Shard:
    try:
        m = Manifest.load(d)
    except (ValueError, KeyError, TypeError) as e:
        raise MergeError(f"{str(d / MANIFEST_NAME)!r} is unreadable: {e}") from e
    if m is None:
        raise MergeError(f"{str(d)!r} has no {MANIFEST_NAME} (the shard never started writing)")
    return Shard(d, int(m.shard.get("index", 0)), int(m.shard.get("count", 1)), m)


def _check_same_job(root: Path, shards: list[Shard]) -> None:
    """MergeError unless every shard has the first one's layout, configuration and input, and no index repeats."""
    first = shards[0]
    for s in shards[1:]:
        m = s.manifest
        if s.count != first.count:
            raise MergeError(
                f"{str(root)!r} mixes shard layouts ({first.count} and {s.count} shards); "
                "merge the output of one job only"
            )
        if m.fingerprint != first.manifest.fingerprint or m.window_rows != first.manifest.window_rows:
            raise MergeError(
                f"{str(s.path)!r} was written with another configuration than {str(first.path)!r}"
            )
        if m.input.get("fingerprint") != first.manifest.input.get("fingerprint"):
            raise MergeError(f"{str(s.path)!r} was written from other input data than {str(first.path)!r}")
    seen: dict[int, Path] = {}
    for s in shards:
        if s.index in seen:
            raise MergeError(f"shard {s.index} appears twice: {str(seen[s.index])!r} and {str(s.path)!r}")
        seen[s.index] = s.path


def find_shards(output: str | os.PathLike) -> list[Shard]:
    """The shards under `output`, sorted by index. Raises MergeError when there are none or they mix."""
    root = Path(output)
    shards = [_load_shard(d) for d in _shard_dirs(root)]
    _check_same_job(root, shards)
    return sorted(shards, key=lambda s: s.index)
