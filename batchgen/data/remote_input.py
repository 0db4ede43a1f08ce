"""Parquet input on an object store (``s3://``, ``gs://``, ``az://``, ``hf://``, any fsspec URL).

The same :class:`~batchgen.data.reader.InputSet` as a local input (same order, row index, fingerprint and
windows), built from listings and footers only:
- a URL names one object, a prefix (every ``*.parquet`` below it, names starting with ``_`` or ``.`` skipped,
  as locally) or a glob;
- each file's footer is read with two range requests (the last 8 bytes, then the footer), :data:`FOOTER_READERS`
  files at a time; its rows are read
  later row group by row group as byte ranges (:func:`batchgen.data.reader.iter_windows`), never the whole
  object into memory;
- each file records the store's version (ETag, generation) and size, which resume compares with the manifest
  before re-reading anything (:func:`batchgen.job.input_versions.unchanged_since`).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.reader import InputError, InputFile, InputSet, SchemaPool, input_set
from batchgen.data.storage import Location, StorageError, object_version

FOOTER_READERS = 16
"""Footers read at once (two range requests each): planning 100,000 objects is bounded by the store's latency
divided by this, not by the number of objects times it."""


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _resolve(loc: Location, spec: str) -> tuple[Location, list[tuple[str, int, str | None]]]:
    """(location of the input root, [(name relative to it, size, version)]) in sorted order."""
    fs, path = loc.fs, loc.root
    try:
        if _is_glob(path):
            base = path.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0]
            hits = fs.glob(path, detail=True)
            entries = {k: v for k, v in hits.items() if v.get("type") != "directory"}
            if not entries:
                raise InputError(f"data.input: no object matches the glob {loc.url!r}")
        else:
            info = _info(fs, path)
            if info is not None and info.get("type") != "directory":
                base, entries = path.rsplit("/", 1)[0], {path: info}
            else:
                found = fs.find(path, detail=True)
                entries = {
                    k: v
                    for k, v in found.items()
                    if k.endswith(".parquet")
                    and not any(p.startswith((".", "_")) for p in k[len(path) :].strip("/").split("/"))
                }
                if not entries:
                    if info is None and not found:
                        loc.check_bucket("read")
                        raise InputError(
                            f"data.input: {loc.url!r} does not exist (expected a Parquet object, a prefix or a glob)"
                        )
                    raise InputError(f"data.input: {loc.url!r} contains no *.parquet objects")
                base = path
    except (InputError, StorageError):
        raise
    except Exception as e:  # noqa: BLE001 - any store error is one line
        raise loc._error(e, "read") from e
    root = loc.child("")
    root.root = base.rstrip("/")
    root.raw_url = loc.raw_url[: loc.raw_url.index("://") + 3] + root.root
    root.url = loc.url[: loc.url.index("://") + 3] + root.root
    files = [
        (k[len(base) :].lstrip("/"), int(v.get("size") or 0), object_version(v)) for k, v in entries.items()
    ]
    return root, sorted(files)


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
    root, entries = _resolve(loc, spec)
    files: list[InputFile] = []
    start = 0
    schemas = SchemaPool()
    with ThreadPoolExecutor(max_workers=min(FOOTER_READERS, max(1, len(entries)))) as pool:
        footers = pool.map(
            lambda e: _footer(root, e[0], e[1]), entries
        )  # in order; errors re-raised in order
        for (rel, size, version), (footer, md) in zip(entries, footers):
            schema = schemas(md)
            rg_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            f = InputFile(
                root.url_of(rel), rel, size, md.num_rows, start, rg_rows, schema, footer, root, version
            )
            files.append(f)
            start += md.num_rows
    return input_set(loc.url, files)
