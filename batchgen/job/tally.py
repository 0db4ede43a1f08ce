"""Counting the rows a run finishes: errors by kind (with an example message each), the engine's successes
and failures, and a few successful rows to show in the summary."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

from batchgen.engine.core.outputs import RequestOutput

NUM_EXAMPLES = 3  # rows shown in the summary
BASE_MODEL = "base model"  # the by-adapter key of rows without an adapter


def count_adapter_row(counts: dict[str, dict[str, int]], name: str | None, ok: bool) -> None:
    """Add one row of adapter ``name`` (None: the base model) to ``{name: {"ok": n, "error": m}}``."""
    c = counts.setdefault(BASE_MODEL if name is None else name, {"ok": 0, "error": 0})
    c["ok" if ok else "error"] += 1


def window_adapter_rows(names: list[str | None], ok: list[bool]) -> dict[str, dict[str, int]]:
    """A window's rows by adapter (``WindowRecord.rows_by_adapter``): row ``i`` names ``names[i]``."""
    counts: dict[str, dict[str, int]] = {}
    for name, good in zip(names, ok):
        count_adapter_row(counts, name, good)
    return counts


def all_adapter_rows(records) -> tuple[dict[str, dict[str, int]], int]:
    """Rows by adapter summed over committed windows (every run's), and how many windows had no counts."""
    total: dict[str, dict[str, int]] = {}
    uncounted = 0
    for rec in records:
        if rec.rows_by_adapter is None:
            uncounted += 1
            continue
        for name, c in rec.rows_by_adapter.items():
            t = total.setdefault(name, {"ok": 0, "error": 0})
            t["ok"] += c["ok"]
            t["error"] += c["error"]
    return total, uncounted


def error_key(msg: str) -> str:
    """An error message with its numbers blanked, to count errors of one kind together."""
    return re.sub(r"\d+", "N", msg)[:120]


@dataclass
class RowTally:
    """Rows finished this run (failed before generation, or by the engine); ``engine_*`` count only the
    engine's. ``error_examples`` holds the first message of each kind (:func:`error_key`)."""

    rows_finished: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    error_examples: dict[str, str] = field(default_factory=dict)
    engine_done: int = 0
    engine_ok: int = 0
    engine_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: list[tuple[list[int], str]] = field(default_factory=list)  # (prompt token ids, text) of ok rows
    by_adapter: dict[str, dict[str, int]] = field(default_factory=dict)
    """Rows of a LoRA job by adapter name (``base model`` for rows without one): ``{"ok": n, "error": m}``."""
    lora: bool = False
    """Count rows by adapter (the job has ``model.lora_modules``)."""

    def adapter_row(self, name: str | None, ok: bool) -> None:
        """One finished row naming adapter ``name`` (None: the base model), when counting by adapter."""
        if self.lora:
            count_adapter_row(self.by_adapter, name, ok)

    def count(self, ok: bool, error: str | None) -> None:
        """One finished row: ``ok``, or failed with ``error`` (None: not counted as an error kind)."""
        self.rows_finished += 1
        if not ok and error is not None:
            key = error_key(error)
            self.errors[key] += 1
            self.error_examples.setdefault(key, error)

    def engine_output(self, out: RequestOutput) -> bool:
        """Count the engine's result for one row; returns whether it succeeded."""
        ok = not out.error and all(c.finish_reason != "error" for c in out.outputs)
        self.count(ok, out.error or (None if ok else "generation failed"))
        self.engine_done += 1
        self.engine_ok += ok
        if ok and len(self.examples) < 8 * NUM_EXAMPLES and out.outputs:
            self.examples.append((out.prompt_token_ids, out.outputs[0].text))
        if not ok:
            self.engine_errors[error_key(out.error or "generation failed")] += 1
        return ok

    def engine_error_messages(self) -> list[str]:
        """One example message per row the engine failed (the example of its kind)."""
        return [self.error_examples[k] for k, c in self.engine_errors.items() for _ in range(c)]
