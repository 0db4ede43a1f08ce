"""Parquet input on an object store (``s3://``, ``gs://``, ``az://``, ``hf://``, any fsspec URL).

The same :class:`~batchgen.data.reader.InputSet` as a local input (same order, row index, fingerprint and
windows), built from listings and footers only:
- a URL names one object, a prefix (every ``*.parquet`` below it, names starting with ``_`` or ``.`` skipped,
  as locally) or a glob;
- a prefix on S3 is listed a page (:data:`LIST_PAGE` keys) at a time, in key order, and each object's footer
  read is started as its page arrives: 100,000 objects are never held as a listing before planning starts,
  and footers are read while later pages are still being listed (other stores: one ``find``, sorted);
- each file's footer is read with two range requests (the last 8 bytes, then the footer), :data:`FOOTER_READERS`
  files at a time, in a window of :data:`FOOTERS_AHEAD` objects; its rows are read
  later row group by row group as byte ranges (:func:`batchgen.data.reader.iter_windows`), never the whole
  object into memory;
- each file records the store's version (ETag, generation) and size, which resume compares with the manifest
  before re-reading anything (:func:`batchgen.job.input_versions.unchanged_since`); beyond
  :data:`~batchgen.data.reader.LISTED_VERSIONS` files, one digest of them all, computed file by file as they
  come (:func:`~batchgen.data.reader.input_set`).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.reader import InputError, InputFile, InputSet, SchemaPool, input_set
from batchgen.data.storage import Location, StorageError, object_version

FOOTER_READERS = 16
"""Footers read at once (two range requests each): planning 100,000 objects is bounded by the store's latency
divided by this, not by the number of objects times it."""
FOOTERS_AHEAD = 4 * FOOTER_READERS
"""Most objects listed whose footer is not yet taken into the plan (what the listing runs ahead by)."""
LIST_PAGE = 1000
"""Keys per listing request on S3 (the store's own most)."""

Entry = tuple[str, int, str | None]
"""(path in the filesystem, size, version) of one listed object."""
T = TypeVar("T")
R = TypeVar("R")


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _list_page(fs: Any, **kwargs: Any) -> dict[str, Any]:
    """One ``ListObjectsV2`` page of an S3 filesystem (s3fs)."""
    return fs.call_s3("list_objects_v2", **kwargs)


def _s3_listing(fs: Any, path: str) -> Iterator[Entry]:
    """Every object below prefix `path` of S3 filesystem `fs`, in key order, a page at a time (ValueError if
    the store answers out of order)."""
    bucket, key, _ = fs.split_path(path)
    kwargs: dict[str, Any] = {
        "Bucket": bucket,
        "Prefix": key.rstrip("/") + "/" if key else "",
        "MaxKeys": LIST_PAGE,
    }
    last = ""
    while True:
        page = _list_page(fs, **kwargs)
        for c in page.get("Contents", []):
            if c["Key"] <= last:
                raise ValueError(f"the store listed {c['Key']!r} after {last!r}")
            last = c["Key"]
            yield f"{bucket}/{c['Key']}", int(c.get("Size") or 0), object_version(c)
        if not page.get("IsTruncated"):
            return
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


def _listing(fs: Any, path: str) -> Iterator[Entry]:
    """Every object below `path`, sorted by name: streamed page by page on S3, else one ``find``."""
    if hasattr(fs, "call_s3"):
        return _s3_listing(fs, path)
    found = fs.find(path, detail=True)
    return iter(
        sorted(
            (k, int(v.get("size") or 0), object_version(v))
            for k, v in found.items()
            if v.get("type") != "directory"
        )
    )


def _resolve(loc: Location) -> tuple[Location, Iterator[Entry]]:
    """(location of the input root, the objects of the input in sorted order, streamed: (path, size,
    version)). A prefix holding no ``*.parquet`` is an InputError when the stream ends."""
    fs, path = loc.fs, loc.root
    try:
        if _is_glob(path):
            base = path.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0]
            hits = fs.glob(path, detail=True)
            entries = sorted(
                (k, int(v.get("size") or 0), object_version(v))
                for k, v in hits.items()
                if v.get("type") != "directory"
            )
            if not entries:
                raise InputError(f"data.input: no object matches the glob {loc.url!r}")
            stream: Iterator[Entry] = iter(entries)
        else:
            info = _info(fs, path)
            if info is not None and info.get("type") != "directory":
                base = path.rsplit("/", 1)[0]
                stream = iter([(path, int(info.get("size") or 0), object_version(info))])
            else:
                base = path
                stream = _parquet_below(loc, path, _listing(fs, path), exists=info is not None)
    except (InputError, StorageError):
        raise
    except Exception as e:  # noqa: BLE001 - any store error is one line
        raise loc._error(e, "read") from e
    root = loc.child("")
    root.root = base.rstrip("/")
    root.raw_url = loc.raw_url[: loc.raw_url.index("://") + 3] + root.root
    root.url = loc.url[: loc.url.index("://") + 3] + root.root
    return root, stream


def _parquet_below(loc: Location, path: str, listing: Iterator[Entry], exists: bool) -> Iterator[Entry]:
    """The ``*.parquet`` objects of `listing` (no name part starting with ``_`` or ``.``); InputError at the
    end when there are none; a store error is one line."""
    seen = kept = 0
    try:
        for k, size, version in listing:
            seen += 1
            rel = k[len(path) :].strip("/")
            if k.endswith(".parquet") and not any(p.startswith((".", "_")) for p in rel.split("/")):
                kept += 1
                yield k, size, version
    except (InputError, StorageError):
        raise
    except Exception as e:  # noqa: BLE001
        raise loc._error(e, "read") from e
    if not kept:
        if not exists and not seen:
            loc.check_bucket("read")
            raise InputError(
                f"data.input: {loc.url!r} does not exist (expected a Parquet object, a prefix or a glob)"
            )
        raise InputError(f"data.input: {loc.url!r} contains no *.parquet objects")


def _in_order(
    pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], ahead: int
) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` in the order of `items`, `fn` run in `pool` on up to `ahead` items beyond the one
    yielded (items are pulled only that far ahead); an error is raised at its item's turn."""
    pending: deque[tuple[T, Future[R]]] = deque()
    try:
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) > ahead:
                first, fut = pending.popleft()
                yield first, fut.result()
        while pending:
            first, fut = pending.popleft()
            yield first, fut.result()
    finally:
        for _, fut in pending:
            fut.cancel()


def _info(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        return fs.info(path)
    except FileNotFoundError:
        return None


def _footer(loc: Location, name: str, size: int) -> tuple[str, pq.FileMetaData]:
    """(sha256 of the footer, its metadata) read with range requests; InputError when it is not Parquet."""
    url = loc.url_of(name)
    if size < 12:
        raise InputError(f"data.input: {url!r} is not a Parquet file (too small: {size} bytes)")
    try:
        tail = loc.fs.cat_file(loc.path(name), start=size - 8, end=size)
        if tail[4:] != b"PAR1":
            raise InputError(f"data.input: {url!r} is not a Parquet file (truncated, or another format)")
        n = int.from_bytes(tail[:4], "little")
        if n + 8 > size:
            raise InputError(f"data.input: {url!r} is not a Parquet file (its footer is cut off)")
        footer = loc.fs.cat_file(loc.path(name), start=size - 8 - n, end=size)
        md = pq.read_metadata(pa.BufferReader(b"PAR1" + footer))
    except InputError:
        raise
    except (OSError, pa.ArrowException) as e:
        if isinstance(e, FileNotFoundError):
            raise InputError(f"data.input: {url!r} disappeared while being listed") from e
        raise InputError(
            f"data.input: cannot read Parquet file {url!r}: {' '.join(str(e).split())[:200]}"
        ) from e
    except Exception as e:  # noqa: BLE001
        raise loc._error(e, "read", name) from e
    return hashlib.sha256(footer[:-8]).hexdigest(), md


def open_remote_input(spec: str, storage_options: dict[str, Any]) -> InputSet:
    """The input set of URL `spec` (see the module docstring); InputError/StorageError in one line."""
    loc = Location(spec, storage_options, key="data.input")
    root, entries = _resolve(loc)
    base = len(root.root)
    files: list[InputFile] = []
    start = 0
    schemas = SchemaPool()
    with ThreadPoolExecutor(max_workers=FOOTER_READERS) as pool:
        footers = _in_order(
            pool, lambda e: _footer(root, e[0][base:].lstrip("/"), e[1]), entries, FOOTERS_AHEAD
        )
        for (path, size, version), (footer, md) in footers:
            rel = path[base:].lstrip("/")
            schema = schemas(md)
            rg_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            f = InputFile(
                root.url_of(rel), rel, size, md.num_rows, start, rg_rows, schema, footer, root, version
            )
            files.append(f)
            start += md.num_rows
    return input_set(loc.url, files, root.url)
