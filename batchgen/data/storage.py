"""Local paths and object stores behind one small interface: what a job needs to read its input and to commit
its output without ``rename`` or ``flock``.

A :class:`Location` is a directory-like prefix: a URL (``s3://``, ``gs://``, ``az://``/``abfs://``, ``hf://``,
any fsspec protocol) opened through fsspec. Credentials and endpoints come from each ecosystem's standard places
(for S3 the ``AWS_*`` variables including ``AWS_ENDPOINT_URL``, profiles, instance roles) plus the explicit
``storage_options`` (``data.storage_options``).

Invariants:
- :meth:`Location.put` is one single-object write: readers see the previous object or the new one, never a
  part of it (S3, GCS and Azure commit an object on the completion of its PUT or multipart upload).
- :meth:`Location.put_stream` writes an object too large to hold in memory from a writer function, as a
  multipart upload of :data:`UPLOAD_BLOCK` bytes a part (one PUT when smaller): the store makes it visible
  whole when the upload completes, or not at all; memory holds one block.
- ``put(if_absent=True)`` succeeds only when no object has the name, ``put(if_match=etag)`` only when the object
  still has that ETag; otherwise :class:`PreconditionFailed`. S3 (and S3-compatible servers) do this in the
  store (``If-None-Match: *`` / ``If-Match``); on stores without conditional writes it is a check before the
  write (:attr:`Location.conditional` is False; ``docs/storage.md`` says what that weakens).
- Every error that reaches the user is one line (:class:`StorageError`, a ConfigError) naming the URL — with any
  credential removed (:func:`redact_url`) — and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from batchgen.errors import ConfigError

CLOUD_EXTRA_HINT = "pip install 'batchgen[cloud]'"
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs", "hf": "huggingface_hub"}  # fmt: skip
_SECRET_KEY_RE = re.compile(r"key|secret|token|pass|cred|sas|sig|auth|session|private", re.IGNORECASE)
REDACTED = "***"
logger = logging.getLogger("batchgen.job")


class StorageError(ConfigError):
    """A location cannot be used as asked (missing credentials, bucket, package); the CLI exits with status 2."""


class PreconditionFailed(Exception):
    """A conditional write found the object in another state than the one it was conditioned on."""


class StorageUnavailable(RuntimeError):
    """The store did not answer (connection refused or reset, a timeout, a 5xx) after the retries: the job
    exits 75 (retryable) and a rerun resumes."""


TRANSIENT_CODES = ("500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
                   "RequestTimeout", "RequestTimeoutException", "ThrottlingException")  # fmt: skip
RETRY_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 4.0)
"""Pauses between the tries of an operation that met a transient error (then StorageUnavailable)."""
UPLOAD_BLOCK = 8 << 20
"""Bytes per part of a streamed multipart upload (:meth:`Location.put_stream`; S3's least is 5 MiB)."""


class HashingWriter:
    """A write-only binary file over `f` that counts the bytes written and hashes them (sha256): what a
    streamed write (:meth:`Location.put_stream`) records of the object without holding it."""

    def __init__(self, f: Any) -> None:
        self.f, self.size, self._h = f, 0, hashlib.sha256()
        self.closed = False

    def write(self, b: Any) -> int:
        n = self.f.write(b)
        self._h.update(b)
        self.size += len(memoryview(b).cast("B"))
        return n if n is not None else len(b)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:  # the caller closes (or discards) the file underneath
        self.closed = True

    def hexdigest(self) -> str:
        return self._h.hexdigest()


Writer = Callable[[Any], None]
"""Writes an object's bytes into the binary file it is given (called again when a write starts over)."""


def is_transient(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is an outage worth retrying: connection refused/reset, a timeout, a 5xx
    or throttling answer."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        name = type(cur).__name__
        if isinstance(cur, (ConnectionError, TimeoutError)) or name in (
            "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
            "ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
            "ResponseStreamingError", "IncompleteReadError", "ProtocolError",
        ):  # fmt: skip
            return True
        if _client_error_code(cur) in TRANSIENT_CODES:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


@dataclass(frozen=True)
class ObjectInfo:
    """What the store says about one object: its size and its version (ETag, GCS generation, ...)."""

    size: int
    etag: str | None


def is_url(spec: Any) -> bool:
    """Whether `spec` names a remote location (``scheme://...``, except ``file://``)."""
    s = str(spec)
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", s)
    return bool(m) and m.group(1).lower() != "file"


def redact_url(url: str) -> str:
    """`url` without user name, password or query string (which may carry a SAS token or a signature)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    netloc = (REDACTED + "@" + host) if (parts.username or parts.password) else parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, REDACTED if parts.query else "", ""))


def is_secret_key(name: str) -> bool:
    """Whether a storage option of this name holds a secret (key, secret, token, password, SAS, ...)."""
    return bool(_SECRET_KEY_RE.search(str(name)))


def redact_options(options: Any) -> Any:
    """`options` (nested dicts/lists) with the values of secret-looking keys replaced by ``***``."""
    if isinstance(options, dict):
        return {k: (REDACTED if is_secret_key(k) and v not in (None, "") else redact_options(v))
                for k, v in options.items()}  # fmt: skip
    if isinstance(options, (list, tuple)):
        return [redact_options(v) for v in options]
    if isinstance(options, str) and is_url(options):
        return redact_url(options)
    return options


def _client_error_code(e: BaseException) -> str | None:
    """The S3 error code (``PreconditionFailed``, ``NoSuchBucket``...) of `e` or what caused it, if any."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        resp = getattr(cur, "response", None)
        if isinstance(resp, dict):
            code = (resp.get("Error") or {}).get("Code")
            if code:
                return str(code)
        cur = cur.__cause__ or cur.__context__
    return None


def _is_precondition_failure(e: BaseException) -> bool:
    return _client_error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def _missing_credentials(e: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


_CREDENTIAL_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, an instance role, or "
    "data.storage_options.key / data.storage_options.secret)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS (or run `gcloud auth application-default login`, or pass "
    "data.storage_options.token)",
    "az": "set AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or "
    "data.storage_options.account_name / account_key)",
    "hf": "set HF_TOKEN (or run `huggingface-cli login`, or pass data.storage_options.token)",
}


def storage_error(e: BaseException, url: str, key: str, doing: str) -> StorageError:
    """One line for `e`, met while `doing` (``read``, ``write into``) `url` given as config key `key`."""
    shown = redact_url(url)
    proto = urlsplit(url).scheme.lower() if is_url(url) else "file"
    family = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}.get(proto, proto)
    if _missing_credentials(e):
        hint = _CREDENTIAL_HINTS.get(family, "pass them in data.storage_options")
        return StorageError(f"{key}: no credentials found to {doing} {shown!r}: {hint}")
    code = _client_error_code(e)
    if code in ("NoSuchBucket",) or (
        isinstance(e, FileNotFoundError) and "bucket" in str(e).lower() and "exist" in str(e).lower()
    ):
        bucket = urlsplit(url).netloc.rsplit("@", 1)[-1]
        return StorageError(
            f"{key}: the bucket {bucket!r} of {shown!r} does not exist; create it or fix the URL"
        )
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken") or (
        isinstance(e, PermissionError)
    ):
        return StorageError(
            f"{key}: access denied to {doing} {shown!r} ({code or 'permission denied'}): check the credentials "
            "and their permissions on this bucket and prefix"
        )
    why = " ".join(str(e).split())[:200] or type(e).__name__
    return StorageError(f"{key}: cannot {doing} {shown!r}: {why}")


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for `url`; StorageError when its package is missing."""
    proto = urlsplit(url).scheme.lower()
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError as e:
        raise StorageError(f"{redact_url(url)!r}: reading URLs needs fsspec: {CLOUD_EXTRA_HINT}") from e
    try:
        # a fresh instance: credentials and endpoints are read now, not from an earlier job in this process
        fs, path = url_to_fs(url, skip_instance_cache=True, **options)
    except ImportError as e:
        pkg = _PACKAGES.get(proto, "the fsspec implementation of this protocol")
        raise StorageError(
            f"{redact_url(url)!r}: the {proto}:// protocol needs {pkg}: {CLOUD_EXTRA_HINT}"
        ) from e
    except ValueError as e:
        if proto not in fsspec.available_protocols():
            raise StorageError(f"{redact_url(url)!r}: unknown protocol {proto!r}") from e
        raise StorageError(f"{redact_url(url)!r}: {' '.join(str(e).split())[:200]}") from e
    return fs, path.rstrip("/")


class Location:
    """A directory-like prefix in a filesystem or object store. Names passed to the methods are relative to it
    (``part-000001.parquet``, ``_checkpoint/part-000001.000000.arrow``)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, key: str = "data.output"):
        self.raw_url = str(url).rstrip("/")
        self.url = redact_url(self.raw_url)
        self.key = key
        self.options = dict(storage_options or {})
        self.fs, self.root = _filesystem(self.raw_url, self.options)
        self.protocol = urlsplit(self.raw_url).scheme.lower()
        self.conditional = self.protocol in ("s3", "s3a")
        """Whether conditional writes happen in the store (atomically) rather than as a check before the write."""

    def child(self, sub: str) -> Location:
        """The location `sub` below this one (same filesystem and options)."""
        loc = object.__new__(Location)
        loc.__dict__.update(self.__dict__)
        if sub:
            loc.raw_url, loc.url, loc.root = (
                f"{self.raw_url}/{sub}",
                f"{self.url}/{sub}",
                f"{self.root}/{sub}",
            )
        return loc

    @property
    def display(self) -> str:
        """What messages and callers show for this location (its redacted URL)."""
        return self.url

    def remove_dir(self, sub: str) -> None:
        """Object stores have no directories: nothing to remove."""

    def path(self, name: str = "") -> str:
        """The filesystem path of `name` (the fsspec path, without the protocol)."""
        return f"{self.root}/{name}" if name else self.root

    def url_of(self, name: str = "") -> str:
        """The (redacted) URL of `name`, for messages."""
        return f"{self.url}/{name}" if name else self.url

    def _error(self, e: BaseException, doing: str, name: str = "") -> StorageError:
        return storage_error(e, self.raw_url + (f"/{name}" if name else ""), self.key, doing)

    def _call(self, doing: str, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with backoff on transient errors (StorageUnavailable when they last); other errors
        propagate. FileNotFoundError is an answer, not an outage."""
        for delay in (*RETRY_DELAYS_S, None):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if not is_transient(e) or isinstance(e, PreconditionFailed):
                    raise
                if delay is None:
                    why = " ".join(str(e).split())[:160] or type(e).__name__
                    raise StorageUnavailable(
                        f"{self.key}: the store does not answer to {doing} {self.url_of(name)!r} ({why}) after "
                        f"{len(RETRY_DELAYS_S) + 1} tries: rerun the same command to resume"
                    ) from e
                logger.warning(
                    "%s %s: %s; retrying in %.1f s", doing, self.url_of(name), type(e).__name__, delay
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------ reads
    def info(self, name: str) -> ObjectInfo | None:
        """Size and version of object `name`, or None when there is none."""
        path = self.path(name)
        try:
            d = self._call(
                "read",
                name,
                lambda: self.fs.info(path, refresh=True) if self._refreshable else self.fs.info(path),
            )
        except FileNotFoundError:
            return None
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any store error is one line for the user
            raise self._error(e, "read", name) from e
        if d.get("type") == "directory":
            return None
        return ObjectInfo(int(d.get("size") or 0), object_version(d))

    @property
    def _refreshable(self) -> bool:
        return self.protocol in ("s3", "s3a", "gs", "gcs")

    def read_bytes(self, name: str) -> bytes | None:
        """The content of object `name`, or None when there is none."""
        path = self.path(name)

        def cat() -> bytes:
            self.fs.invalidate_cache(path)  # a cached "not found" must not answer for an object written since
            return self.fs.cat_file(path)

        try:
            return self._call("read", name, cat)
        except FileNotFoundError:
            return None
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "read", name) from e

    def open_read(self, name: str) -> Any:
        """A seekable binary file over object `name` that fetches byte ranges as they are read."""
        try:
            return self.fs.open(self.path(name), "rb", block_size=4 << 20, cache_type="readahead")
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "read", name) from e

    def _ls(self, sub: str) -> list[dict[str, Any]]:
        base = self.path(sub)

        def ls() -> list[dict[str, Any]]:
            self.fs.invalidate_cache(base)
            return self.fs.ls(base, detail=True)

        try:
            return self._call("list", sub, ls)
        except FileNotFoundError:
            return []
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "list", sub) from e

    def list(self, sub: str = "") -> dict[str, ObjectInfo]:
        """Objects directly below `sub` (names relative to `sub`): the 'files' of a directory."""
        out = {}
        for d in self._ls(sub):
            if d.get("type") == "directory":
                continue
            name = str(d["name"]).rstrip("/").rsplit("/", 1)[-1]
            out[name] = ObjectInfo(int(d.get("size") or 0), object_version(d))
        return out

    def list_dirs(self) -> list[str]:
        """Names of the 'directories' (common prefixes) directly below this location."""
        return sorted(
            str(d["name"]).rstrip("/").rsplit("/", 1)[-1]
            for d in self._ls("")
            if d.get("type") == "directory"
        )

    def prepare(self) -> None:
        """StorageError when the bucket (container, repository) of this location is missing or unreachable."""
        self.check_bucket()

    def check_bucket(self, doing: str = "write into") -> None:
        """StorageError when the bucket (container, repository) of this location is missing or unreachable."""
        bucket = self.root.split("/", 1)[0]
        try:
            if self.protocol in ("s3", "s3a"):
                self._call(doing, "", lambda: self.fs.call_s3("head_bucket", Bucket=bucket))
            else:
                self._call(doing, "", lambda: self.fs.ls(bucket))
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001
            if isinstance(e, FileNotFoundError) or _client_error_code(e) in ("404", "NoSuchBucket"):
                raise StorageError(
                    f"{self.key}: the bucket {bucket!r} of {self.url!r} does not exist; create it or fix the URL"
                ) from e
            raise self._error(e, doing) from e

    # ----------------------------------------------------------------------------------------- writes
    def put(
        self, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str | None:
        """Write `data` as object `name` in one atomic write; returns the new version (ETag) when the store
        says it. With `if_absent` / `if_match`, raises PreconditionFailed when the condition does not hold.

        A write whose answer was lost is retried (by the client and here); a retried conditional write may
        then fail its condition against its own first try: callers resolve PreconditionFailed by reading the
        object back (:func:`batchgen.data.commit_log.put_resolved`)."""
        path = self.path(name)
        if self.conditional:
            kwargs: dict[str, Any] = {}
            if if_absent:
                kwargs["IfNoneMatch"] = "*"
            elif if_match is not None:
                kwargs["IfMatch"] = if_match
            try:
                out = self._call("write into", name, lambda: self.fs.pipe_file(path, data, **kwargs))
            except StorageUnavailable:
                raise
            except Exception as e:  # noqa: BLE001
                gone = isinstance(e, FileNotFoundError) or _client_error_code(e) in ("NoSuchKey", "404")
                if (
                    _is_precondition_failure(e)
                    or (if_absent and isinstance(e, FileExistsError))
                    or (if_match is not None and gone)
                ):
                    raise PreconditionFailed(self.url_of(name)) from e
                raise self._error(e, "write into", name) from e
            etag = (out or {}).get("ETag") if isinstance(out, dict) else None
            return etag if etag is not None else (self.info(name) or ObjectInfo(0, None)).etag
        if if_absent or if_match is not None:  # checked before the write (see `conditional`)
            cur = self.info(name)
            if (if_absent and cur is not None) or (
                if_match is not None and (cur is None or cur.etag != if_match)
            ):
                raise PreconditionFailed(self.url_of(name))
        try:
            self._call("write into", name, lambda: self.fs.pipe_file(path, data))
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "write into", name) from e
        info = self.info(name)
        return info.etag if info is not None else None

    def put_stream(self, name: str, write: Writer, *, if_absent: bool = False) -> tuple[int, str, str | None]:
        """Write object `name` from ``write(file)`` streamed to the store (a multipart upload of
        :data:`UPLOAD_BLOCK`-byte parts, or one PUT when smaller), visible whole when it completes; returns
        ``(size, sha256, version)``. `write` is called again when a transient error makes the upload start
        over. With `if_absent`, PreconditionFailed when another object has the name (an object holding the
        same bytes — our own retried completion — is the write landing)."""
        path = self.path(name)
        exclusive = if_absent and self.conditional

        def attempt() -> tuple[int, str]:
            f = self.fs.open(path, "xb" if exclusive else "wb", block_size=UPLOAD_BLOCK)
            sink = HashingWriter(f)
            try:
                write(sink)
            except BaseException:
                discard = getattr(f, "discard", None)
                with contextlib.suppress(Exception):
                    discard() if discard is not None else f.close()
                raise
            try:
                f.close()
            except Exception as e:  # noqa: BLE001
                if exclusive and (_is_precondition_failure(e) or isinstance(e, FileExistsError)):
                    if self._sha256(name) == sink.hexdigest():
                        return sink.size, sink.hexdigest()  # our completion, retried after a lost answer
                    raise PreconditionFailed(self.url_of(name)) from e
                raise
            return sink.size, sink.hexdigest()

        if if_absent and not self.conditional and self.info(name) is not None:
            raise PreconditionFailed(self.url_of(name))
        try:
            size, digest = self._call("write into", name, attempt)
        except (StorageUnavailable, PreconditionFailed):
            raise
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "write into", name) from e
        info = self.info(name)
        return size, digest, info.etag if info is not None else None

    def _sha256(self, name: str) -> str | None:
        """The sha256 of object `name` read in blocks (None when there is none)."""
        h = hashlib.sha256()
        try:
            with self.open_read(name) as f:
                while block := f.read(UPLOAD_BLOCK):
                    h.update(block)
        except (FileNotFoundError, StorageError):
            return None
        return h.hexdigest()

    def delete(self, name: str) -> None:
        """Remove object `name` (no error when it is already gone)."""
        try:
            self._call("delete from", name, lambda: self.fs.rm_file(self.path(name)))
        except FileNotFoundError:
            pass
        except StorageUnavailable:
            raise
        except Exception as e:  # noqa: BLE001
            if getattr(e, "errno", None) == errno.ENOENT:
                return
            raise self._error(e, "delete from", name) from e


def open_location(spec: Any, storage_options: dict[str, Any] | None = None, key: str = "data.output") -> Any:
    """The location `spec` names: a :class:`Location` for a URL, else a local
    :class:`~batchgen.data.local_storage.LocalLocation` (the same methods)."""
    if is_url(spec):
        return Location(str(spec), storage_options, key=key)
    from batchgen.data.local_storage import LocalLocation

    return LocalLocation(str(spec).removeprefix("file://"), key=key)


def object_version(d: dict[str, Any]) -> str | None:
    """The version of an object from an fsspec ``info`` dict: ETag (S3, Azure), generation (GCS), blob id (HF)."""
    for k in ("ETag", "etag", "generation", "blob_id", "last_commit", "md5Hash"):
        v = d.get(k)
        if v not in (None, ""):
            return str(v if not isinstance(v, dict) else v.get("oid", v))
    return None


def table_to_parquet_bytes(table: Any, **kwargs: Any) -> bytes:
    """`table` as Parquet file bytes (what a single PUT writes)."""
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf, **kwargs)
    return buf.getvalue()
