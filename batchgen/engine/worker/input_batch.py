"""Persistent input buffers of the model runner: the flat batch of one step built into preallocated arrays,
block tables kept per sequence across steps and rewritten only for sequences whose table changed.

**Block-table rows.** ``tables[r]`` is the block table of the sequence that owns row ``r`` (entries past its
length are 0). Rows belong to the sequences of the *previous* step: a step's build keeps the row of each of its
sequences, rewrites it unless :attr:`ScheduledSeq.table_unchanged` says the table is the one the row holds, hands
rows to its new sequences, and frees the rows of sequences not in it (finished, aborted, preempted, swapped out
or not scheduled: they get a fresh row, fully written, when they next run). So after every build:

    for every scheduled s: tables[row_of[s.seq.seq_id], :len(s.block_table)] == s.block_table, rest 0

which :meth:`InputBatch.check` asserts (the property tests call it after every step).

**Flat buffers.** Token ids, positions, slot mapping, sequence lengths, query offsets and the step's padded block
tables are written into preallocated numpy arrays (pinned host tensors on CUDA, copied with non-blocking copies
into preallocated device tensors). Two sets alternate step by step, so a step's inputs stay valid while the
next step is being prepared (the copies of step N are ordered before step N+1's on the device's stream). A
buffer too small for a step (more tokens or rows than the engine's caps) is regrown once, never shrunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from batchgen.attention import AttentionMetadata
from batchgen.engine.sched.output import ScheduledSeq, SchedulerOutput

TokenInputs = Callable[[list[ScheduledSeq], np.ndarray, torch.device], dict[str, Any]]
"""A feature's per-token model inputs for one step: ``(seqs, seq_idx, device)`` (``seq_idx``: each packed
token's index in ``seqs``) to ``ForwardContext`` keywords (none when no token of the step needs them)."""

_FLAT = ("ids", "pos", "slots")  # int64, one entry per token


class _BufferSet:
    """One set of flat input buffers: numpy views over host tensors (pinned on CUDA) and device twins."""

    @torch.inference_mode(
        False
    )  # plain tensors: written in place whether or not a step runs in inference mode
    def __init__(self, num_tokens: int, num_rows: int, width: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        sizes = {"ids": num_tokens, "pos": num_tokens, "slots": num_tokens, "lens": num_rows}
        sizes["cu"] = num_rows + 1
        self.host: dict[str, Tensor] = {}
        for name, n in sizes.items():
            dtype = torch.int64 if name in _FLAT else torch.int32
            self.host[name] = torch.zeros(n, dtype=dtype, pin_memory=pin)
        self.host["tables"] = torch.zeros(num_rows * width, dtype=torch.int32, pin_memory=pin)  # step-packed
        self.np = {k: v.numpy() for k, v in self.host.items()}
        self.dev = {k: v.to(device) for k, v in self.host.items()} if pin else self.host

    def tables(self, rows: int, cols: int) -> np.ndarray:
        """The step's ``[rows, cols]`` block tables, packed contiguously at the start of the buffer."""
        return self.np["tables"][: rows * cols].reshape(rows, cols)

    def tensor(self, name: str, n: int, cols: int | None = None) -> Tensor:
        """The first ``n`` entries (``[n, cols]`` packed rows of the tables) on the device."""
        size = n if cols is None else n * cols
        out = self.dev[name][:size]
        if self.dev is not self.host:  # CUDA: one non-blocking copy from the pinned buffer
            out.copy_(self.host[name][:size], non_blocking=True)
        return out if cols is None else out.view(n, cols)


@dataclass
class StepInputs:
    """What :meth:`InputBatch.build` returns: the runner's ``prepare_inputs`` result."""

    ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    last: Tensor
    context: dict[str, Any] = field(default_factory=dict)
    """The per-token model inputs of :attr:`InputBatch.token_inputs` (``ForwardInput.context``)."""


class InputBatch:
    """Persistent per-sequence block-table rows and double-buffered flat inputs (see the module docstring).

    ``width`` is the block-table width every row has room for (``ceil(max_model_len / block_size)``)."""

    def __init__(
        self, max_tokens: int, max_rows: int, width: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.width = width
        self.tables = np.zeros((max_rows, width), dtype=np.int32)
        self.row_lens = np.zeros(max_rows, dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self._sets = [_BufferSet(max_tokens, max_rows, width, device) for _ in range(2)]
        self._next = 0
        self.token_inputs: list[TokenInputs] = []
        """Features' per-token model inputs, built each step (each token's adapter slot when the engine serves
        adapters)."""
        self.rows_written = 0
        """Rows rewritten in the last build (0 in a steady decode step): the incremental work."""

    # ------------------------------------------------------------------------------------------ rows
    def _grow_rows(self, need: int) -> None:
        old = self.tables.shape[0]
        new = max(need, 2 * old)
        self.tables = np.concatenate([self.tables, np.zeros((new - old, self.width), np.int32)])
        self.row_lens = np.concatenate([self.row_lens, np.zeros(new - old, np.int64)])
        self.free_rows[:0] = range(new - 1, old - 1, -1)

    def _write_row(self, row: int, table: list[int]) -> None:
        n = len(table)
        if n > self.width:
            raise ValueError(f"block table of {n} blocks exceeds the runner's width of {self.width}")
        old = int(self.row_lens[row])
        self.tables[row, :n] = table
        if old > n:
            self.tables[row, n:old] = 0
        self.row_lens[row] = n

    def assign_rows(self, out: SchedulerOutput) -> np.ndarray:
        """Row of each of the step's sequences (rows rewritten where the table may have changed); frees the
        rows of the previous step's sequences that are not in this one."""
        seqs = out.seqs
        sids = [s.seq.seq_id for s in seqs]
        old = self.row_of
        rows = list(map(old.pop, sids, itertools.repeat(-1, len(sids))))
        free = self.free_rows
        free.extend(old.values())  # rows of sequences not in this step
        changed = [i for i, s in enumerate(seqs) if not s.table_unchanged or rows[i] < 0]
        for i in changed:
            if rows[i] < 0:
                if not free:
                    self._grow_rows(len(self.row_lens) + 1)
                rows[i] = free.pop()
            self._write_row(rows[i], seqs[i].block_table)
        self.row_of = dict(zip(sids, rows))
        self.rows_written = len(changed)
        return np.array(rows, dtype=np.int64)

    def check(self, out: SchedulerOutput) -> None:
        """Assert the row invariant of the module docstring for the last built step ``out``."""
        assert len(self.row_of) == len(out.seqs)
        assert len(set(self.row_of.values())) == len(self.row_of)
        assert not set(self.row_of.values()) & set(self.free_rows)
        for s in out.seqs:
            row = self.row_of[s.seq.seq_id]
            n = len(s.block_table)
            assert self.tables[row, :n].tolist() == list(s.block_table), (s.seq.seq_id, row)
            assert not self.tables[row, n:].any()
            assert self.row_lens[row] == n

    # ----------------------------------------------------------------------------------------- build
    def _buffers(self, num_tokens: int, num_rows: int) -> _BufferSet:
        buf = self._sets[self._next]
        if buf.np["ids"].shape[0] < num_tokens or buf.np["lens"].shape[0] < num_rows:  # regrow once
            tokens = max(num_tokens, buf.np["ids"].shape[0])
            rows = max(num_rows, buf.np["lens"].shape[0])
            buf = self._sets[self._next] = _BufferSet(tokens, rows, self.width, self.device)
        self._next ^= 1
        return buf

    def _tokens(self, out: SchedulerOutput, starts: np.ndarray) -> tuple[_BufferSet, np.ndarray, np.ndarray]:
        """Token ids, positions and query offsets written into the next buffer set; returns it, the positions
        and each token's index into ``out.seqs``."""
        seqs, nd = out.seqs, out.num_decodes
        num_seqs = len(seqs)
        if nd == num_seqs:  # decode-only: one token per sequence, at its start
            buf = self._buffers(num_seqs, num_seqs)
            b = buf.np
            b["ids"][:nd] = [s.seq.token_ids[s.start] for s in seqs]
            b["cu"][: nd + 1] = np.arange(nd + 1)
            b["pos"][:nd] = starts
            return buf, starts, np.arange(num_seqs)
        q = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=num_seqs)
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        num_tokens = int(cu[-1])
        buf = self._buffers(num_tokens, num_seqs)
        b = buf.np
        decode_ids = (s.seq.token_ids[s.start] for s in seqs[:nd])
        chunks = (s.seq.token_ids[s.start : s.start + s.num_tokens] for s in seqs[nd:])
        b["ids"][:num_tokens] = np.fromiter(
            itertools.chain(decode_ids, itertools.chain.from_iterable(chunks)),
            dtype=np.int64,
            count=num_tokens,
        )
        b["cu"][: num_seqs + 1] = cu
        seq_idx = np.repeat(np.arange(num_seqs), q)
        positions = starts[seq_idx] + (np.arange(num_tokens) - cu[seq_idx])
        b["pos"][:num_tokens] = positions
        return buf, positions, seq_idx

    def build(self, out: SchedulerOutput) -> StepInputs:
        """The step's flat inputs. Per sequence only its token ids (one item for a decode) are read in
        Python; positions, slots, lengths, offsets and block tables are numpy operations over the batch."""
        bs = self.block_size
        seqs = out.seqs
        num_seqs = len(seqs)
        rows = self.assign_rows(out)
        starts = np.fromiter((s.start for s in seqs), dtype=np.int64, count=num_seqs)
        buf, positions, seq_idx = self._tokens(out, starts)
        b = buf.np
        num_tokens = positions.shape[0]
        cu_host = b["cu"]
        q = np.diff(cu_host[: num_seqs + 1])
        seq_lens = starts + q
        row_of_token = rows[seq_idx]
        tables = self.tables
        b["slots"][:num_tokens] = tables[row_of_token, positions // bs] * bs + positions % bs
        b["lens"][:num_seqs] = seq_lens
        max_blocks = int(self.row_lens[rows].max())
        buf.tables(num_seqs, max_blocks)[:] = tables[rows, :max_blocks]
        last = cu_host[np.array(out.logit_rows, dtype=np.int64) + 1] - 1
        context: dict[str, Any] = {}
        for inputs in self.token_inputs:
            context.update(inputs(seqs, seq_idx, self.device))
        meta = AttentionMetadata(
            slot_mapping=buf.tensor("slots", num_tokens),
            num_decode_seqs=out.num_decodes,
            seq_lens=buf.tensor("lens", num_seqs),
            cu_seqlens_q=buf.tensor("cu", num_seqs + 1),
            block_tables=buf.tensor("tables", num_seqs, max_blocks),
            max_seq_len=int(seq_lens.max()),
            max_query_len=int(q.max()),
        )
        return StepInputs(
            ids=buf.tensor("ids", num_tokens),
            positions=buf.tensor("pos", num_tokens),
            meta=meta,
            last=torch.from_numpy(last.astype(np.int64)).to(self.device),
            context=context,
        )
