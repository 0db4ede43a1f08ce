"""Streaming Parquet reader: deterministic file order, global row index, shards and windows.

Invariants:
- Files are sorted by path; the *global row index* of a row is its position in the concatenation of the files
  in that order (row counts come from the Parquet footers, no data is read to compute them).
- Shard ``i`` of ``n`` is the contiguous global row range ``[i*N//n, (i+1)*N//n)``: the shards of one input
  cover every row exactly once, whatever ``n``.
- Window ``w`` of a shard is rows ``[start + w*W, min(start + (w+1)*W, end))``, computed from ``w``
  (:class:`WindowPlan`: no list of windows exists, planning costs O(files) at any row count); windows depend
  only on the input, the shard and ``W`` (never on what was already processed), so a rerun sees the same
  windows. Footers are read once per file; files of one schema share one schema object.
- Memory is bounded by one window plus one decoded record batch: row groups are streamed one at a time
  with ``ParquetFile.iter_batches`` (which decodes page by page; the ``pyarrow.dataset`` scanner materialises
  a whole row group, measured 3x the memory), and row groups holding only finished windows are skipped.
- Never a row silently missing: rows of a row group that cannot be decoded (a corrupt page) come back as
  null rows listed in :attr:`Window.unreadable` with a message naming the file and the row group; the job
  turns them into error rows.
- Every file must hold the columns the job reads with compatible types (:meth:`InputSet.read_schema`,
  checked while planning, naming the files); windows come back in that unified schema.
"""

from __future__ import annotations

import bisect
import functools
import glob
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import ConfigError

READ_BATCH_ROWS = 4096
LISTED_VERSIONS = 1000
"""Most input files whose store versions the manifest lists one by one (beyond: one digest of them all)."""
logger = logging.getLogger("batchgen.job")


class InputError(ConfigError):
    """The input cannot be read as asked (missing files, missing columns); the CLI exits with status 2."""


@dataclass
class InputFile:
    """One Parquet file of the input, with the global row index of its first row."""

    path: str
    rel_path: str
    size: int
    num_rows: int
    row_start: int
    row_group_rows: list[int]
    schema: pa.Schema
    footer_sha256: str
    location: Any = None
    """The :class:`~batchgen.data.storage.Location` of a remote file (None: a local path)."""
    version: str | None = None
    """The store's version of a remote file (ETag, GCS generation): resume compares it with the manifest's."""


@dataclass
class InputSet:
    """The resolved input: files in deterministic order and their metadata."""

    spec: str
    files: list[InputFile]
    num_rows: int
    fingerprint: str
    columns: list[str] = field(default_factory=list)
    versions_sha256: str | None = None
    """One digest of every file's (path, size, store version) when every file has a version (else None)."""
    root: str = ""
    """The directory (or redacted object-store URL) the files' relative paths start from."""

    def describe(self) -> dict:
        """JSON-friendly summary stored in manifests and schema metadata: the versions of remote files (up to
        :data:`LISTED_VERSIONS` files; beyond, a digest of them, when every file has one)."""
        d = {
            "spec": self.spec,
            "num_files": len(self.files),
            "num_rows": self.num_rows,
            "fingerprint": self.fingerprint,
        }
        if any(f.version for f in self.files):
            if len(self.files) <= LISTED_VERSIONS:
                d["versions"] = {f.rel_path: [f.size, f.version] for f in self.files}
            elif self.versions_sha256 is not None:  # the manifest stays small: one digest of them all
                d["versions_sha256"] = self.versions_sha256
        return d

    def column_type(self, name: str) -> pa.DataType | None:
        """Type of column `name` in the first file that has it (None when absent everywhere)."""
        for f in self.files:
            i = f.schema.get_field_index(name)
            if i >= 0:
                return f.schema.field(i).type
        return None

    def has_column(self, name: str) -> bool:
        return bool(self.files) and all(f.schema.get_field_index(name) >= 0 for f in self.files)

    def read_schema(self, columns: list[str]) -> pa.Schema:
        """The schema windows are read in: each column's type unified over the files that have it
        (dictionaries decoded; int32 and int64 give int64, string and large_string large_string, null and T
        give T). Raises InputError naming two files whose types cannot be unified."""
        fields = []
        for name in columns:
            seen: list[tuple[pa.DataType, str]] = []
            for f in self.files:
                i = f.schema.get_field_index(name)
                if i >= 0:
                    seen.append((plain_type(f.schema.field(i).type), f.rel_path))
            if not seen:
                raise InputError(f"data.input: column {name!r} is in none of the files")
            unified = seen[0][0]
            for t, rel in seen[1:]:
                try:
                    unified = (
                        pa.unify_schemas(
                            [pa.schema([(name, unified)]), pa.schema([(name, t)])],
                            promote_options="permissive",
                        )
                        .field(0)
                        .type
                    )
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    first = next(r for u, r in seen if u != t)
                    other = next(u for u, r in seen if r == first)
                    raise InputError(
                        f"data.input: column {name!r} has incompatible types in the input files: {other} in "
                        f"{first!r}, {t} in {rel!r}; convert the files to one type (or run them as separate "
                        "inputs)"
                    ) from None
            fields.append(pa.field(name, unified))
        return pa.schema(fields)


def plain_type(t: pa.DataType) -> pa.DataType:
    """`t` with dictionary encoding removed (a dictionary<string> column reads as string)."""
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def resolve_files(spec: str) -> tuple[list[str], str]:
    """Expand a file, directory (recursive ``*.parquet``) or glob into sorted paths, plus their root.

    Raises InputError naming the spec when nothing matches.
    """
    spec = os.path.expanduser(str(spec))
    if os.path.isfile(spec):
        return [spec], os.path.dirname(os.path.abspath(spec))
    if os.path.isdir(spec):
        files = sorted(
            str(p)
            for p in Path(spec).rglob("*.parquet")
            if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(spec).parts)
        )
        if not files:
            raise InputError(f"data.input: directory {spec!r} contains no *.parquet files")
        return files, os.path.abspath(spec)
    if _is_glob(spec):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise InputError(f"data.input: no file matches the glob {spec!r}")
        root = os.path.abspath(os.path.dirname(spec.split("*")[0].split("?")[0].split("[")[0]) or ".")
        return files, root
    raise InputError(f"data.input: {spec!r} does not exist (expected a Parquet file, a directory or a glob)")


def read_footer(path: str, size: int) -> tuple[str, pq.FileMetaData]:
    """(sha256 of the Parquet footer, its metadata), from one read of the file's tail: the footer holds the
    schema, row groups and column statistics, so its hash changes when the content does."""
    with open(path, "rb") as f:
        if size < 12:
            raise InputError(f"data.input: {path!r} is not a Parquet file (too small)")
        f.seek(size - 8)
        tail = f.read(8)
        if tail[4:] != b"PAR1":
            raise InputError(f"data.input: {path!r} is not a Parquet file")
        footer_len = int.from_bytes(tail[:4], "little")
        if footer_len + 12 > size:
            raise InputError(f"data.input: {path!r} is not a Parquet file (its footer is cut off)")
        f.seek(size - 8 - footer_len)
        footer = f.read(footer_len)
    md = pq.read_metadata(pa.BufferReader(b"PAR1" + footer + tail))
    return hashlib.sha256(footer).hexdigest(), md


class SchemaPool:
    """One :class:`pyarrow.Schema` object per distinct schema: 100,000 files of one schema hold one."""

    def __init__(self) -> None:
        self._seen: dict[pa.Schema, pa.Schema] = {}

    def __call__(self, md: pq.FileMetaData) -> pa.Schema:
        schema = md.schema.to_arrow_schema()
        return self._seen.setdefault(schema, schema)


OUTPUT_MARKER = "_manifest.json"
"""The file that makes a directory a batchgen output (`batchgen.data.manifest`)."""


def without_outputs(paths: list[str], root: str, output: str | None) -> list[str]:
    """`paths` less the files of batchgen outputs nested in the input: those under `output` (the job's own
    output directory, which may not hold a manifest yet) and those under any directory below `root` holding
    a manifest. An input that *is* an output directory (`root` itself) is kept: it is what was asked for."""
    out = os.path.realpath(output) if output else None
    root_real = os.path.realpath(root)
    kept, marked = [], {}
    for p in paths:
        d = os.path.dirname(os.path.realpath(p))
        if out is not None and (d == out or d.startswith(out + os.sep)):
            continue
        inside = False
        while d.startswith(root_real + os.sep):
            if d not in marked:
                marked[d] = os.path.isfile(os.path.join(d, OUTPUT_MARKER))
            if marked[d]:
                inside = True
                break
            d = os.path.dirname(d)
        if not inside:
            kept.append(p)
    if len(kept) < len(paths):
        logger.info("data.input: skipping %d file(s) of batchgen output directories", len(paths) - len(kept))
    return kept


@functools.cache
def _first_conversion() -> None:
    """pyarrow imports pandas (where it is installed) on its first conversion of Python objects, 0.1-0.2 s: done
    when the input is opened, in the job's start-up (and the dry run's), not in the first window's commit."""
    pa.array([0])


def open_input(
    spec: str, output: str | None = None, storage_options: dict[str, Any] | None = None
) -> InputSet:
    """Resolve `spec` (a path, or a URL: :mod:`batchgen.data.remote_input`) and read every file's footer (row
    counts, row groups, schema); the files of batchgen outputs inside a local input (`output`, the job's own,
    and any other: :func:`without_outputs`) are not input.

    The fingerprint covers each file's path relative to the input root, size, row count and footer hash
    (not mtimes: copying the data elsewhere keeps resume working; rewriting it with other content does not).
    """
    from batchgen.data.storage import is_url

    _first_conversion()
    if is_url(spec):
        from batchgen.data.remote_input import open_remote_input

        return open_remote_input(str(spec), storage_options or {})
    paths, root = resolve_files(spec)
    paths = without_outputs(paths, root, output)
    if not paths:
        raise InputError(f"data.input: {spec!r} holds no input files outside batchgen output directories")
    files: list[InputFile] = []
    start = 0
    schemas = SchemaPool()
    for p in paths:
        try:
            size = os.path.getsize(p)
            footer, md = read_footer(p, size)
            schema = schemas(md)
        except InputError:
            raise
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"data.input: cannot read Parquet file {p!r}: {e}") from e
        rel = os.path.relpath(os.path.abspath(p), root)
        rg_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        files.append(InputFile(p, rel, size, md.num_rows, start, rg_rows, schema, footer))
        start += md.num_rows
    return input_set(os.path.abspath(os.path.expanduser(str(spec))), files, root)


def input_set(spec: str, files: list[InputFile], root: str = "") -> InputSet:
    """The input set of `files` (in order, row starts set): its fingerprint covers each file's path relative to
    the input root, size, row count and footer hash; its versions digest each file's path, size and store
    version (when all have one); its columns are every file's, in first-seen order. One pass, file by file."""
    h, v = hashlib.sha256(), hashlib.sha256()
    versioned = bool(files)
    columns: list[str] = []
    schemas: set[int] = set()
    for f in files:
        h.update(f"{f.rel_path}\0{f.size}\0{f.num_rows}\0{f.footer_sha256}\n".encode())
        versioned = versioned and bool(f.version)
        if versioned:
            v.update(f"{f.rel_path}\0{f.size}\0{f.version}\n".encode())
        if id(f.schema) not in schemas:  # files of one schema share one object (SchemaPool)
            schemas.add(id(f.schema))
            columns += [name for name in f.schema.names if name not in columns]
    return InputSet(
        spec,
        files,
        sum(f.num_rows for f in files),
        h.hexdigest(),
        columns,
        v.hexdigest() if versioned else None,
        root,
    )


def shard_range(num_rows: int, index: int, count: int) -> tuple[int, int]:
    """Global row range ``[start, end)`` of shard `index` of `count` (contiguous, balanced)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} outside [0, {count})")
    return index * num_rows // count, (index + 1) * num_rows // count


@dataclass(frozen=True)
class WindowSpec:
    """Window `index` of a shard: global rows ``[row_start, row_end)``."""

    index: int
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


class WindowPlan(Sequence[WindowSpec]):
    """The windows of a shard's row range ``[row_start, row_end)``, ``window_rows`` rows each (the last one may
    be shorter), computed arithmetically: window ``w`` is rows ``[row_start + w*W, min(row_start + (w+1)*W,
    row_end))``. Holds three integers whatever the number of windows; iterating yields them one at a time."""

    def __init__(self, row_start: int, row_end: int, window_rows: int) -> None:
        if window_rows < 1:
            raise ValueError("window_rows must be >= 1")
        self.row_start, self.row_end, self.window_rows = row_start, max(row_start, row_end), window_rows

    def __len__(self) -> int:
        return -(-(self.row_end - self.row_start) // self.window_rows)

    @overload
    def __getitem__(self, w: int) -> WindowSpec: ...
    @overload
    def __getitem__(self, w: slice) -> Sequence[WindowSpec]: ...
    def __getitem__(self, w: int | slice) -> WindowSpec | Sequence[WindowSpec]:
        if isinstance(w, slice):
            return [self[i] for i in range(*w.indices(len(self)))]
        n = len(self)
        if w < 0:
            w += n
        if not 0 <= w < n:
            raise IndexError(f"window {w} outside [0, {n})")
        s = self.row_start + w * self.window_rows
        return WindowSpec(w, s, min(s + self.window_rows, self.row_end))

    def __iter__(self) -> Iterator[WindowSpec]:
        for w in range(len(self)):
            yield self[w]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WindowPlan):
            return (self.row_start, self.row_end, self.window_rows) == (
                other.row_start, other.row_end, other.window_rows,
            )  # fmt: skip
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.row_start, self.row_end, self.window_rows))

    def __repr__(self) -> str:
        return f"WindowPlan(rows [{self.row_start}, {self.row_end}) in {len(self)} window(s) of {self.window_rows})"


def plan_windows(row_start: int, row_end: int, window_rows: int) -> WindowPlan:
    """Split a shard's row range into windows of `window_rows` rows (the last one may be shorter), lazily."""
    return WindowPlan(row_start, row_end, window_rows)


@dataclass
class Window:
    """A window's rows, read from the input: `table` has the requested columns, ``spec.num_rows`` rows.

    ``unreadable`` lists ``(start, end, message)`` ranges of window positions whose row group could not be
    decoded: those rows are null in `table`, and `message` names the file and the row group."""

    spec: WindowSpec
    table: pa.Table
    unreadable: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.spec.index


def _row_group_ranges(inp: InputSet, start: int = 0) -> Iterator[tuple[InputFile, int, int, int]]:
    """(file, row_group, global_start, global_end) in global order from the file holding row `start` on
    (found by bisection over the files' first rows), skipping empty row groups."""
    first = max(0, bisect.bisect_right(inp.files, start, key=lambda f: f.row_start) - 1)
    for f in inp.files[first:]:
        s = f.row_start
        for rg, n in enumerate(f.row_group_rows):
            if n:
                yield f, rg, s, s + n
            s += n


def _concat(tables: list[pa.Table], schema: pa.Schema | None) -> pa.Table:
    try:
        if schema is not None:
            tables = [t if t.schema.equals(schema) else t.select(schema.names).cast(schema) for t in tables]
        if len(tables) == 1:
            return tables[0]
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise InputError(f"data.input: files have incompatible column types: {e}") from e


def _short(e: BaseException) -> str:
    text = "".join(c if c.isprintable() else " " for c in str(e))
    text = " ".join(text.split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _safe_batches(
    f: InputFile,
    pf: pq.ParquetFile | BaseException,
    rg: int,
    g0: int,
    columns: list[str],
    schema: pa.Schema,
    batch_rows: int,
) -> Iterator[tuple[pa.RecordBatch, str | None]]:
    """The row group's batches, then — if decoding fails part-way — one batch of the rows left, with a message
    naming the file, the row group and the unreadable columns (so no row ever goes missing): the columns that
    can still be decoded on their own (an id column, say) are kept, the others are null
    (:func:`_salvage`)."""
    total = f.row_group_rows[rg]
    done = 0
    error: BaseException | None = pf if isinstance(pf, BaseException) else None
    if error is None:
        try:
            for batch in pf.iter_batches(  # type: ignore[union-attr]
                batch_size=batch_rows, row_groups=[rg], columns=columns, use_threads=False
            ):
                done += batch.num_rows
                yield batch, None
        except (OSError, pa.ArrowException) as e:
            error = e
    if error is not None and done < total:
        n = total - done
        batch, lost = _salvage(pf, rg, done, total, schema)
        which = f"column(s) {', '.join(repr(c) for c in lost)}: " if 0 < len(lost) < len(schema) else ""
        msg = (
            f"input unreadable: {f.rel_path!r} row group {rg} (input rows {g0 + done}..{g0 + total}): "
            f"{which}{_short(error)}"
        )
        logger.warning("%s; its %d row(s) become error rows", msg, n)
        yield batch, msg


def _salvage(
    pf: pq.ParquetFile | BaseException, rg: int, start: int, end: int, schema: pa.Schema
) -> tuple[pa.RecordBatch, list[str]]:
    """Rows ``[start, end)`` of row group `rg`, each column decoded on its own (null where it cannot be), and
    the names of the columns that could not."""
    arrays, lost = [], []
    for fld in schema:
        arr = None
        if not isinstance(pf, BaseException):
            try:
                col = pf.read_row_group(rg, columns=[fld.name], use_threads=False).column(0)
                arr = plain_column(col.slice(start, end - start)).cast(fld.type)
            except (OSError, pa.ArrowException):
                arr = None
        if arr is None:
            lost.append(fld.name)
            arr = pa.nulls(end - start, fld.type)
        arrays.append(arr)
    return pa.RecordBatch.from_arrays(arrays, schema=schema), lost


def plain_column(col: pa.ChunkedArray) -> pa.Array:
    """One array of `col`, dictionaries decoded."""
    arr = col.combine_chunks() if col.num_chunks else pa.array([], type=col.type)
    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


def _open(f: InputFile) -> pq.ParquetFile | BaseException:
    try:  # pages written with a CRC are checked: a flipped bit is an unreadable row group, not garbage
        if f.location is not None:  # byte ranges of the object, fetched as row groups are read
            return pq.ParquetFile(f.location.open_read(f.rel_path), page_checksum_verification=True)
        return pq.ParquetFile(f.path, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        return e


def _file_for(
    open_file: tuple[str, pq.ParquetFile | BaseException] | None, f: InputFile
) -> tuple[str, pq.ParquetFile | BaseException]:
    """``(path, opened file or the error opening it)``: `open_file` itself if it is `f`'s, else `f`
    opened anew (the previous file closed)."""
    if open_file is not None and open_file[0] == f.path:
        return open_file
    if open_file is not None and isinstance(open_file[1], pq.ParquetFile):
        open_file[1].close()
    return (f.path, _open(f))


def iter_windows(
    inp: InputSet,
    windows: Iterable[WindowSpec],
    columns: list[str],
    batch_rows: int = READ_BATCH_ROWS,
    schema: pa.Schema | None = None,
) -> Iterator[Window]:
    """Stream the given windows (ascending, non-overlapping; consumed lazily, nothing held per window) with
    only `columns`, one at a time. Only row groups that intersect a requested window are decoded, one row group at a time, in batches of at
    most `batch_rows` rows; rows outside the requested windows are dropped as they stream by. Windows come in
    `schema` (default: :meth:`InputSet.read_schema` of `columns`); rows that cannot be decoded are null and
    listed in :attr:`Window.unreadable`.
    """
    wins = _ascending(windows)
    cur = next(wins, None)
    if cur is None:
        return
    schema = schema if schema is not None else inp.read_schema(columns)
    have = 0  # rows of the current window collected so far
    pieces: list[pa.Table] = []
    unreadable: list[tuple[int, int, str]] = []
    open_file: tuple[str, pq.ParquetFile | BaseException] | None = None
    for f, rg, g0, g1 in _row_group_ranges(inp, cur.row_start):
        if g1 <= cur.row_start + have:
            continue  # entirely before the next row we need
        open_file = _file_for(open_file, f)
        pos = g0
        for batch, error in _safe_batches(f, open_file[1], rg, g0, columns, schema, batch_rows):
            b0, b1 = pos, pos + batch.num_rows
            pos = b1
            while cur is not None:
                need = cur.row_start + have  # next global row the current window needs
                if need >= b1:
                    break
                if need < b0:
                    raise AssertionError(f"reader skipped row {need}")  # invariant: rows are never skipped
                hi = min(b1, cur.row_end)
                pieces.append(pa.Table.from_batches([batch.slice(need - b0, hi - need)]))
                if error is not None:
                    unreadable.append((have, have + hi - need, error))
                have += hi - need
                if have < cur.num_rows:
                    break
                yield Window(cur, _concat(pieces, schema).combine_chunks(), unreadable)
                pieces, have, unreadable = [], 0, []
                cur = next(wins, None)
            if cur is None:
                return
            if cur.row_start >= g1:
                pos = g1  # the next window is in a later row group: the rest of this one is not decoded
                break
        if pos != g1:
            raise InputError(
                f"data.input: {f.path!r} row group {rg} has {pos - g0} rows, its footer says {g1 - g0}"
            )
    if cur is not None:
        raise InputError(
            f"data.input: expected rows {cur.row_start}..{cur.row_end} but the files ended early"
        )


def _ascending(windows: Iterable[WindowSpec]) -> Iterator[WindowSpec]:
    """The non-empty windows of `windows`, checked to be ascending and non-overlapping (consumed lazily)."""
    end = None
    for w in windows:
        if w.num_rows <= 0:
            continue
        if end is not None and w.row_start < end:
            raise ValueError(f"windows must be ascending and non-overlapping: {w} starts before row {end}")
        end = w.row_end
        yield w
