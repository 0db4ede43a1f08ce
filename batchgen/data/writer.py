"""Output directory: atomic Parquet parts (one per window), the manifest, the lock, resume checks.

Layout: ``data.output`` itself when ``data.shard.count == 1``, else
``data.output/shard-{index:05d}-of-{count:05d}/``. Inside: ``part-{window:06d}.parquet``, ``manifest.json``,
``report.json``, ``logs/`` (Hydra's run directory) and a ``.batchgen.lock`` file.

Invariants:
- A part file appears under its final name only complete and fsynced (written as ``.tmp-*``, then renamed);
  the manifest is updated (atomically) only after that rename, so every window it lists has its part.
- Rows of a part are in input order; a valid row contributes one output row per sample (``sample_index``
  column when ``n > 1``), an error row contributes ``n`` rows with ``status="error"``: every input row id
  appears exactly ``n`` times in the output.
- A part's content and schema metadata depend only on the configuration, the input and the window — not on
  timing, resume or batch composition — so a resumed run writes the same bytes' worth of data as an
  uninterrupted one.
- Opening removes temp files and part files the manifest does not list (leftovers of a killed run), and
  refuses (ConfigError) an output written with a different configuration or input unless ``overwrite``,
  which deletes batchgen's own files only (parts, manifest, report, temp files — never anything else).
- One process per output (shard) directory: an exclusive ``flock`` on ``.batchgen.lock``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config import RESERVED_COLUMNS, ConfigError, shard_dir_name
from batchgen.data.manifest import MANIFEST_NAME, Manifest, WindowRecord, diff_config, file_mode, fsync_dir
from batchgen.data.prompts import PromptRow

logger = logging.getLogger(__name__)

PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
SHARD_RE = re.compile(r"^shard-(\d{5,})-of-(\d{5,})$")
REPORT_NAME = "report.json"
LOCK_NAME = ".batchgen.lock"
METADATA_KEY = b"batchgen"


def part_name(window: int) -> str:
    return f"part-{window:06d}.parquet"


# ------------------------------------------------------------------------------------------ part tables
@dataclass
class PartLayout:
    """The fixed schema of a job's part files."""

    id_type: pa.DataType
    kept: list[pa.Field]
    n: int
    logprobs: bool
    metadata: dict[str, Any]

    def schema(self) -> pa.Schema:
        fields = [pa.field("id", self.id_type)]
        if self.n > 1:
            fields.append(pa.field("sample_index", pa.int32()))
        fields += self.kept
        fields += [
            pa.field("generated_text", pa.string()),
            pa.field("token_ids", pa.list_(pa.int32())),
            pa.field("num_prompt_tokens", pa.int32()),
            pa.field("num_generated_tokens", pa.int32()),
            pa.field("num_cached_tokens", pa.int32()),
            pa.field("finish_reason", pa.string()),
            pa.field("status", pa.string()),
            pa.field("error", pa.string()),
        ]
        if self.logprobs:
            fields.append(pa.field("logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))))
        return pa.schema(fields)


@dataclass
class PartStats:
    rows_ok: int = 0
    rows_error: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_output_rows: int = 0


def build_part(
    layout: PartLayout,
    rows: list[PromptRow],
    results: list[Any],
    kept: pa.Table | None,
    window_meta: dict[str, Any],
) -> tuple[pa.Table, PartStats]:
    """The output table of one window: rows in input order, `n` output rows per input row.

    `results[position]` is the engine's RequestOutput for a valid row (None for rows that failed
    validation). Counts of ok/error refer to input rows.
    """
    n = layout.n
    cols: dict[str, list[Any]] = {k: [] for k in RESERVED_COLUMNS}
    take: list[int] = []
    st = PartStats()

    def add(row: PromptRow, k: int, text, toks, nprompt, ncached, reason, status, error, lps=None) -> None:
        cols["id"].append(row.id)
        cols["sample_index"].append(k)
        cols["generated_text"].append(text)
        cols["token_ids"].append(toks)
        cols["num_prompt_tokens"].append(nprompt)
        cols["num_generated_tokens"].append(len(toks) if toks is not None else 0)
        cols["num_cached_tokens"].append(ncached)
        cols["finish_reason"].append(reason)
        cols["status"].append(status)
        cols["error"].append(error)
        cols["logprobs"].append([list(d.items()) for d in lps] if lps is not None else None)
        take.append(row.position)

    for row in rows:
        out = results[row.position]
        if row.error is not None or out is None or getattr(out, "error", None):
            err = row.error if row.error is not None else (out.error if out is not None else "no result")
            nprompt = row.num_prompt_tokens
            if out is not None and out.prompt_token_ids is not None:
                nprompt = len(out.prompt_token_ids)
            for k in range(n):
                add(row, k, None, None, nprompt, 0, "error", "error", err)
            st.rows_error += 1
            continue
        st.rows_ok += 1
        nprompt = len(out.prompt_token_ids)
        st.prompt_tokens += nprompt
        st.cached_tokens += out.num_cached_tokens
        samples = sorted(out.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise RuntimeError(f"row {row.row_index}: engine returned {len(samples)} samples, expected {n}")
        for k, c in enumerate(samples):
            toks = [int(t) for t in c.token_ids]
            st.generated_tokens += len(toks)
            if c.finish_reason == "error":
                add(row, k, None, None, nprompt, out.num_cached_tokens, "error", "error", "generation failed")
            else:
                add(
                    row,
                    k,
                    c.text,
                    toks,
                    nprompt,
                    out.num_cached_tokens,
                    c.finish_reason,
                    "ok",
                    None,
                    c.logprobs,
                )
    st.num_output_rows = len(take)

    schema = layout.schema()
    arrays: list[pa.Array] = []
    kept_table = kept.take(pa.array(take, type=pa.int64())) if kept is not None and layout.kept else None
    for f in schema:
        if kept_table is not None and f.name in kept_table.column_names and f in layout.kept:
            col = kept_table.column(f.name)
            arrays.append(col.cast(f.type) if col.type != f.type else col)
        else:
            arrays.append(pa.array(cols[f.name], type=f.type))
    meta = dict(layout.metadata)
    meta["window"] = window_meta
    table = pa.Table.from_arrays(
        arrays, schema=schema.with_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})
    )
    return table, st


# ------------------------------------------------------------------------------------- output directory
def _ours(name: str) -> bool:
    return name in (MANIFEST_NAME, REPORT_NAME) or bool(PART_RE.match(name)) or name.startswith(".tmp-")


class OutputDir:
    """One shard's output directory (see the module docstring)."""

    def __init__(self, output: str | os.PathLike, shard_index: int = 0, shard_count: int = 1) -> None:
        self.root = Path(output)
        self.shard_index, self.shard_count = int(shard_index), int(shard_count)
        sub = shard_dir_name(self.shard_index, self.shard_count)
        self.path = self.root / sub if sub else self.root
        self._lock_fd: int | None = None
        self.manifest: Manifest | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def _lock(self) -> None:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = "?"
            os.close(fd)
            raise ConfigError(
                f"another batchgen process ({holder or 'unknown pid'}) is writing {str(self.path)!r}; "
                "wait for it to finish or stop it"
            ) from None
        except (ImportError, OSError) as e:  # no flock on this filesystem: carry on unlocked
            logger.warning("cannot lock %s (%s); make sure no other job writes the same output", self.path, e)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _clear(self, directory: Path) -> int:
        """Delete batchgen's files in `directory` (never anything else); returns how many."""
        count = 0
        if not directory.is_dir():
            return 0
        for p in directory.iterdir():
            if p.is_file() and _ours(p.name):
                p.unlink(missing_ok=True)
                count += 1
        return count

    def _other_layouts(self) -> list[Path]:
        """Directories under data.output holding a manifest of a different shard layout than ours."""
        found = []
        if self.shard_count > 1 and (self.root / MANIFEST_NAME).is_file():
            found.append(self.root)
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                m = SHARD_RE.match(p.name)
                if m and p.is_dir() and int(m.group(2)) != self.shard_count and (p / MANIFEST_NAME).is_file():
                    found.append(p)
        return found

    def open(self, fresh: Manifest, overwrite: bool = False) -> Manifest:
        """Lock the directory, clean leftovers, and return the manifest to continue (or `fresh`).

        Raises ConfigError when the directory holds output of another configuration, input or shard
        layout (unless `overwrite`, which discards it).
        """
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            others = self._other_layouts()
            if others and not overwrite:
                where = ", ".join(str(p) for p in others)
                raise ConfigError(
                    f"data.output {str(self.root)!r} already holds output of another shard layout ({where}); "
                    "use another data.output or data.overwrite=true to discard it"
                )
            for p in others:
                self._clear(p)
            for p in self.path.iterdir():
                if p.name.startswith(".tmp-") and p.is_file():
                    p.unlink(missing_ok=True)  # a killed run's unfinished temp file
            existing: Manifest | None
            try:
                existing = Manifest.load(self.path)
            except (ValueError, KeyError, TypeError) as e:
                if not overwrite:
                    raise ConfigError(
                        f"{self.path / MANIFEST_NAME} is unreadable ({e}); use data.overwrite=true to start over"
                    ) from e
                existing = None
            if overwrite:
                n = self._clear(self.path)
                if n:
                    logger.info(
                        "data.overwrite=true: removed %d file(s) of a previous run from %s", n, self.path
                    )
                existing = None
            if existing is not None:
                self._check_compatible(existing, fresh)
                manifest = existing
            else:
                manifest = fresh
            keep = {r.part for r in manifest.windows.values()}
            for p in self.path.iterdir():
                if PART_RE.match(p.name) and p.name not in keep:
                    p.unlink(missing_ok=True)  # written, but its window never reached the manifest
            manifest.save(self.path)
            fsync_dir(self.path)
            self.manifest = manifest
            return manifest
        except BaseException:
            self.close()
            raise

    def _check_compatible(self, old: Manifest, new: Manifest) -> None:
        hint = (
            "Rerun with the original settings to resume, choose another data.output, or pass "
            "data.overwrite=true to discard the existing output."
        )
        if old.fingerprint != new.fingerprint or old.window_rows != new.window_rows:
            diffs = diff_config(old.config, new.config) or ["(configuration fingerprint differs)"]
            raise ConfigError(
                f"{str(self.path)!r} holds output of a different configuration:\n  "
                + "\n  ".join(diffs[:20])
                + f"\n{hint}"
            )
        if old.input.get("fingerprint") != new.input.get("fingerprint"):
            raise ConfigError(
                f"{str(self.path)!r} holds output of different input data (files, sizes or content changed: "
                f"{old.input.get('num_files')} files / {old.input.get('num_rows')} rows before, "
                f"{new.input.get('num_files')} files / {new.input.get('num_rows')} rows now).\n{hint}"
            )
        if old.shard != new.shard or old.num_windows != new.num_windows:
            raise ConfigError(f"{str(self.path)!r} holds another shard of the input ({old.shard}).\n{hint}")
        if old.batchgen_version != new.batchgen_version:
            logger.warning(
                "resuming output written by batchgen %s with batchgen %s",
                old.batchgen_version,
                new.batchgen_version,
            )

    # -------------------------------------------------------------------------------------- writing
    def write_part(self, window: int, table: pa.Table) -> str:
        """Write `table` as the window's part: temp file, fsync, rename, fsync dir. Returns its name."""
        name = part_name(window)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{name}.", dir=self.path)
        try:
            os.fchmod(fd, file_mode())
            with os.fdopen(fd, "wb") as f:
                pq.write_table(table, f, compression="zstd")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(self.path)
        return name

    def commit(self, window: int, table: pa.Table, record: WindowRecord) -> None:
        """Make a finished window durable: its part first, then the manifest entry."""
        assert self.manifest is not None, "open() first"
        record.part = self.write_part(window, table)
        self.manifest.windows[window] = record
        self.manifest.save(self.path)

    @property
    def report_path(self) -> Path:
        return self.path / REPORT_NAME
