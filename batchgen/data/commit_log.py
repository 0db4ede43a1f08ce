"""The commit log of an output directory: one small record per committed unit, so every commit costs the same.

``_commits/{seq:012d}.json`` holds record ``seq``; records are numbered densely from 1 and each is created
only if absent (``If-None-Match: *`` on object stores, ``link`` on local disks), so of two writers claiming the
same number exactly one wins. ``_manifest.json`` is the log compacted up to its ``log_seq``: a reader's view
is the manifest with every record after ``log_seq`` applied in order (:func:`read_state`).

Records (JSON): ``{"seq", "epoch", "kind", ...}`` with kind
- ``open``: a holder starts writing; its ``epoch`` is above every earlier one. From here on records of a lower
  epoch are ignored: a stale holder (its lease expired and was taken over) can no longer commit;
- ``window``: a finished window; ``record`` is its :class:`~batchgen.data.manifest.WindowRecord` (its piece,
  ``_windows/part-{window}.arrow``, with size, sha256, version);
- ``part``: a rolled part (name, first and last window, size, sha256, version), written whole before; from
  this record on, the windows it holds name the part, and their pieces are garbage;
- ``checkpoint``: finished rows of an unfinished window in one checkpoint file (name, rows, size, sha256).

Invariants: a record names only objects fully written before it was created; an ambiguous write (its answer
lost, a retry answered "already exists") is resolved by reading the object back (:func:`put_resolved`), never
by deleting anything.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from batchgen.data.layout import COMMITS_DIR
from batchgen.data.lease import LeaseLost
from batchgen.data.manifest import Manifest, PartialRecord, PartRecord, WindowRecord
from batchgen.data.storage import PreconditionFailed


def record_name(seq: int) -> str:
    return f"{seq:012d}.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put_resolved(
    loc: Any, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
) -> str:
    """``loc.put`` whose failed condition is resolved by reading back: when the object holds `data` the write
    landed (a retried request of ours met its own first try) and its version is returned; otherwise
    PreconditionFailed."""
    try:
        version = loc.put(name, data, if_absent=if_absent, if_match=if_match)
        if version is not None:
            return version
    except PreconditionFailed:
        if loc.read_bytes(name) != data:
            raise
    info = loc.info(name)
    return info.etag if info is not None else ""


def apply(m: Manifest, rec: dict[str, Any]) -> bool:
    """Apply record `rec` to `m` (the state before it); False when the record is fenced off (a lower epoch
    than the holder's that opened before it) and changes nothing."""
    epoch = int(rec.get("epoch", 0))
    if epoch < m.epoch:
        return False
    kind = rec.get("kind")
    if kind == "open":
        m.epoch = epoch
    elif kind == "window":
        w = int(rec["window"])
        m.windows[w] = WindowRecord(**rec["record"])
        m.partial.pop(w, None)
    elif kind == "part":
        part = PartRecord(**rec["part"])
        m.parts = [p for p in m.parts if p.name != part.name] + [part]
        m.parts.sort(key=lambda p: p.first)
        for w in range(part.first, part.last + 1):
            if w in m.windows:
                m.windows[w].part = part.name  # its piece is no longer named: garbage
    elif kind == "checkpoint":
        w = int(rec["window"])
        p = m.partial.get(w)
        if p is None:
            p = m.partial[w] = PartialRecord(
                files=[], rows=0, rows_ok=0, input_sha256=rec.get("input_sha256")
            )
        p.files.append(rec["file"])
        p.rows += int(rec["rows"])
        p.rows_ok += int(rec["rows_ok"])
        p.checks[rec["file"]] = [int(rec["size"]), rec["sha256"], rec.get("version")]
    return True


class CommitLog:
    """The records of `loc`'s ``_commits/``; :attr:`next_seq` is the number the next record will take."""

    def __init__(self, loc: Any) -> None:
        self.loc = loc.child(COMMITS_DIR)
        self.next_seq = 1

    def read_from(self, seq: int) -> list[dict[str, Any]]:
        """The records from `seq` on, up to the first number without one (sets :attr:`next_seq` past them)."""
        out = []
        while True:
            raw = self.loc.read_bytes(record_name(seq))
            if raw is None:
                break
            out.append(json.loads(raw))
            seq += 1
        self.next_seq = seq
        return out

    def append(self, rec: dict[str, Any], m: Manifest | None = None) -> int:
        """Create the next record (``rec`` plus its ``seq``); returns its number.

        When another writer created that number first: with `m` (a holder opening) its record is applied to
        `m` and the next number tried; without, this writer is not the only one and LeaseLost is raised."""
        while True:
            seq = self.next_seq
            data = (json.dumps({**rec, "seq": seq}, sort_keys=True) + "\n").encode()
            try:
                put_resolved(self.loc, record_name(seq), data, if_absent=True)
            except PreconditionFailed:
                other = json.loads(self.loc.read_bytes(record_name(seq)) or b"{}")
                if m is None:
                    raise LeaseLost(
                        f"{self.loc.url_of(record_name(seq))} was written by another job (epoch "
                        f"{other.get('epoch')}; this job's is {rec.get('epoch')}): its lease was taken over; this "
                        "job stops; the rows committed before are kept"
                    ) from None
                apply(m, other)
                self.next_seq = seq + 1
                continue
            self.next_seq = seq + 1
            return seq

    def delete_through(self, seq: int) -> None:
        """Remove records up to `seq` (compacted into the manifest)."""
        for name in sorted(self.loc.list()):
            if name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) <= seq:
                self.loc.delete(name)


def read_state(loc: Any) -> tuple[Manifest | None, str | None, CommitLog]:
    """(the manifest with every later record applied, the manifest object's version, the log positioned after
    its last record); (None, None, log) when `loc` holds no manifest. ValueError when it is unreadable."""
    from batchgen.data.layout import MANIFEST_NAME

    log = CommitLog(loc)
    info = loc.info(MANIFEST_NAME)
    raw = loc.read_bytes(MANIFEST_NAME) if info is not None else None
    if raw is None:
        return None, None, log
    m = Manifest.from_json(raw.decode())
    for rec in log.read_from(m.log_seq + 1):
        apply(m, rec)
    return m, info.etag if info is not None else None, log


def window_record_json(rec: WindowRecord) -> dict[str, Any]:
    return asdict(rec)
