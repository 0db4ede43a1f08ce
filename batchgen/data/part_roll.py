"""Output parts sized for data lakes: consecutive committed windows rolled up into one Parquet part.

The window stays the unit of scheduling, commit and resume: the commit layer (:class:`~batchgen.data.output_dir.
OutputDir`) makes each finished window durable as a *piece* (``_windows/part-{window:06d}.arrow``, which dataset
readers never see) named by its ``window`` commit record. :class:`PartRoller` turns the pieces of consecutive
committed windows into one part, ``part-{k:06d}.parquet``, once they reach ``data.part_size`` bytes (or
``data.part_rows`` output rows), and the last part when every window is committed; the part is committed through
the same commit log (:meth:`OutputDir.commit_part`: the part written whole, then one ``part`` record naming it,
its size, sha256 and the windows it holds); only then are the covered pieces garbage, deleted by the holder.

Invariants:
- Parts are contiguous from window 0 (``Manifest.parts``): part ``k + 1`` starts at the window after the last
  of part ``k``; a part holds only committed windows, their rows in input order. Part names sort in input order.
- At every instant, a kill -9 included, each committed row is in exactly one file the state names (a piece or
  a part): before the ``part`` record the pieces are named (a part file written but not recorded is garbage
  the next holder deletes), after it the part. A reader of the dataset sees complete parts only (a part is
  written whole: an atomic rename, or one PUT).
- A window committed again after its part was rolled (a retry of its error rows) names its new piece; the part
  is rewritten with the piece's rows and committed again (:meth:`PartRoller.finish`).
- Cost: a commit costs nothing more; a roll reads its pieces once. Memory: one piece plus one row group
  (at most :data:`ROW_GROUP_ROWS` rows and about :data:`ROW_GROUP_BYTES` of Arrow data), whatever the part's
  size; a rewrite streams the old part row group by row group.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.layout import METADATA_KEY, WINDOWS_DIR, part_name, rolled_part_name
from batchgen.data.manifest import PartRecord

logger = logging.getLogger(__name__)

DEFAULT_PART_SIZE = 256 << 20
ROW_GROUP_ROWS = 1 << 17
"""Most rows per row group of a part."""
ROW_GROUP_BYTES = 32 << 20
"""Pieces are buffered into one row group until they hold this much Arrow data (or :data:`ROW_GROUP_ROWS`
rows): the bound on what a roll holds beyond one piece."""
_WINDOW_KEY = b"batchgen.window"  # score and pooling pieces' metadata


class PartRoller:
    """Rolls the committed windows of ``outdir`` (opened: its ``manifest`` is the state) into parts of
    ``part_size`` bytes or ``part_rows`` output rows (``part_rows`` wins when set)."""

    def __init__(self, outdir: Any, part_size: int = DEFAULT_PART_SIZE, part_rows: int | None = None) -> None:
        self.outdir = outdir
        self.part_size, self.part_rows = part_size, part_rows
        self._next = 0  # the first window not yet counted into the part being filled
        self._bytes = 0  # size of the pieces of windows frontier .. _next - 1
        self._rows = 0

    @property
    def _manifest(self) -> Any:
        assert self.outdir.manifest is not None, "open the output directory first"
        return self.outdir.manifest

    @property
    def parts(self) -> list[PartRecord]:
        return self._manifest.parts

    @property
    def frontier(self) -> int:
        """The first window no part holds."""
        return self.parts[-1].last + 1 if self.parts else 0

    def _read(self, name: str) -> pa.Table:
        return self.outdir.read_piece(name)

    # ------------------------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """After the output directory is opened (garbage of a killed roll removed, parts verified): roll what
        is ready, and finish a job whose every window was committed."""
        self._next, self._bytes, self._rows = self.frontier, 0, 0
        if self._manifest.complete:
            self.finish()  # killed during the last roll
        else:
            self.roll_ready()

    def roll_ready(self) -> int:
        """Roll every part whose windows are committed and reach the size; returns how many parts."""
        windows = self._manifest.windows
        rolled = 0
        self._next = max(self._next, self.frontier)
        while self._next in windows:
            rec = windows[self._next]
            self._rows += rec.num_output_rows
            self._bytes += 0 if self.part_rows else self.outdir.piece_size(self._next)
            self._next += 1
            full = self._rows >= self.part_rows if self.part_rows else self._bytes >= self.part_size
            if full:
                self._roll(self.frontier, self._next - 1)
                rolled += 1
        return rolled

    def finish(self) -> None:
        """At the end of a job whose every window is committed: roll the last part, and rewrite the parts
        holding windows committed again since they were rolled (retried error rows)."""
        self.roll_ready()
        if self._manifest.complete and self._next > self.frontier:
            self._roll(self.frontier, self._next - 1)
        windows = self._manifest.windows
        for part in list(self.parts):
            newer = {w for w in range(part.first, part.last + 1) if windows[w].part != part.name}
            if newer:
                self._reroll(part, newer)

    # ------------------------------------------------------------------------------------ rolling
    def _roll(self, first: int, last: int) -> None:
        part = PartRecord(rolled_part_name(len(self.parts)), first, last)
        self._commit(part, lambda: (self._read(part_name(w)) for w in range(first, last + 1)))
        self._bytes = self._rows = 0
        logger.info("part %s: windows %d..%d", part.name, first, last)

    def _reroll(self, part: PartRecord, newer: set[int]) -> None:
        """Rewrite `part` with the rows of the pieces of `newer` (its windows committed again) and commit it
        again: the pieces become garbage."""
        windows = self._manifest.windows

        def tables() -> Iterator[pa.Table]:
            old = _window_slices(self.outdir.loc.open_read(part.name))
            next(old)
            for w in range(part.first, part.last + 1):
                kept = old.send(windows[w].num_output_rows)  # the old rows are read past either way
                yield self._read(windows[w].part) if w in newer else kept
            old.close()

        self._commit(PartRecord(part.name, part.first, part.last), tables)
        logger.info("part %s rewritten with %d window(s) committed again", part.name, len(newer))

    def window_table(self, window: int) -> pa.Table:
        """The committed rows of `window` as its piece (a part table of the window, with its metadata): its
        piece, or its slice of the part holding it."""
        windows = self._manifest.windows
        rec = windows[window]
        if rec.part.startswith(f"{WINDOWS_DIR}/"):
            return self._read(rec.part)
        part = next(p for p in self.parts if p.first <= window <= p.last)
        offset = sum(windows[w].num_output_rows for w in range(part.first, window))
        rows = _window_slices(self.outdir.loc.open_read(part.name))  # streamed: never the whole part
        next(rows)
        rows.send(offset)
        table = rows.send(rec.num_output_rows)
        rows.close()
        meta = _metadata(table.schema.metadata, None)
        doc = json.loads(meta.get(METADATA_KEY, b"{}"))
        doc["window"] = {"index": window, "row_start": rec.row_start, "row_end": rec.row_end}
        if rec.retry_rows:
            doc["window"]["retry_rows"] = list(rec.retry_rows)
        meta[METADATA_KEY] = json.dumps(doc, sort_keys=True).encode()
        return table.replace_schema_metadata(meta)

    def _commit(self, part: PartRecord, tables: Callable[[], Iterator[pa.Table]]) -> None:
        """Write `part` streamed from ``tables()`` (its windows' tables in order; called again when the write
        starts over) and commit it."""
        self.outdir.commit_part(part, lambda sink: self._write(part, tables(), sink))

    def _write(self, part: PartRecord, tables: Iterator[pa.Table], sink: Any) -> None:
        """Write the Parquet file of `part` from `tables` into the binary file `sink`, a row group at a time
        (pieces buffered up to :data:`ROW_GROUP_ROWS` rows or :data:`ROW_GROUP_BYTES` bytes)."""
        windows = self._manifest.windows
        index = int(part.name.split("-")[1].split(".")[0])
        info = {"index": index, "windows": [part.first, part.last]}
        info.update(row_start=windows[part.first].row_start, row_end=windows[part.last].row_end)
        writer: pq.ParquetWriter | None = None
        held: list[pa.Table] = []
        rows = size = 0
        try:
            for t in tables:
                if writer is None:
                    schema = _part_schema(t.schema, info)
                    writer = pq.ParquetWriter(sink, schema, compression="zstd")
                held.append(_conform(t, schema))
                rows, size = rows + t.num_rows, size + t.nbytes
                if rows >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
                    writer.write_table(pa.concat_tables(held), row_group_size=ROW_GROUP_ROWS)
                    held, rows, size = [], 0, 0
            if writer is not None and held:
                writer.write_table(pa.concat_tables(held), row_group_size=ROW_GROUP_ROWS)
        finally:
            if writer is not None:
                writer.close()


def _window_slices(f: Any) -> Generator[pa.Table | None, int, None]:
    """A generator over the rows of the Parquet file `f`, streamed row group by row group: each ``send(n)``
    answers the next `n` rows as a table (with the file's schema). Closes `f` at the end."""
    try:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow
        batches = (  # a row group at a time: a batch never spans several
            b for rg in range(pf.num_row_groups) for b in pf.iter_batches(8192, row_groups=[rg])
        )
        left: list[pa.RecordBatch] = []
        n = yield None
        while True:
            have = sum(b.num_rows for b in left)
            while have < n:
                b = next(batches)
                left.append(b)
                have += b.num_rows
            t = pa.Table.from_batches(left, schema=schema)
            out, rest = t.slice(0, n), t.slice(n)
            left = rest.to_batches()
            n = yield out
    finally:
        f.close()


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
