"""The manifest of an output directory: which windows are finished, under which configuration.

``manifest.json`` is rewritten atomically (:func:`batchgen.atomic.atomic_write_bytes`) after each part file is
in place, so at any moment it lists only windows whose part is complete on disk. A part file without a
manifest entry (killed between the two renames) is redone and replaced on the next run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchgen.atomic import atomic_write_bytes
from batchgen.data.layout import MANIFEST_NAME

FORMAT = "batchgen-manifest/1"


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


@dataclass
class Manifest:
    """Contents of ``manifest.json``.

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
    format: str = FORMAT

    @property
    def complete(self) -> bool:
        return len(self.windows) == self.num_windows

    def to_json(self) -> str:
        d = asdict(self)
        d["windows"] = {str(k): asdict(v) for k, v in sorted(self.windows.items())}
        d["complete"] = self.complete
        d["rows_done"] = sum(r.row_end - r.row_start for r in self.windows.values())
        return json.dumps(d, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown manifest format {d.get('format')!r}")
        windows = {int(k): WindowRecord(**v) for k, v in d.get("windows", {}).items()}
        return cls(
            fingerprint=d["fingerprint"],
            config=d["config"],
            input=d["input"],
            shard=d["shard"],
            window_rows=int(d["window_rows"]),
            num_windows=int(d["num_windows"]),
            batchgen_version=d.get("batchgen_version", "?"),
            windows=windows,
        )

    def save(self, directory: str | os.PathLike) -> None:
        atomic_write_bytes(Path(directory) / MANIFEST_NAME, self.to_json().encode())

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Manifest | None:
        p = Path(directory) / MANIFEST_NAME
        if not p.is_file():
            return None
        return cls.from_json(p.read_text())


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
