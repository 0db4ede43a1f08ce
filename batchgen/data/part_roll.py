"""Output parts sized for data lakes: consecutive committed windows rolled up into one Parquet part.

The window stays the unit of scheduling, commit and resume: the commit layer (:class:`~batchgen.data.output_dir.
OutputDir`) makes each finished window durable as a *piece* (``_windows/part-{window:06d}.arrow``, which dataset
readers never see) and records it. :class:`PartRoller` turns the pieces of consecutive committed windows into one
part, ``part-{k:06d}.parquet``, once they reach ``data.part_size`` bytes (or ``data.part_rows`` output rows), and
the last part when every window is committed; it records the part's windows in ``_parts.json``, then deletes the
pieces.

Invariants:
- Parts are contiguous from window 0: part ``k + 1`` starts at the window after the last of part ``k``; a part
  holds only windows the commit record lists, their rows in input order. Part names sort in input order.
- A roll writes the part whole (an atomic rename, or one PUT), then ``_parts.json`` (the same way), then deletes
  the pieces. On open, a part that ``_parts.json`` does not list is removed (its pieces are all still there);
  a piece of a window a listed part holds is either a leftover of that roll (the same rows) or a newer commit
  of the window (a retry of its error rows): the part is rewritten with the piece's rows, then the piece is
  deleted. So at every instant, a kill -9 included, each committed row is in exactly one part or piece, and a
  reader of the dataset sees complete parts only.
- Cost: a commit costs one stat of its piece; a roll reads its pieces once. Memory: one row group
  (:data:`ROW_GROUP_ROWS` rows) on local disks, one part on object stores (a single PUT); between rolls,
  O(1) plus the ``_parts.json`` list (a pair of integers per part).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.atomic import atomic_write, atomic_write_bytes
from batchgen.data.layout import (
    METADATA_KEY,
    PART_RE,
    PARTS_NAME,
    PIECE_RE,
    WINDOWS_DIR,
    part_name,
    rolled_part_name,
)

logger = logging.getLogger(__name__)

DEFAULT_PART_SIZE = 256 << 20
ROW_GROUP_ROWS = 1 << 17
"""Rows per row group of a part (fewer when a part is smaller)."""
FORMAT = "batchgen-parts/1"
_WINDOW_KEY = b"batchgen.window"  # score and pooling pieces' metadata


@dataclass(frozen=True)
class RolledPart:
    """Part ``index`` of the output: windows ``first`` to ``last`` (both included)."""

    index: int
    first: int
    last: int

    @property
    def name(self) -> str:
        return rolled_part_name(self.index)


def parts_json(parts: list[RolledPart]) -> bytes:
    """The text of ``_parts.json`` listing `parts`."""
    return (json.dumps({"format": FORMAT, "parts": [[p.first, p.last] for p in parts]}) + "\n").encode()


def committed_parts(raw: bytes | None, windows: Mapping[int, Any]) -> list[RolledPart]:
    """The parts ``_parts.json`` (`raw`, None when absent) lists that form the chain from window 0 with every
    window in `windows` (the commit record's finished windows); the chain ends at the first that does not."""
    if raw is None:
        return []
    try:
        doc = json.loads(raw)
        ranges = doc["parts"] if doc.get("format") == FORMAT else []
    except (ValueError, KeyError, TypeError, AttributeError):
        logger.warning("%s is unreadable: its parts are rolled again", PARTS_NAME)
        return []
    chain: list[RolledPart] = []
    for first, last in ranges:
        want = chain[-1].last + 1 if chain else 0
        if first != want or last < first or not all(w in windows for w in range(first, last + 1)):
            break
        chain.append(RolledPart(len(chain), int(first), int(last)))
    return chain


def local_parts(directory: str | os.PathLike, windows: Mapping[int, Any]) -> list[RolledPart]:
    """:func:`committed_parts` of a local output directory."""
    p = Path(directory) / PARTS_NAME
    return committed_parts(p.read_bytes() if p.is_file() else None, windows)


def _piece_index(name: str) -> int | None:
    m = PIECE_RE.match(name)
    return int(m.group(1)) if m else None


class PartRoller:
    """Rolls the committed windows of ``outdir`` (opened: its ``manifest`` is the commit record) into parts of
    ``part_size`` bytes or ``part_rows`` output rows (``part_rows`` wins when set)."""

    def __init__(self, outdir: Any, part_size: int = DEFAULT_PART_SIZE, part_rows: int | None = None) -> None:
        self.outdir = outdir
        self.part_size, self.part_rows = part_size, part_rows
        self.parts: list[RolledPart] = []
        self._next = 0  # the first window not yet counted into the part being filled
        self._bytes = 0  # size of the pieces of windows frontier .. _next - 1
        self._rows = 0

    # ------------------------------------------------------------------------------------ storage
    @property
    def _remote(self) -> bool:
        return getattr(self.outdir, "loc", None) is not None

    def _names(self, sub: str = "") -> list[str]:
        return list(self.outdir._files(sub))

    def _get(self, name: str) -> bytes | None:
        if self._remote:
            return self.outdir.loc.read_bytes(name)
        p = Path(self.outdir.path) / name
        return p.read_bytes() if p.is_file() else None

    def _put(self, name: str, data: bytes) -> None:
        if self._remote:
            self.outdir.lease.check()
            self.outdir.loc.put(name, data)
        else:
            atomic_write_bytes(Path(self.outdir.path) / name, data)

    def _piece_size(self, window: int) -> int:
        name = part_name(window)
        if self._remote:
            info = self.outdir.loc.info(name)
            return info.size if info is not None else 0
        try:
            return os.stat(Path(self.outdir.path) / name).st_size
        except FileNotFoundError:
            return 0

    def _read(self, name: str) -> pa.Table:
        return self.outdir._read_table(name)

    @property
    def _manifest(self) -> Any:
        assert self.outdir.manifest is not None, "open the output directory first"
        return self.outdir.manifest

    @property
    def frontier(self) -> int:
        """The first window no part holds."""
        return self.parts[-1].last + 1 if self.parts else 0

    # ------------------------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """After the output directory is opened: read which parts there are, remove what a killed run left (a
        part not recorded, pieces of windows not committed), rewrite the parts a piece still covers, and roll
        what is ready."""
        self.parts = committed_parts(self._get(PARTS_NAME), self._manifest.windows)
        for name in self._names():
            m = PART_RE.match(name)
            if m and int(m.group(1)) >= len(self.parts):
                logger.info("removing %s: a part not recorded (its windows are rolled again)", name)
                self.outdir._delete(name)
        self._reconcile()
        self._next, self._bytes, self._rows = self.frontier, 0, 0
        if self._manifest.complete:
            self.finish()  # killed during the last roll
        else:
            self.roll_ready()

    def _reconcile(self) -> None:
        """Delete pieces of uncommitted windows; rewrite each part a piece still covers (then delete it)."""
        windows = self._manifest.windows
        covered: dict[int, list[int]] = {}
        frontier = self.frontier
        for name in self._names(WINDOWS_DIR):
            w = _piece_index(name)
            if w is None:
                continue  # temp files: the output directory's to remove
            if w not in windows:
                self.outdir._delete(part_name(w))
            elif w < frontier:
                k = self._part_of(w)
                covered.setdefault(k, []).append(w)
        for k, ws in sorted(covered.items()):
            self._reroll(self.parts[k], set(ws))

    def _part_of(self, window: int) -> int:
        lo, hi = 0, len(self.parts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.parts[mid].last < window:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def roll_ready(self) -> int:
        """Roll every part whose windows are committed and reach the size; returns how many parts."""
        windows = self._manifest.windows
        rolled = 0
        while self._next in windows:
            rec = windows[self._next]
            self._rows += rec.num_output_rows
            self._bytes += 0 if self.part_rows else self._piece_size(self._next)
            self._next += 1
            full = self._rows >= self.part_rows if self.part_rows else self._bytes >= self.part_size
            if full:
                self._roll(self.frontier, self._next - 1)
                rolled += 1
        return rolled

    def finish(self) -> None:
        """At the end of a job whose every window is committed: roll the last part, and rewrite the parts
        holding windows committed again in this run (retried error rows)."""
        self.roll_ready()
        if self._manifest.complete and self._next > self.frontier:
            self._roll(self.frontier, self._next - 1)
        self._reconcile()
        if not self._remote and self._manifest.complete:
            with contextlib.suppress(OSError):
                (Path(self.outdir.path) / WINDOWS_DIR).rmdir()  # only when empty

    # ------------------------------------------------------------------------------------ rolling
    def _roll(self, first: int, last: int) -> None:
        part = RolledPart(len(self.parts), first, last)
        self._write(part, self._pieces(first, last))
        self._put(PARTS_NAME, parts_json([*self.parts, part]))
        self.parts.append(part)
        for w in range(first, last + 1):
            self.outdir._delete(part_name(w))
        self._bytes = self._rows = 0
        logger.info("part %s: windows %d..%d", part.name, first, last)

    def _pieces(self, first: int, last: int) -> Iterator[pa.Table]:
        for w in range(first, last + 1):
            yield self._read(part_name(w))

    def _reroll(self, part: RolledPart, newer: set[int]) -> None:
        """Rewrite `part` with the rows of the pieces of `newer` (its windows), then delete those pieces."""
        old = self._read(part.name)
        windows = self._manifest.windows

        def tables() -> Iterator[pa.Table]:
            offset = 0
            for w in range(part.first, part.last + 1):
                n = windows[w].num_output_rows
                yield self._read(part_name(w)) if w in newer else old.slice(offset, n)
                offset += n

        self._write(part, tables())
        for w in sorted(newer):
            self.outdir._delete(part_name(w))
        logger.info("part %s rewritten with %d window(s) committed again", part.name, len(newer))

    def window_table(self, window: int) -> pa.Table:
        """The committed rows of `window` as its piece (a part table of the window, with its metadata); a
        window a part already holds is sliced from it and its piece written back first, so that committing the
        window again (a retry) replaces a piece, as the commit layer expects."""
        if window >= self.frontier:
            return self._read(part_name(window))
        part = self.parts[self._part_of(window)]
        windows = self._manifest.windows
        offset = sum(windows[w].num_output_rows for w in range(part.first, window))
        rec = windows[window]
        table = self._read(part.name).slice(offset, rec.num_output_rows)
        meta = _metadata(table.schema.metadata, None)
        doc = json.loads(meta.get(METADATA_KEY, b"{}"))
        doc["window"] = {"index": window, "row_start": rec.row_start, "row_end": rec.row_end}
        if rec.retry_rows:
            doc["window"]["retry_rows"] = list(rec.retry_rows)
        meta[METADATA_KEY] = json.dumps(doc, sort_keys=True).encode()
        table = table.replace_schema_metadata(meta)
        self.outdir._write_table(part_name(window), table)
        return table

    def _write(self, part: RolledPart, tables: Iterator[pa.Table]) -> None:
        """Write `part` from `tables` (in order) atomically; row groups of :data:`ROW_GROUP_ROWS` rows."""
        windows = self._manifest.windows
        info = {"index": part.index, "windows": [part.first, part.last]}
        info.update(row_start=windows[part.first].row_start, row_end=windows[part.last].row_end)
        if self._remote:
            parts = list(tables)
            schema = _part_schema(parts[0].schema, info)
            table = pa.concat_tables([_conform(t, schema) for t in parts]).replace_schema_metadata(
                schema.metadata
            )
            self.outdir._write_table(part.name, table)
            return
        target = Path(self.outdir.path) / part.name
        with atomic_write(target) as tmp:
            writer: pq.ParquetWriter | None = None
            held: list[pa.Table] = []
            rows = 0
            try:
                for t in tables:
                    if writer is None:
                        schema = _part_schema(t.schema, info)
                        writer = pq.ParquetWriter(str(tmp), schema, compression="zstd")
                    held.append(_conform(t, schema))
                    rows += t.num_rows
                    if rows >= ROW_GROUP_ROWS:
                        writer.write_table(pa.concat_tables(held), row_group_size=ROW_GROUP_ROWS)
                        held, rows = [], 0
                if writer is not None and held:
                    writer.write_table(pa.concat_tables(held), row_group_size=ROW_GROUP_ROWS)
            finally:
                if writer is not None:
                    writer.close()


def _metadata(meta: dict[bytes, bytes] | None, part: dict[str, Any] | None) -> dict[bytes, bytes]:
    """A piece's schema metadata made a part's (``part`` set) or a window's (``part`` None): the window's own
    record goes, the part's comes."""
    out = dict(meta or {})
    out.pop(_WINDOW_KEY, None)
    out.pop(b"batchgen.part", None)
    if METADATA_KEY in out:
        doc = json.loads(out[METADATA_KEY])
        doc.pop("window", None)
        doc.pop("part", None)
        if part is not None:
            doc["part"] = part
        out[METADATA_KEY] = json.dumps(doc, sort_keys=True).encode()
    elif part is not None:
        out[b"batchgen.part"] = json.dumps(part, sort_keys=True).encode()
    return out


def _part_schema(schema: pa.Schema, part: dict[str, Any]) -> pa.Schema:
    return schema.with_metadata(_metadata(schema.metadata, part))


def _conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """`t` in `schema` (the first piece's types; every piece of a job has them), its metadata replaced."""
    t = t.replace_schema_metadata(schema.metadata)
    return t if t.schema.equals(schema) else t.select(schema.names).cast(schema)
