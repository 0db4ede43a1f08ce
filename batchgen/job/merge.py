"""Checking and merging a job's output: does the union of its shards cover every input row exactly once?

The expected ids are re-enumerated from the input: the global row index ``0..N-1`` when the job ran
without ``data.id_column`` (the input is not read then, only its row count from the manifest), else that
column of the input files read in the job's order. With ``sampling.n > 1`` every (id, sample_index) is
expected once. :func:`verify` counts missing, duplicated and unknown ids (with examples), missing and
unfinished shards, and rows whose ``status`` is ``error`` (those are covered: they are output rows).

Invariants:
- :attr:`MergeReport.ok` only when nothing is missing, duplicated or unknown.
- :func:`write_merged` produces the rows of every shard in input order (shard, then window, then row order,
  which the writer guarantees; sorted explicitly if it ever is not), atomically (:mod:`batchgen.runtime.atomic`).
- Memory: verification holds the id columns only; writing streams one part at a time (in order).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.layout import MANIFEST_NAME, METADATA_KEY
from batchgen.data.manifest import Manifest
from batchgen.data.reader import InputError, open_input, shard_range
from batchgen.data.values import sanitize_utf8
from batchgen.job.result import one_line
from batchgen.job.shards import MergeError, PartRef, Shard, find_shards
from batchgen.runtime.atomic import atomic_write


# ----------------------------------------------------------------------------------------------- input
def _plain(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One array, dictionary decoded, text that is not UTF-8 written as the job writes it (U+FFFD)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], type=arr.type)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return sanitize_utf8(arr)[0]


def input_ids(manifest: Manifest, input_spec: str | None) -> tuple[pa.Array, str | None]:
    """The expected ids in input order, and the input path that was read (None when not needed).

    Without ``data.id_column`` the ids are ``0..N-1`` (N from the manifest) and the input is only opened
    (to check its fingerprint) when `input_spec` is given. Raises MergeError when the input is needed but
    cannot be found or has changed since the job ran.
    """
    id_column = (manifest.config.get("data") or {}).get("id_column")
    num_rows = int(manifest.input.get("num_rows", 0))
    recorded = manifest.input.get("spec")
    spec = input_spec or recorded
    if id_column is None and input_spec is None:
        return pa.array(np.arange(num_rows, dtype=np.int64)), None
    if not spec:
        raise MergeError("the manifest records no input path; pass --input")
    try:
        inp = open_input(spec)
    except InputError as e:
        hint = (
            "" if input_spec else " (the path recorded by the job; pass --input where the input lives here)"
        )
        raise MergeError(f"cannot open the input {spec!r}{hint}: {e}") from e
    if inp.fingerprint != manifest.input.get("fingerprint"):
        raise MergeError(
            f"the input {spec!r} is not the one the job read ({inp.num_rows} rows in {len(inp.files)} file(s) now, "
            f"{num_rows} rows in {manifest.input.get('num_files')} file(s) then, or their content changed)"
        )
    if id_column is None:
        return pa.array(np.arange(num_rows, dtype=np.int64)), spec
    chunks = [_file_ids(f, id_column) for f in inp.files]
    if not chunks:
        return pa.array([], type=pa.int64()), spec
    target = chunks[0].type
    return pa.concat_arrays([c.cast(target) if c.type != target else c for c in chunks]), spec


def _file_ids(f: Any, id_column: str) -> pa.Array:
    """The id column of one input file, row group by row group; MergeError naming the row group that cannot
    be decoded (the job wrote its rows as error rows without an id, so they cannot be matched)."""
    pieces = []
    with pq.ParquetFile(f.path) as pf:
        start = f.row_start
        for rg in range(pf.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            try:
                pieces.append(_plain(pf.read_row_group(rg, columns=[id_column]).column(id_column)))
            except (OSError, pa.ArrowException) as e:
                raise MergeError(
                    f"cannot read the id column {id_column!r} of the input {f.rel_path!r} row group {rg} (input "
                    f"rows {start}..{start + n}): {one_line(e)}; the job wrote those rows as error rows without "
                    "an id: repair the input file, rerun the job with data.retry_errors=true, then merge"
                ) from e
            start += n
    if not pieces:
        return _plain(pq.read_schema(f.path).empty_table().column(id_column))
    return pa.concat_arrays(pieces) if len(pieces) > 1 else pieces[0]


# -------------------------------------------------------------------------------------------- coverage
@dataclass
class Problem:
    """One missing / duplicated / unknown (id, sample) with where it belongs."""

    id: Any
    sample_index: int | None = None
    row: int | None = None  # global row index in the input
    shard: int | None = None  # the shard that should hold it
    count: int | None = None  # times found (duplicates)


@dataclass
class MergeReport:
    """The result of :func:`verify` (``ok`` = complete and duplicate-free)."""

    output_dir: str
    input: str | None
    id_column: str | None
    shard_count: int
    shards_found: list[int]
    shards_missing: list[int]
    shards_incomplete: dict[int, str]
    input_rows: int
    samples_per_row: int
    expected_rows: int
    output_rows: int
    error_rows: int
    missing: int
    duplicated: int
    unknown: int
    input_duplicate_ids: int = 0
    missing_examples: list[Problem] = field(default_factory=list)
    duplicated_examples: list[Problem] = field(default_factory=list)
    unknown_examples: list[Problem] = field(default_factory=list)
    parts: int = 0
    in_order: bool = True

    @property
    def ok(self) -> bool:
        return self.missing == 0 and self.duplicated == 0 and self.unknown == 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _py(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def _shard_of(row: int, num_rows: int, count: int) -> int:
    # shard i holds [i*N//count, (i+1)*N//count): the largest i with i*N//count <= row
    lo, hi = 0, count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if shard_range(num_rows, mid, count)[0] <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _read_ids(part: PartRef, n: int) -> tuple[pa.Array, np.ndarray, int]:
    """(ids, sample_index, error_rows) of one part."""
    try:
        schema = pq.read_schema(part.path)
        cols = ["id"] + (["sample_index"] if "sample_index" in schema.names else [])
        cols += ["status"] if "status" in schema.names else []
        t = pq.read_table(part.path, columns=cols)
    except (OSError, pa.ArrowException) as e:
        raise MergeError(f"cannot read part {str(part.path)!r} (listed in the manifest): {e}") from e
    ids = _plain(t.column("id"))
    if "sample_index" in t.column_names:
        samples = _plain(t.column("sample_index")).to_numpy(zero_copy_only=False).astype(np.int64)
    elif n == 1:
        samples = np.zeros(len(ids), dtype=np.int64)
    else:
        raise MergeError(f"part {str(part.path)!r} has no sample_index column but the job ran with n={n}")
    errors = int(pc.sum(pc.equal(t.column("status"), "error")).as_py() or 0) if "status" in cols else 0
    return ids, samples, errors


def _part_keys(
    ids: pa.Array,
    samples: np.ndarray,
    part: PartRef,
    expected_ids: pa.Array,
    n: int,
    canon: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Flat keys (input position * n + sample) of a part's rows, the mask of rows with unknown ids, and
    whether the part is laid out as the writer lays it out (its rows are input rows row_start..row_end-1).

    Fast path (batchgen's writer): the part holds rows row_start..row_end-1 in order, n samples each, and
    its ids equal the input's ids at those positions: no hashing. Otherwise every id is looked up.
    `canon` maps an input position to the first position holding the same id (None: ids are distinct).
    """
    num = len(ids)
    if (
        num == (part.row_end - part.row_start) * n
        and 0 <= part.row_start
        and part.row_end <= len(expected_ids)
    ):
        ar = np.arange(num, dtype=np.int64)
        pos = part.row_start + ar // n
        if np.array_equal(samples, ar % n) and ids.equals(
            expected_ids.slice(part.row_start, part.row_end - part.row_start).take(pa.array(ar // n))
        ):
            if canon is not None:
                pos = canon[pos]
            return pos * n + samples, np.zeros(num, dtype=bool), True
    found = pc.index_in(ids, value_set=expected_ids)
    known = found.is_valid().to_numpy(zero_copy_only=False)
    pos = found.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    unknown = ~known | (samples < 0) | (samples >= n)
    return (pos * n + samples)[~unknown], unknown, False


@dataclass
class _Expected:
    """What the input says the output must hold."""

    ids: pa.Array
    """The input's ids in input order."""
    input_used: str | None
    canon: np.ndarray | None
    """Input position → first position holding the same id (None: the ids are distinct)."""
    mult: np.ndarray
    """Times each (canonical) input position is expected per sample: an id that occurs k times, k times."""


def _expected(m0: Manifest, input_spec: str | None) -> _Expected:
    ids, input_used = input_ids(m0, input_spec)
    num_rows = len(ids)
    if (m0.config.get("data") or {}).get("id_column") is None:  # ids 0..N-1, all distinct
        return _Expected(ids, input_used, None, np.ones(num_rows, dtype=np.int32))
    canon = pc.index_in(ids, value_set=ids).to_numpy(zero_copy_only=False).astype(np.int64)
    mult = np.bincount(canon, minlength=num_rows).astype(np.int32)
    return _Expected(ids, input_used, None if np.all(mult == 1) else canon, mult)


@dataclass
class _Tally:
    """Counts of every expected (input position, sample) found in the parts, and what else was seen."""

    counts: np.ndarray
    unknown: int = 0
    unknown_examples: list[Problem] = field(default_factory=list)
    output_rows: int = 0
    error_rows: int = 0
    parts: int = 0
    in_order: bool = True
    last_end: int = 0


def _cast_ids(ids: pa.Array, target: pa.DataType, part: PartRef) -> pa.Array:
    if ids.type == target:
        return ids
    try:
        return ids.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise MergeError(
            f"part {str(part.path)!r}: id type {ids.type} does not match the input's {target}"
        ) from e


def _tally_part(t: _Tally, shard: Shard, part: PartRef, exp: _Expected, n: int, max_examples: int) -> None:
    if not part.path.is_file():
        raise MergeError(f"{str(part.path)!r} is listed in {str(shard.path / MANIFEST_NAME)!r} but missing")
    ids, samples, errors = _read_ids(part, n)
    t.parts += 1
    t.output_rows += len(ids)
    t.error_rows += errors
    if part.row_start < t.last_end:
        t.in_order = False
    t.last_end = max(t.last_end, part.row_end)
    if len(ids) == 0:
        return
    ids = _cast_ids(ids, exp.ids.type, part)
    keys, unknown, fast = _part_keys(ids, samples, part, exp.ids, n, exp.canon)
    if unknown.any():
        t.unknown += int(unknown.sum())
        for i in np.flatnonzero(unknown)[: max(0, max_examples - len(t.unknown_examples))]:
            t.unknown_examples.append(Problem(_py(ids[int(i)].as_py()), int(samples[i]) if n > 1 else None))
    t.in_order = t.in_order and fast
    if keys.size:
        np.add.at(t.counts.reshape(-1), keys, 1)


def _examples(
    mask: np.ndarray, counts: np.ndarray | None, exp: _Expected, n: int, count: int, max_examples: int
) -> list[Problem]:
    """Problems for the first `max_examples` flat keys set in `mask` (with their count when given)."""
    out = []
    num_rows = len(exp.ids)
    for k in np.flatnonzero(mask)[:max_examples]:
        row = int(k) // n
        out.append(
            Problem(
                id=_py(exp.ids[row].as_py()),
                sample_index=int(k) % n if n > 1 else None,
                row=row,
                shard=_shard_of(row, num_rows, count),
                count=int(counts[k]) if counts is not None else None,
            )
        )
    return out


def verify(output: str | os.PathLike, input_spec: str | None = None, max_examples: int = 10) -> MergeReport:
    """Check the coverage of the job output under `output` (see the module docstring)."""
    shards = find_shards(output)
    m0, count = shards[0].manifest, shards[0].count
    n = int((m0.config.get("sampling") or {}).get("n", 1) or 1)
    exp = _expected(m0, input_spec)
    t = _Tally(np.zeros((len(exp.ids), n), dtype=np.int32))
    for s in shards:
        for part in s.parts:
            _tally_part(t, s, part, exp, n, max_examples)

    counts = t.counts.reshape(-1)
    expected = np.broadcast_to(exp.mult[:, None], t.counts.shape).reshape(-1)
    missing, duplicated = counts < expected, counts > expected
    found = [s.index for s in shards]
    return MergeReport(
        output_dir=str(output),
        input=exp.input_used or m0.input.get("spec"),
        id_column=(m0.config.get("data") or {}).get("id_column"),
        shard_count=count,
        shards_found=found,
        shards_missing=[i for i in range(count) if i not in found],
        shards_incomplete={
            s.index: f"{len(s.manifest.windows)}/{s.manifest.num_windows} windows"
            for s in shards
            if not s.manifest.complete
        },
        input_rows=len(exp.ids),
        samples_per_row=n,
        expected_rows=int(expected.sum()),
        output_rows=t.output_rows,
        error_rows=t.error_rows,
        missing=int((expected - counts)[missing].sum()),
        duplicated=int((counts - expected)[duplicated].sum()),
        unknown=t.unknown,
        input_duplicate_ids=int(len(exp.ids) - np.count_nonzero(exp.mult)),
        missing_examples=_examples(missing, None, exp, n, count, max_examples),
        duplicated_examples=_examples(duplicated, counts, exp, n, count, max_examples),
        unknown_examples=t.unknown_examples,
        parts=t.parts,
        in_order=t.in_order,
    )


# ----------------------------------------------------------------------------------------------- write
def _merged_metadata(part_schema: pa.Schema, report: MergeReport) -> dict[bytes, bytes]:
    meta = dict(part_schema.metadata or {})
    try:
        d = json.loads(meta.get(METADATA_KEY, b"{}"))
    except ValueError:
        d = {}
    d.pop("window", None)
    d["shard"] = {"index": None, "count": report.shard_count, "merged": True}
    d["merged"] = {"rows": report.output_rows, "complete": report.ok}
    meta[METADATA_KEY] = json.dumps(d, sort_keys=True).encode()
    return meta


def _sorted_by_input(t: pa.Table, ids: pa.Array, n: int) -> pa.Table:
    """`t`'s rows in input order (by the input position of each id, then sample_index)."""
    pos = pc.index_in(_plain(t.column("id")).cast(ids.type), value_set=ids)
    pos = pos.fill_null(len(ids)).to_numpy(zero_copy_only=False).astype(np.int64)
    samp = (
        t.column("sample_index").to_numpy().astype(np.int64)
        if "sample_index" in t.column_names
        else np.zeros(t.num_rows, np.int64)
    )
    return t.take(pa.array(np.argsort(pos * n + samp, kind="stable")))


def write_merged(
    output: str | os.PathLike, dest: str | os.PathLike, report: MergeReport, input_spec: str | None = None
) -> int:
    """Write every shard's rows, in input order, to the Parquet file `dest` (atomically). Returns rows."""
    shards = find_shards(output)
    parts = [p for s in shards for p in s.parts]
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not parts:
        raise MergeError("no finished part to merge")
    schema0 = pq.read_schema(parts[0].path)
    schema = pa.schema(list(schema0), metadata=_merged_metadata(schema0, report))

    def load(p: PartRef) -> pa.Table:
        t = pq.read_table(p.path).replace_schema_metadata(None)
        t = t if t.schema.equals(schema, check_metadata=False) else t.cast(schema.remove_metadata())
        return t.replace_schema_metadata(schema.metadata)

    rows = 0
    with atomic_write(dest) as tmp, pq.ParquetWriter(tmp, schema, compression="zstd") as w:
        if report.in_order:
            for p in parts:  # streaming: one part in memory at a time
                t = load(p)
                w.write_table(t)
                rows += t.num_rows
        else:  # not expected from batchgen's writer; sort everything by input position
            ids, _ = input_ids(shards[0].manifest, input_spec)
            t = _sorted_by_input(pa.concat_tables([load(p) for p in parts]), ids, report.samples_per_row)
            w.write_table(t)
            rows = t.num_rows
    return rows
