"""The manifest of an output directory: which windows are finished, under which configuration.

``_manifest.json`` is the commit log (:mod:`batchgen.data.commit_log`) compacted up to record ``log_seq``:
a job writes it when it opens the directory and when it closes it, and each commit in between adds one small
record, so a commit costs the same however many came before. The state of an output is this manifest with
the later records applied (:meth:`Manifest.load` does it). Every piece, part and checkpoint it names is
recorded with its size and sha256, checked before a run trusts it.

- ``windows``: finished windows (their part holds every row of the window), with the rows whose error may be
  retried (``data.retry_errors``) and a hash of the window's input rows (checked when a resume skips it);
- ``parts``: the rolled parts (the dataset's files), each with the windows it holds;
- ``partial``: windows not finished yet whose finished rows are checkpointed (:data:`CHECKPOINT_DIR` files);
- ``model``: names describing the checkpoint (path, architecture, per-file hashes) for readable refusals;
  only ``config`` (hashed into ``fingerprint``) decides whether a rerun may resume.

Format ``batchgen-manifest/3``; any other format is refused as unreadable.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchgen.data.layout import MANIFEST_NAME
from batchgen.runtime.atomic import atomic_write_bytes

FORMAT = "batchgen-manifest/3"


@dataclass
class WindowRecord:
    """A finished window: its part file and what it holds."""

    part: str
    row_start: int
    row_end: int
    num_output_rows: int
    rows_ok: int
    rows_error: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    wall_time_s: float = 0.0
    retry_rows: list[int] = field(default_factory=list)
    """Positions (in the window) of error rows caused by the run's resources or settings, which
    ``data.retry_errors=true`` recomputes."""
    input_sha256: str | None = None
    """Hash of the window's input rows (the columns the job reads); None when the input was unreadable."""
    size: int = 0
    sha256: str = ""
    version: str | None = None
    """The part's size, content hash and store version (ETag, local inode/mtime) when it was committed."""
    rows_by_adapter: dict[str, dict[str, int]] | None = None
    """A LoRA job's input rows by adapter name (``base model``: rows without one): ``{"ok": n, "error": m}``;
    None when not counted (not a LoRA job, or counts re-derived from the part after a crash)."""


@dataclass
class PartRecord:
    """A rolled part of the output: the rows of windows ``first`` to ``last`` (both included), in input order,
    in one Parquet file of the dataset (:mod:`batchgen.data.part_roll`)."""

    name: str
    first: int
    last: int
    size: int = 0
    sha256: str = ""
    version: str | None = None


@dataclass
class PartialRecord:
    """An unfinished window whose finished rows are checkpointed in ``files`` (under ``_checkpoint/``)."""

    files: list[str]
    rows: int
    """Input rows held by the files (each with all its samples)."""
    rows_ok: int = 0
    """Of those, rows without error."""
    input_sha256: str | None = None
    checks: dict[str, list] = field(default_factory=dict)
    """``file -> [size, sha256, version]`` of each checkpoint file when it was committed."""


@dataclass
class Manifest:
    """Contents of ``_manifest.json``.

    ``fingerprint`` is the hash of ``config`` (the settings that change the output); ``input`` describes the
    input files (its ``fingerprint`` changes when they do). ``windows`` maps window index → record.
    """

    fingerprint: str
    config: dict[str, Any]
    input: dict[str, Any]
    shard: dict[str, int]
    window_rows: int
    num_windows: int
    batchgen_version: str
    windows: dict[int, WindowRecord] = field(default_factory=dict)
    partial: dict[int, PartialRecord] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    parts: list[PartRecord] = field(default_factory=list)
    """The rolled parts, contiguous from window 0 in input order; a window a part holds has its name as
    ``part`` unless the window was committed again since (its newer rows are in its piece)."""
    epoch: int = 0
    """The epoch of the last holder that opened the output (records of lower epochs after it are fenced)."""
    log_seq: int = 0
    """The last commit record compacted into this manifest."""
    format: str = FORMAT

    @property
    def complete(self) -> bool:
        return len(self.windows) == self.num_windows

    @property
    def committed_anything(self) -> bool:
        """Whether any output row is on disk (a part or a checkpoint)."""
        return bool(self.windows) or any(p.files for p in self.partial.values())

    @property
    def rows_done(self) -> int:
        return sum(r.row_end - r.row_start for r in self.windows.values()) + sum(
            p.rows for p in self.partial.values()
        )

    @property
    def retry_rows(self) -> int:
        return sum(len(r.retry_rows) for r in self.windows.values())

    def to_json(self) -> str:
        d = asdict(self)
        d["windows"] = {str(k): asdict(v) for k, v in sorted(self.windows.items())}
        d["partial"] = {str(k): asdict(v) for k, v in sorted(self.partial.items())}
        d["parts"] = [asdict(p) for p in self.parts]
        d["complete"] = self.complete
        d["rows_done"] = self.rows_done
        d["format"] = FORMAT
        return json.dumps(d, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown manifest format {d.get('format')!r}")
        windows = {int(k): WindowRecord(**v) for k, v in d.get("windows", {}).items()}
        partial = {int(k): PartialRecord(**v) for k, v in d.get("partial", {}).items()}
        return cls(
            fingerprint=d["fingerprint"],
            config=d["config"],
            input=d["input"],
            shard=d["shard"],
            window_rows=int(d["window_rows"]),
            num_windows=int(d["num_windows"]),
            batchgen_version=d.get("batchgen_version", "?"),
            windows=windows,
            partial=partial,
            model=d.get("model") or {},
            parts=[PartRecord(**p) for p in d.get("parts", [])],
            epoch=int(d.get("epoch", 0)),
            log_seq=int(d.get("log_seq", 0)),
            format=d["format"],
        )

    def save(self, directory: str | os.PathLike) -> None:
        atomic_write_bytes(Path(directory) / MANIFEST_NAME, self.to_json().encode())

    @classmethod
    def path_in(cls, directory: str | os.PathLike) -> Path | None:
        """The manifest file of `directory`, or None when it has none."""
        p = Path(directory) / MANIFEST_NAME
        return p if p.is_file() else None

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Manifest | None:
        """The state of the output in `directory`: its manifest with the later commit records applied."""
        from batchgen.data.commit_log import read_state
        from batchgen.data.local_storage import LocalLocation

        return read_state(LocalLocation(directory))[0]


def diff_config(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Human-readable differences between two nested config dicts: ['sampling.temperature: 1.0 -> 0.5']."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in list(old) + [k for k in new if k not in old]:
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(f"{key}: (absent) -> {new[k]!r}")
            elif k not in new:
                out.append(f"{key}: {old[k]!r} -> (absent)")
            else:
                out.extend(diff_config(old[k], new[k], key))
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def describe_model_change(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """A readable line about how the checkpoint changed (path, architecture, which files), or None when none
    of them did."""
    parts = []
    if old.get("path") != new.get("path"):
        parts.append(f"path {old.get('path')!r} -> {new.get('path')!r}")
    if old.get("architecture") != new.get("architecture"):
        parts.append(f"architecture {old.get('architecture')} -> {new.get('architecture')}")
    of, nf = old.get("files") or {}, new.get("files") or {}
    changed = sorted(k for k in set(of) & set(nf) if of[k] != nf[k])
    added, removed = sorted(set(nf) - set(of)), sorted(set(of) - set(nf))
    for what, names in (("changed", changed), ("added", added), ("removed", removed)):
        if names:
            parts.append(f"files {what}: {', '.join(names[:8])}" + (" ..." if len(names) > 8 else ""))
    return "model: " + "; ".join(parts) if parts else None
