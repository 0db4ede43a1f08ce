"""Writing a run's output: a finished window becomes one part file (its checkpointed rows folded in) and a
manifest record; the finished rows of unfinished windows are checkpointed."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from batchgen.data.manifest import WindowRecord
from batchgen.data.output_dir import OutputDir
from batchgen.data.parts import assemble_part, build_rows
from batchgen.job.feeder import WindowWork
from batchgen.job.plan import JobPlan
from batchgen.job.tally import window_adapter_rows

logger = logging.getLogger("batchgen.job")


class PartWriter:
    """Commits windows and checkpoints rows into ``outdir``; counts what this run saved (``windows_done``;
    ``rows_done``: rows committed in parts or checkpointed, each row once). ``last_checkpoint``: ``time.monotonic()`` of the last checkpoint (or of
    the start of the run)."""

    def __init__(self, plan: JobPlan, outdir: OutputDir, last_checkpoint: float) -> None:
        self.plan, self.outdir = plan, outdir
        self.last_checkpoint = last_checkpoint
        self.windows_done = 0
        self.rows_done = 0

    def commit(self, work: WindowWork) -> None:
        """Window ``work`` (every row finished) as its part file and manifest record, atomically."""
        layout, spec = self.plan.part_layout, work.spec
        fresh = build_rows(layout, work.rows, work.results, work.extra, only=work.todo_positions)
        meta = {"index": spec.index, "row_start": spec.row_start, "row_end": spec.row_end}
        table, st = assemble_part(layout, [*work.pieces, fresh], spec.num_rows, meta)
        record = WindowRecord(  # the part's stats (PartStats) are the record's counts, field for field
            part="",
            row_start=spec.row_start,
            row_end=spec.row_end,
            wall_time_s=round(work.finished_at - work.started_at, 3),
            input_sha256=work.input_sha256,
            **asdict(st),
        )
        if self.plan.cfg.model.lora_modules:  # rows per adapter, summed over runs by the report
            status = table.column("status").to_pylist()
            n = layout.n
            ok = [all(s == "ok" for s in status[p * n : (p + 1) * n]) for p in range(spec.num_rows)]
            record.rows_by_adapter = window_adapter_rows([r.lora_name for r in work.rows], ok)
        self.outdir.commit(spec.index, table, record)
        self.windows_done += 1
        self.rows_done += len(work.todo_positions) - len(work.checkpointed)  # those were counted then

    def checkpoint_due(self) -> bool:
        """Whether ``run.checkpoint_interval_s`` (> 0) has passed since the last checkpoint."""
        interval = self.plan.cfg.run.checkpoint_interval_s
        return interval > 0 and time.monotonic() - self.last_checkpoint >= interval

    def checkpoint(self, works: list[WindowWork]) -> int:
        """Write the rows finished (and not yet checkpointed) of unfinished windows; returns how many."""
        self.last_checkpoint = time.monotonic()
        total = windows = 0
        for work in sorted(works, key=lambda w: w.spec.index):
            new = [p for p in work.finished_positions() if p not in work.checkpointed]
            if not new:
                continue
            piece = build_rows(self.plan.part_layout, work.rows, work.results, work.extra, only=new)
            ok = sum(
                1
                for p in new
                if work.rows[p].error is None and not (work.results[p] and work.results[p].error)  # type: ignore[union-attr]
            )
            self.outdir.write_checkpoint(work.spec.index, piece, len(new), ok, work.input_sha256)
            work.checkpointed.update(new)
            total += len(new)
            windows += 1
            self.rows_done += len(new)
        if total:
            logger.info("checkpointed %d finished row(s) of %d unfinished window(s)", total, windows)
        return total
