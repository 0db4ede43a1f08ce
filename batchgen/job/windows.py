"""The windows a run works on, read from the input into :class:`~batchgen.job.feeder.WindowWork`: prompts
built, the rows already done skipped (their output rows loaded as pieces of the part to come)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.data.output_dir import OutputDir
from batchgen.data.part_roll import PartRoller
from batchgen.data.parts import part_as_piece
from batchgen.data.prompts import build_prompts
from batchgen.data.reader import Window, iter_windows
from batchgen.data.values import sanitize_utf8, window_sha256
from batchgen.job.feeder import WindowWork
from batchgen.job.plan import JobPlan
from batchgen.job.resume import WindowTodo


def iter_window_work(
    plan: JobPlan,
    outdir: OutputDir,
    todo: Iterable[WindowTodo],
    tokenizer_ref: list[Any],
    roller: PartRoller,
) -> Iterator[WindowWork]:
    """Each window of ``todo`` (ascending, consumed lazily) as a WindowWork, its prompts built with
    ``tokenizer_ref[0]`` (read when the window is: the caller may swap the tokenizer between windows)."""
    pending: deque[WindowTodo] = deque()  # the todos handed to the reader and not yet read: one or two

    def specs() -> Iterator[Any]:
        for t in todo:
            pending.append(t)
            yield t.spec

    extra_cols = list(dict.fromkeys([f.name for f in plan.part_layout.kept] + (
        [plan.cfg.data.id_column] if plan.cfg.data.id_column else [])))  # fmt: skip
    for win in iter_windows(plan.input, specs(), plan.columns, schema=plan.read_schema):
        t = pending.popleft()
        while t.spec.index != win.index:  # an empty window (never read)
            t = pending.popleft()
        yield _window_work(plan, outdir, roller, win, t, tokenizer_ref[0], extra_cols)


def _window_work(
    plan: JobPlan,
    outdir: OutputDir,
    roller: PartRoller,
    win: Window,
    t: WindowTodo,
    tokenizer: Any,
    extra_cols: list[str],
) -> WindowWork:
    pieces = _pieces_done(plan, outdir, roller, win.index, t)
    done: set[int] = set()
    for p in pieces:
        done.update(p.column("_position").to_pylist())
    rows = build_prompts(win.table, win.spec.row_start, plan.prompt_spec, tokenizer, win.unreadable)
    extra = win.table.select(extra_cols) if extra_cols else None
    for i, name in enumerate(extra_cols):
        # the id and kept columns are copied into the output as they are, except text that is not UTF-8:
        # its row is an error row, and the value is written with U+FFFD for the bad bytes (readable)
        fixed, bad = sanitize_utf8(extra.column(i))  # type: ignore[union-attr]
        if bad:
            extra = extra.set_column(i, name, fixed)  # type: ignore[union-attr]
            for pos, byte in bad.items():
                r = rows[pos]
                r.fail(f"column {name!r} is not valid UTF-8 at byte {byte}")
                r.token_ids = r.params = None
    work = WindowWork.create(win.spec, rows, plan.cfg.data.group_by_prefix, extra=extra, skip=frozenset(done))
    work.pieces = pieces
    work.input_sha256 = None if win.unreadable else window_sha256(win.table)
    return work


def _pieces_done(
    plan: JobPlan, outdir: OutputDir, roller: PartRoller, window: int, t: WindowTodo
) -> list[pa.Table]:
    """The output rows of ``window`` already done: the part's rows kept when retrying its error rows, and the
    checkpointed rows (less the retryable error rows with ``data.retry_errors``)."""
    pieces: list[pa.Table] = []
    if t.retry_part:
        part = part_as_piece(roller.window_table(window), plan.cfg.sampling.n)
        retry = set(t.retry_rows)
        keep = [i for i, p in enumerate(part.column("_position").to_pylist()) if p not in retry]
        pieces.append(part.take(pa.array(keep, type=pa.int64())))
    for piece in outdir.checkpoint_pieces(window):
        if plan.cfg.data.retry_errors:  # checkpointed error rows caused by settings are recomputed too
            piece = piece.filter(pc.invert(piece.column("_retryable")))
        pieces.append(piece)
    return pieces
