"""The output directory of one shard on an object store (``s3://``, ``gs://``, ``az://``, any fsspec URL).

The same files, names and resume rules as a local :class:`~batchgen.data.output_dir.OutputDir` (it is a
subclass overriding only the storage operations), committed without rename or flock (docs/storage.md):
- A part, checkpoint or report is one single-object PUT: it appears whole or not at all. Names depend only on
  the window (``part-000007.parquet``), so writing one again replaces it instead of adding a duplicate.
- The manifest is one PUT conditioned on the version this job last read or wrote (``If-Match``, or
  ``If-None-Match: *`` for a new one): a job that lost its lease cannot overwrite the manifest of the job that
  took over — its write fails and it stops (:class:`~batchgen.data.lease.LeaseLost`).
- One writer per shard location: the lease object (:mod:`batchgen.data.lease`) instead of ``flock``.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.layout import (
    CHECKPOINT_DIR,
    MANIFEST_NAME,
    REPORT_NAME,
    SHARD_RE,
    is_own_checkpoint,
    is_own_file,
)
from batchgen.data.lease import Lease, LeaseLost
from batchgen.data.manifest import Manifest
from batchgen.data.output_dir import OutputDir
from batchgen.data.storage import Location, PreconditionFailed, table_to_parquet_bytes

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 120.0


class RemoteOutputDir(OutputDir):
    """One shard's output location on an object store; ``path`` is its (redacted) URL."""

    def __init__(
        self,
        output: str,
        shard_index: int = 0,
        shard_count: int = 1,
        storage_options: dict[str, Any] | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        super().__init__(".", shard_index, shard_count)
        self.root_loc = Location(output, storage_options, key="data.output")
        sub = self.path.name if self.shard_count > 1 else ""
        self.loc = self.root_loc.child(sub)
        self.root: Any = self.root_loc.url
        self.path: Any = self.loc.url
        self.lease = Lease(self.loc, lease_ttl_s)
        self._manifest_etag: str | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def _makedirs(self) -> None:
        self.loc.check_bucket()

    def _lock(self) -> None:
        self.lease.acquire()

    def close(self) -> None:
        self.lease.release()

    # ------------------------------------------------------------------------------------ manifest
    def _load_manifest(self) -> Manifest | None:
        info = self.loc.info(MANIFEST_NAME)
        if info is None:
            self._manifest_etag = None
            return None
        raw = self.loc.read_bytes(MANIFEST_NAME)
        if raw is None:
            self._manifest_etag = None
            return None
        self._manifest_etag = info.etag
        return Manifest.from_json(raw.decode())

    def _save_manifest(self, m: Manifest) -> None:
        self.lease.check()
        data = m.to_json().encode()
        try:
            if self._manifest_etag is None:
                self._manifest_etag = self.loc.put(MANIFEST_NAME, data, if_absent=True)
            else:
                self._manifest_etag = self.loc.put(MANIFEST_NAME, data, if_match=self._manifest_etag)
        except PreconditionFailed:
            raise LeaseLost(
                f"{self.loc.url_of(MANIFEST_NAME)} was changed by another job (this job's lease expired and was "
                "taken over): this job stops; the rows committed before are kept"
            ) from None

    # ------------------------------------------------------------------------------------ objects
    def _files(self, sub: str = "") -> list[str]:
        return list(self.loc.list(sub))

    def _delete(self, name: str) -> None:
        self.loc.delete(name)
        if name == MANIFEST_NAME:
            self._manifest_etag = None

    def _write_table(self, name: str, table: pa.Table) -> None:
        self.lease.check()
        if name.endswith(".parquet"):
            data = table_to_parquet_bytes(table, compression="zstd")
        else:
            sink = pa.BufferOutputStream()
            opts = pa.ipc.IpcWriteOptions(compression="zstd")
            with pa.ipc.new_file(sink, table.schema, options=opts) as w:
                w.write_table(table)
            data = sink.getvalue().to_pybytes()
        self.loc.put(name, data)

    def _read_table(self, name: str) -> pa.Table:
        raw = self.loc.read_bytes(name)
        if raw is None:
            raise FileNotFoundError(f"{self.loc.url_of(name)} is missing")
        if name.endswith(".parquet"):
            return pq.read_table(io.BytesIO(raw))
        return pa.ipc.open_file(pa.BufferReader(raw)).read_all()

    def _checkpoint_dir_done(self) -> None:
        """Object stores have no directories: nothing to remove."""

    @property
    def report_location(self) -> str:
        return self.loc.url_of(REPORT_NAME)

    def has_report(self) -> bool:
        return self.loc.info(REPORT_NAME) is not None

    def save_report(self, text: str) -> None:
        self.loc.put(REPORT_NAME, text.encode())

    # ------------------------------------------------------------------------------------ other layouts
    def _location_of(self, directory: Any) -> Location:
        if str(directory) == str(self.path):
            return self.loc
        if str(directory) == str(self.root):
            return self.root_loc
        return self.root_loc.child(str(directory).rsplit("/", 1)[-1])

    def _other_layouts(self) -> list[Any]:
        found: list[Any] = []
        if self.shard_count > 1 and self.root_loc.info(MANIFEST_NAME) is not None:
            found.append(self.root)
        for name in self.root_loc.list_dirs():
            m = SHARD_RE.match(name)
            if m and int(m.group(2)) != self.shard_count and self.root_loc.info(f"{name}/{MANIFEST_NAME}"):
                found.append(f"{self.root}/{name}")
        return found

    def _holds_results_at(self, directory: Any) -> bool:
        from batchgen.data.output_dir import _manifest_holds_results

        raw = self._location_of(directory).read_bytes(MANIFEST_NAME)
        try:
            return raw is not None and _manifest_holds_results(Manifest.from_json(raw.decode()))
        except (ValueError, KeyError, TypeError):
            return True

    def _clear(self, directory: Any) -> int:
        loc = self._location_of(directory)
        count = 0
        for name in loc.list():
            if is_own_file(name):
                loc.delete(name)
                count += 1
        for name in loc.list(CHECKPOINT_DIR):
            if is_own_checkpoint(name):
                loc.delete(f"{CHECKPOINT_DIR}/{name}")
                count += 1
        if loc is self.loc:
            self._manifest_etag = None
        return count


__all__ = ["RemoteOutputDir", "LeaseLost", "DEFAULT_LEASE_TTL_S"]


def open_output_dir(
    output: str,
    shard_index: int = 0,
    shard_count: int = 1,
    storage_options: dict[str, Any] | None = None,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
) -> OutputDir:
    """The output directory of a shard: local (:class:`OutputDir`) or on an object store (a URL)."""
    from batchgen.data.storage import is_url

    if is_url(output):
        return RemoteOutputDir(output, shard_index, shard_count, storage_options, lease_ttl_s)
    return OutputDir(output, shard_index, shard_count)
