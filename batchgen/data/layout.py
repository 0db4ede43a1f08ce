"""The output layout: every file, directory and column name batchgen writes, in one place.

``data.output`` holds the output of one job. With ``data.shard.count == 1`` the files below sit in it
directly; otherwise each shard has its own ``shard-{index:05d}-of-{count:05d}/`` directory. A shard's
directory holds:

- ``part-{k:06d}.parquet``: part ``k`` of the output, the rows of consecutive finished windows in input order,
  sized by ``data.part_size`` / ``data.part_rows`` (:mod:`batchgen.data.part_roll`) — the only files a Parquet
  dataset reader sees (``pyarrow.parquet.read_table(out)``, ``pandas.read_parquet(out)``, ``out/**/*.parquet``);
  names sort in input order;
- ``_windows/part-{window:06d}.arrow``: the output rows of one finished window not yet rolled into a part (Arrow
  IPC; garbage once a committed ``part`` record holds its rows);
- ``_manifest.json``: the finished windows (and the rows checkpointed in unfinished ones) and the
  configuration that wrote them;
- ``_report.json``: the figures of the last run;
- ``_checkpoint/``: rows already finished in windows not yet complete (``part-{window:06d}.{seq:06d}.arrow``,
  Arrow IPC files listed in the manifest; folded into the window's part when it completes);
- ``_commits/``: the commit log, one small record per commit since the manifest was last compacted
  (``{seq:012d}.json``, :mod:`batchgen.data.commit_log`);
- ``_logs/<time>/``: Hydra's run directory (config record, job log);
- ``.batchgen.lock``: held (flock) by the one process writing the directory;
- ``.tmp-*``: files being written (renamed into place when complete).

``data.output`` itself holds ``_layout.json``, naming the shard layout (``shard_count``) that owns it: a job of
another layout is refused. On object stores ``_lease.json`` (:mod:`batchgen.data.lease`) takes the lock's place.

Every name except the parts starts with ``_`` or ``.``, which Hive-style dataset readers skip, and nothing
but a part ends with ``.parquet``, so glob readers (polars, DuckDB) see exactly the output rows.

Invariants: batchgen deletes only names for which :func:`is_own_file` is true, never anything else in an
output directory; output column names are :data:`RESERVED_COLUMNS` plus the kept input columns.
"""

from __future__ import annotations

import re

MANIFEST_NAME = "_manifest.json"
REPORT_NAME = "_report.json"
LOGS_DIR = "_logs"  # also spelled out in conf/config.yaml (hydra.run.dir and hydra.sweep.dir)
CHECKPOINT_DIR = "_checkpoint"
WINDOWS_DIR = "_windows"
LOCK_NAME = ".batchgen.lock"
LAYOUT_NAME = "_layout.json"
COMMITS_DIR = "_commits"
TEMP_PREFIX = ".tmp-"
"""Prefix of files being written: :func:`batchgen.runtime.atomic.atomic_write` names its temporary files so."""
METADATA_KEY = b"batchgen"
"""Key of the JSON document in every part's Parquet schema metadata."""
STATUS_NAME = "_batchgen_status.json"
"""Written by each job of a multirun into its Hydra job directory: its exit status and message."""

PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
"""A part of the output."""
PIECE_RE = re.compile(r"^part-(\d{6,})\.arrow$")
"""A window's piece (in :data:`WINDOWS_DIR`)."""
CHECKPOINT_RE = re.compile(r"^part-(\d{6,})\.(\d{6,})\.arrow$")
SHARD_RE = re.compile(r"^shard-(\d{5,})-of-(\d{5,})$")

RESERVED_COLUMNS = (
    "id",
    "sample_index",
    "generated_text",
    "token_ids",
    "num_prompt_tokens",
    "num_generated_tokens",
    "num_cached_tokens",
    "finish_reason",
    "status",
    "error",
    "logprobs",
    "constraint_satisfied",
    "generated_json",
    "embedding",
    "probs",
    "label",
)
"""Output column names the writer owns; kept input columns may not reuse them (except ``id`` as the id)."""

POSITION_COLUMN = "_position"
RETRY_COLUMN = "_retryable"
"""Extra columns of checkpoint files: the row's position in its window, and whether its error may be retried
(``data.retry_errors``). Never in a part."""


def part_name(window: int) -> str:
    """Name (in :data:`WINDOWS_DIR`) of window `window`'s piece: the unit the commit layer writes."""
    return f"{WINDOWS_DIR}/part-{window:06d}.arrow"


def rolled_part_name(index: int) -> str:
    """File name of part `index` of the output."""
    return f"part-{index:06d}.parquet"


def checkpoint_name(window: int, seq: int) -> str:
    """File name (inside :data:`CHECKPOINT_DIR`) of the `seq`-th checkpoint of window `window`."""
    return f"part-{window:06d}.{seq:06d}.arrow"


def shard_dir_name(index: int, count: int) -> str:
    """Sub-directory of data.output for shard `index` of `count` ('' when count == 1)."""
    return "" if int(count) == 1 else f"shard-{int(index):05d}-of-{int(count):05d}"


def is_own_file(name: str) -> bool:
    """True for the names of files batchgen writes into a shard directory (parts, manifest, report, temp
    files): the only ones ``data.overwrite`` and the cleanup of a killed
    run may delete. Checkpoint files live in :data:`CHECKPOINT_DIR` (see :func:`is_own_checkpoint`)."""
    return name in (MANIFEST_NAME, REPORT_NAME) or bool(PART_RE.match(name)) or name.startswith(TEMP_PREFIX)


def is_own_checkpoint(name: str) -> bool:
    """True for the names of files batchgen writes into :data:`CHECKPOINT_DIR`."""
    return bool(CHECKPOINT_RE.match(name)) or name.startswith(TEMP_PREFIX)
