"""``batchgen-merge``: check that a job's shards cover every input row exactly once; merge them.

    batchgen-merge OUT/                             # verify: every input id present exactly once (per sample)
    batchgen-merge OUT/ --write merged.parquet      # ... and write one Parquet file in input order
    batchgen-merge OUT/ --input /data/prompts/      # the input, when the recorded path does not resolve here

OUT is a job's ``data.output`` (:mod:`batchgen.job.shards`); the checks are :func:`batchgen.job.merge.verify`.

Exit status: 0 only when nothing is missing, duplicated or unknown; 1 when something is; 2 when the output
or input cannot be read (or shards of different configurations/inputs are mixed). ``--write`` refuses to
write an incomplete or duplicated merge unless ``--force``, and refuses a file inside OUT (exit 2): OUT is a
dataset (``pyarrow.parquet.read_table(OUT)``, ``OUT/**/*.parquet``) whose readers would read its rows twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from batchgen.data.storage import is_url
from batchgen.errors import ConfigError
from batchgen.job.merge import MergeReport, Problem, verify, write_merged
from batchgen.job.remote_stage import put_file, staged_output
from batchgen.job.result import one_line
from batchgen.job.shards import MergeError

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_ERROR = 2


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


def _print(report: MergeReport, as_json: bool, written: tuple[str, int] | None = None) -> None:
    if as_json:
        d = report.to_dict()
        if written:
            d["written"] = {"path": written[0], "rows": written[1]}
        print(json.dumps(d, indent=1, default=str))
    else:
        print(format_report(report))
        if written:
            print(f"wrote {written[1]} rows to {written[0]}")


def _inside(dest: str, output: str) -> bool:
    if is_url(dest) or is_url(output):
        return dest.rstrip("/") == output.rstrip("/") or dest.startswith(output.rstrip("/") + "/")
    d, o = Path(dest).resolve(), Path(output).resolve()
    return d == o or o in d.parents


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns (and exits with) the exit status."""
    args = build_parser().parse_args(argv)
    if args.write and _inside(args.write, args.output):
        print(
            f"batchgen-merge: error: --write {args.write} lies inside the output directory {args.output}: dataset "
            f"readers of {args.output} (pyarrow.parquet.read_table, {args.output.rstrip('/')}/**/*.parquet) would "
            "read its rows twice; write it outside, e.g. --write "
            f"{Path(args.output.rstrip('/') or '.').name or 'out'}.merged.parquet beside it",
            file=sys.stderr,
        )
        return _exit(EXIT_ERROR, argv)
    try:
        with contextlib.ExitStack() as stack:
            return _verify_and_write(args, argv, stack)
    except (MergeError, ConfigError) as e:
        print(f"batchgen-merge: error: {e}", file=sys.stderr)
        return _exit(EXIT_ERROR, argv)


def _verify_and_write(
    args: argparse.Namespace, argv: Sequence[str] | None, stack: contextlib.ExitStack
) -> int:
    """Verify (and write) the output; a URL output is read from a local copy (:mod:`.remote_stage`), a URL
    --write is written locally and put as one object."""
    output, dest = args.output, args.write
    if is_url(output):
        output = str(stack.enter_context(staged_output(args.output)))
    if dest and is_url(dest):
        dest = str(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "merged.parquet")
    try:
        report = verify(output, args.input, args.max_examples)
        report.output_dir = args.output
        if args.write and not report.ok and not args.force:
            _print(report, args.json)
            print(
                f"not writing {args.write}: the output is incomplete or duplicated (use --force)",
                file=sys.stderr,
            )
            return _exit(EXIT_INCOMPLETE, argv)
        written = (args.write, write_merged(output, dest, report, args.input)) if args.write else None
        if written and dest != args.write:
            put_file(dest, args.write)
    except MergeError as e:
        print(f"batchgen-merge: error: {e}", file=sys.stderr)
        return _exit(EXIT_ERROR, argv)
    except (OSError, pa.ArrowException) as e:  # a file that cannot be read: one line, exit 2
        print(f"batchgen-merge: error: cannot read the output or the input: {one_line(e)}", file=sys.stderr)
        return _exit(EXIT_ERROR, argv)
    _print(report, args.json, written)
    return _exit(EXIT_OK if report.ok else EXIT_INCOMPLETE, argv)


def _exit(code: int, argv: Sequence[str] | None) -> int:
    if argv is None:  # console script
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
