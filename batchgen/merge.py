"""``batchgen-merge``: check that a job's shards cover every input row exactly once; merge them.

    batchgen-merge OUT/                             # verify: every input id present exactly once (per sample)
    batchgen-merge OUT/ --write OUT/merged.parquet  # ... and write one Parquet file in input order
    batchgen-merge OUT/ --input /data/prompts/      # the input, when the recorded path does not resolve here

OUT is a job's ``data.output``: either one output directory (``data.shard.count=1``) or the parent of
``shard-IIIII-of-NNNNN/`` directories (a Slurm array or a Hydra sweep). Only parts listed in a shard's
``manifest.json`` count (a part without a manifest entry is an unfinished leftover and is ignored).

The expected ids are re-enumerated from the input: the global row index ``0..N-1`` when the job ran
without ``data.id_column`` (the input is not read then, only its row count from the manifest), else that
column of the input files read in the job's order. With ``sampling.n > 1`` every (id, sample_index) is
expected once. The report gives counts and examples of missing, duplicated and unknown ids, missing and
unfinished shards, and rows whose ``status`` is ``error`` (those are covered: they are output rows).

Invariants:
- Exit status 0 only when nothing is missing, duplicated or unknown; 1 when something is; 2 when the
  output or input cannot be read (or shards of different configurations/inputs are mixed).
- ``--write`` produces the rows of every shard in input order (shard, then window, then row order, which
  the writer guarantees; sorted explicitly if it ever is not), written to a temporary name and renamed;
  it refuses to write an incomplete or duplicated merge unless ``--force``.
- Memory: verification holds the id columns only; writing streams one part at a time (in order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.manifest import MANIFEST_NAME, Manifest
from batchgen.data.reader import InputError, open_input, shard_range
from batchgen.data.writer import METADATA_KEY, SHARD_RE

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_ERROR = 2


class MergeError(Exception):
    """The output or the input cannot be read as a batchgen job output (exit status 2)."""


# --------------------------------------------------------------------------------------------- discovery
@dataclass
class PartRef:
    """A finished window of a shard: its part file and global row range."""

    shard: int
    window: int
    path: Path
    row_start: int
    row_end: int


@dataclass
class Shard:
    """One shard's output directory and its manifest."""

    path: Path
    index: int
    count: int
    manifest: Manifest

    @property
    def parts(self) -> list[PartRef]:
        return [
            PartRef(self.index, w, self.path / r.part, r.row_start, r.row_end)
            for w, r in sorted(self.manifest.windows.items())
        ]


def find_shards(output: str | os.PathLike) -> list[Shard]:
    """The shards under `output`, sorted by index. Raises MergeError when there are none or they mix."""
    root = Path(output)
    if not root.is_dir():
        raise MergeError(f"{str(root)!r} is not a directory")
    dirs: list[Path] = []
    if (root / MANIFEST_NAME).is_file():
        dirs.append(root)
    dirs += sorted(p for p in root.iterdir() if p.is_dir() and SHARD_RE.match(p.name))
    if not dirs:
        raise MergeError(
            f"{str(root)!r} holds no batchgen output (no {MANIFEST_NAME} and no shard-IIIII-of-NNNNN/ directory)"
        )
    shards: list[Shard] = []
    for d in dirs:
        try:
            m = Manifest.load(d)
        except (ValueError, KeyError, TypeError) as e:
            raise MergeError(f"{str(d / MANIFEST_NAME)!r} is unreadable: {e}") from e
        if m is None:
            raise MergeError(f"{str(d)!r} has no {MANIFEST_NAME} (the shard never started writing)")
        shards.append(Shard(d, int(m.shard.get("index", 0)), int(m.shard.get("count", 1)), m))
    first = shards[0].manifest
    for s in shards[1:]:
        m = s.manifest
        if s.count != shards[0].count:
            raise MergeError(
                f"{str(root)!r} mixes shard layouts ({shards[0].count} and {s.count} shards); "
                "merge the output of one job only"
            )
        if m.fingerprint != first.fingerprint or m.window_rows != first.window_rows:
            raise MergeError(
                f"{str(s.path)!r} was written with another configuration than {str(shards[0].path)!r}"
            )
        if m.input.get("fingerprint") != first.input.get("fingerprint"):
            raise MergeError(
                f"{str(s.path)!r} was written from other input data than {str(shards[0].path)!r}"
            )
    seen: dict[int, Path] = {}
    for s in shards:
        if s.index in seen:
            raise MergeError(f"shard {s.index} appears twice: {str(seen[s.index])!r} and {str(s.path)!r}")
        seen[s.index] = s.path
    return sorted(shards, key=lambda s: s.index)


# ----------------------------------------------------------------------------------------------- input
def _plain(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], type=arr.type)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


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
    chunks = []
    for f in inp.files:
        t = pq.read_table(f.path, columns=[id_column])
        chunks.append(_plain(t.column(id_column)))
    if not chunks:
        return pa.array([], type=pa.int64()), spec
    target = chunks[0].type
    return pa.concat_arrays([c.cast(target) if c.type != target else c for c in chunks]), spec


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


def verify(output: str | os.PathLike, input_spec: str | None = None, max_examples: int = 10) -> MergeReport:
    """Check the coverage of the job output under `output` (see the module docstring)."""
    shards = find_shards(output)
    m0 = shards[0].manifest
    count = shards[0].count
    n = int((m0.config.get("sampling") or {}).get("n", 1) or 1)
    id_column = (m0.config.get("data") or {}).get("id_column")
    expected_ids, input_used = input_ids(m0, input_spec)
    num_rows = len(expected_ids)

    # Canonical position of each input id = its first occurrence; an id that occurs k times in the input
    # is expected k times per sample. Without an id column the ids are 0..N-1, all distinct.
    canon: np.ndarray | None = None
    if id_column is None:
        mult = np.ones(num_rows, dtype=np.int32)
    else:
        canon = pc.index_in(expected_ids, value_set=expected_ids).to_numpy(zero_copy_only=False)
        canon = canon.astype(np.int64)
        mult = np.bincount(canon, minlength=num_rows).astype(np.int32)
        if np.all(mult == 1):
            canon = None  # ids are distinct: position == canonical position
    input_dups = int(num_rows - np.count_nonzero(mult))
    counts = np.zeros((num_rows, n), dtype=np.int32)

    unknown_total = 0
    unknown_ex: list[Problem] = []
    output_rows = error_rows = nparts = 0
    last_end = 0
    in_order = True
    for s in shards:
        for part in s.parts:
            if not part.path.is_file():
                raise MergeError(
                    f"{str(part.path)!r} is listed in {str(s.path / MANIFEST_NAME)!r} but missing"
                )
            ids, samples, errs = _read_ids(part, n)
            nparts += 1
            output_rows += len(ids)
            error_rows += errs
            if part.row_start < last_end:
                in_order = False
            last_end = max(last_end, part.row_end)
            if len(ids) == 0:
                continue
            if ids.type != expected_ids.type:
                try:
                    ids = ids.cast(expected_ids.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise MergeError(
                        f"part {str(part.path)!r}: id type {ids.type} does not match the input's {expected_ids.type}"
                    ) from e
            keys, unknown, fast = _part_keys(ids, samples, part, expected_ids, n, canon)
            if unknown.any():
                unknown_total += int(unknown.sum())
                for i in np.flatnonzero(unknown)[: max(0, max_examples - len(unknown_ex))]:
                    unknown_ex.append(Problem(_py(ids[int(i)].as_py()), int(samples[i]) if n > 1 else None))
            in_order = in_order and fast
            if keys.size:
                np.add.at(counts.reshape(-1), keys, 1)

    expected = np.broadcast_to(mult[:, None], counts.shape)

    def examples(mask: np.ndarray, with_count: bool) -> list[Problem]:
        out = []
        for k in np.flatnonzero(mask)[:max_examples]:
            row = int(k) // n
            out.append(
                Problem(
                    id=_py(expected_ids[row].as_py()),
                    sample_index=int(k) % n if n > 1 else None,
                    row=row,
                    shard=_shard_of(row, num_rows, count),
                    count=int(flat_counts[k]) if with_count else None,
                )
            )
        return out

    missing_mask = (counts < expected).reshape(-1)
    dup_mask = (counts > expected).reshape(-1)
    flat_counts = counts.reshape(-1)
    flat_expected = expected.reshape(-1)
    found = [s.index for s in shards]
    incomplete = {
        s.index: f"{len(s.manifest.windows)}/{s.manifest.num_windows} windows"
        for s in shards
        if not s.manifest.complete
    }
    return MergeReport(
        output_dir=str(output),
        input=input_used or m0.input.get("spec"),
        id_column=id_column,
        shard_count=count,
        shards_found=found,
        shards_missing=[i for i in range(count) if i not in found],
        shards_incomplete=incomplete,
        input_rows=num_rows,
        samples_per_row=n,
        expected_rows=int(expected.sum()),
        output_rows=output_rows,
        error_rows=error_rows,
        missing=int((flat_expected - flat_counts)[missing_mask].sum()),
        duplicated=int((flat_counts - flat_expected)[dup_mask].sum()),
        unknown=unknown_total,
        input_duplicate_ids=input_dups,
        missing_examples=examples(missing_mask, False),
        duplicated_examples=examples(dup_mask, True),
        unknown_examples=unknown_ex,
        parts=nparts,
        in_order=in_order,
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
        return t if t.schema.equals(schema, check_metadata=False) else t.cast(schema.remove_metadata())

    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{dest.name}.", dir=dest.parent)
    os.close(fd)
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as w:
            if report.in_order:
                for p in parts:  # streaming: one part in memory at a time
                    t = load(p)
                    w.write_table(t.replace_schema_metadata(schema.metadata))
                    rows += t.num_rows
            else:  # not expected from batchgen's writer; sort everything by input position
                m0 = shards[0].manifest
                n = report.samples_per_row
                ids, _ = input_ids(m0, input_spec)
                t = pa.concat_tables([load(p) for p in parts])
                pos = pc.index_in(_plain(t.column("id")).cast(ids.type), value_set=ids)
                pos = pos.fill_null(len(ids)).to_numpy(zero_copy_only=False).astype(np.int64)
                samp = (
                    t.column("sample_index").to_numpy().astype(np.int64)
                    if "sample_index" in t.column_names
                    else np.zeros(t.num_rows, np.int64)
                )
                t = t.take(pa.array(np.argsort(pos * n + samp, kind="stable")))
                w.write_table(t.replace_schema_metadata(schema.metadata))
                rows = t.num_rows
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return rows


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------------------------- CLI
def _fmt_problem(p: Problem) -> str:
    s = f"id={p.id!r}"
    if p.sample_index is not None:
        s += f" sample_index={p.sample_index}"
    if p.row is not None:
        s += f" (input row {p.row}, shard {p.shard})"
    if p.count is not None:
        s += f" x{p.count}"
    return s


def format_report(r: MergeReport) -> str:
    lines = [
        f"output:   {r.output_dir}",
        f"input:    {r.input or '?'} ({r.input_rows} rows; ids: {r.id_column or 'global row index'})",
        f"shards:   {len(r.shards_found)}/{r.shard_count} present, {r.parts} part(s), "
        + (f"{len(r.shards_incomplete)} unfinished" if r.shards_incomplete else "all finished"),
    ]
    if r.shards_missing:
        shown = ", ".join(str(i) for i in r.shards_missing[:20]) + (
            " ..." if len(r.shards_missing) > 20 else ""
        )
        lines.append(f"          missing shard(s): {shown}")
    for i, what in list(r.shards_incomplete.items())[:20]:
        lines.append(f"          shard {i} unfinished: {what}")
    per = f" x {r.samples_per_row} samples" if r.samples_per_row > 1 else ""
    lines.append(
        f"rows:     {r.output_rows} output / {r.expected_rows} expected ({r.input_rows} input rows{per}); "
        f"{r.error_rows} with status=error"
    )
    if r.input_duplicate_ids:
        lines.append(
            f"note:     the input's id column repeats ids ({r.input_duplicate_ids} extra occurrences)"
        )
    for name, num, ex in (
        ("missing", r.missing, r.missing_examples),
        ("duplicated", r.duplicated, r.duplicated_examples),
        ("unknown", r.unknown, r.unknown_examples),
    ):
        if num:
            lines.append(f"{name + ':':10}{num} row(s), e.g. " + "; ".join(_fmt_problem(p) for p in ex))
    lines.append(
        "OK: every input row is covered exactly once"
        if r.ok
        else "FAILED: "
        + ", ".join(
            f"{k} {v}"
            for k, v in (("missing", r.missing), ("duplicated", r.duplicated), ("unknown", r.unknown))
            if v
        )
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchgen-merge",
        description="Verify that the shards of a batchgen job cover every input row exactly once "
        "(missing / duplicated / unknown ids), and optionally merge them into one Parquet file in input order.",
        epilog="Exit status: 0 complete and duplicate-free; 1 rows missing, duplicated or unknown; "
        "2 the output or input cannot be read.",
    )
    p.add_argument(
        "output", help="the job's data.output (one output dir, or the parent of shard-*-of-*/ dirs)"
    )
    p.add_argument(
        "--input",
        help="the job's input (file, directory or glob), when the path recorded in the manifest does not resolve here",
    )
    p.add_argument("--write", metavar="FILE", help="write every row, in input order, to this Parquet file")
    p.add_argument(
        "--force", action="store_true", help="with --write: write even when rows are missing or duplicated"
    )
    p.add_argument("--max-examples", type=int, default=10, help="examples listed per problem (default 10)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns (and exits with) the exit status."""
    args = build_parser().parse_args(argv)
    try:
        report = verify(args.output, args.input, args.max_examples)
        written = None
        if args.write:
            if not report.ok and not args.force:
                print(
                    format_report(report)
                    if not args.json
                    else json.dumps(report.to_dict(), indent=1, default=str)
                )
                print(
                    f"not writing {args.write}: the output is incomplete or duplicated (use --force)",
                    file=sys.stderr,
                )
                return _exit(EXIT_INCOMPLETE, argv)
            n = write_merged(args.output, args.write, report, args.input)
            written = (args.write, n)
    except MergeError as e:
        print(f"batchgen-merge: error: {e}", file=sys.stderr)
        return _exit(EXIT_ERROR, argv)
    if args.json:
        d = report.to_dict()
        if written:
            d["written"] = {"path": written[0], "rows": written[1]}
        print(json.dumps(d, indent=1, default=str))
    else:
        print(format_report(report))
        if written:
            print(f"wrote {written[1]} rows to {written[0]}")
    return _exit(EXIT_OK if report.ok else EXIT_INCOMPLETE, argv)


def _exit(code: int, argv: Sequence[str] | None) -> int:
    if argv is None:  # console script
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
