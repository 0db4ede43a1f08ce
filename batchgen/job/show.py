"""``batchgen show OUT``: print the first rows of an output directory (or one part file) readably."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any

from batchgen.data.storage import redact_url
from batchgen.errors import ConfigError

_SHOWN_FIRST = ("id", "sample_index", "status", "finish_reason", "num_prompt_tokens", "num_generated_tokens")
_HIDDEN = ("token_ids", "logprobs")


def read_rows(output: str | Path, limit: int) -> tuple[list[dict[str, Any]], int]:
    """The first ``limit`` output rows (in part order) and the number of rows in the output."""
    import pyarrow.dataset as ds

    from batchgen.data.storage import Location, is_url

    if is_url(output):  # an object-store output: the same dataset, through the store's filesystem
        loc = Location(str(output), key="output")
        data = ds.dataset(loc.root, filesystem=loc.fs, format="parquet", ignore_prefixes=["_", "."])
        return data.head(limit).to_pylist(), data.count_rows()
    path = Path(output)
    if not path.exists():
        raise FileNotFoundError(f"{output}: no such output directory or file")
    data = ds.dataset(str(path), format="parquet", ignore_prefixes=["_", "."])
    return data.head(limit).to_pylist(), data.count_rows()


def _clip(value: Any, width: int) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = text.replace("\n", "⏎ ")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_rows(rows: list[dict[str, Any]], width: int = 100) -> str:
    """One block per row: the short columns (ids, status, counts) on one line, then each text column wrapped
    and clipped to three lines. Token ids and logprobs are left out."""
    blocks = []
    for row in rows:
        short = [k for k in _SHOWN_FIRST if k in row] + [
            k for k, v in row.items() if k not in _SHOWN_FIRST and not isinstance(v, (str, list, dict))
        ]
        lines = ["  ".join(f"{k}={row[k]}" for k in short if k not in _HIDDEN and row[k] is not None)]
        for key, value in row.items():
            if key in short or key in _HIDDEN or value is None:
                continue
            body = textwrap.fill(
                _clip(value, 3 * width), width=width, initial_indent="    ", subsequent_indent="    "
            )
            lines.append(f"  {key}:\n{body}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv: list[str]) -> int:
    """Exit status 0, or 2 when the output cannot be read."""
    parser = argparse.ArgumentParser(
        prog="batchgen show", description="Print the first rows of a batchgen output."
    )
    parser.add_argument("output", help="output directory (data.output) or one part file")
    parser.add_argument("-n", "--rows", type=int, default=5, help="how many rows (default 5)")
    parser.add_argument("--width", type=int, default=100, help="text width (default 100)")
    args = parser.parse_args(argv)
    try:
        rows, total = read_rows(args.output, max(0, args.rows))
    except (OSError, ValueError, ConfigError) as e:
        print(f"batchgen show: cannot read {redact_url(args.output)}: {e}", file=sys.stderr)
        return 2
    print(format_rows(rows, args.width))
    print(
        f"\n({len(rows)} of {total} rows; read them all with pyarrow.parquet.read_table({str(args.output)!r}))"
    )
    return 0
