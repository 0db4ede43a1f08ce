"""Builds a step's plain :class:`~batchgen.engine.worker.step_input.StepInput` from the scheduler's output, once per
step: the flat forward tensors in the persistent :class:`~batchgen.engine.worker.input_batch.InputBatch`, the
sampling rows and per-row settings (persistent :class:`~batchgen.engine.worker.sampler.SamplingBatch`) and the
row mask; the reads of the hidden states the groups declared when the step was scheduled.
Live objects (sequences, requests) are read here and nowhere below.

The forward part and the sampling part are built separately because a pipelined engine prepares a step's
forward while the previous step runs, and its sampling rows only once the previous step's tokens are in
(penalties and ``min_tokens`` see every token so far).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.sched.output import SchedulerOutput
from batchgen.engine.sched.sequence import Sequence
from batchgen.engine.sched.stop import StopRules
from batchgen.engine.worker.input_batch import InputBatch
from batchgen.engine.worker.sampler import SamplingBatch, SamplingRow, SamplingTensors
from batchgen.engine.worker.step_input import BlockMoves, ForwardInput, RowMask, SamplingInput


class StepBuilder:
    """The engine's step-input builder (persistent buffers across steps). ``mask`` returns the mask of a
    step's sampled sequences' logit rows (None: no row is masked; the engine's constraints)."""

    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        device: torch.device,
        stop: StopRules,
        mask: Callable[[list[Sequence]], RowMask | None],
    ) -> None:
        width = -(-max_model_len // config.block_size)
        self.input_batch = InputBatch(
            config.max_num_batched_tokens, config.max_num_seqs, width, config.block_size, device
        )
        self.sampling_batch = SamplingBatch(config.max_num_seqs)
        self.stop = stop
        self._mask = mask
        self.released: list[int] = []
        """Keys of seeded sequences that are done: their generators are dropped with the next sampling."""

    @staticmethod
    def moves(out: SchedulerOutput) -> BlockMoves:
        return BlockMoves(out.swap_out, out.copies, out.swap_in)

    def prepare_inputs(self, out: SchedulerOutput) -> ForwardInput | None:
        """The step's forward (None: a step that only moves blocks); valid until the step after next."""
        if not out.seqs:
            return None
        step = self.input_batch.build(out)
        return ForwardInput(
            step.ids, step.positions, step.meta, step.last, len(out.seqs), out.reads, step.context
        )

    def sampling_input(self, out: SchedulerOutput) -> SamplingInput:
        """How the step's logit rows are sampled (built when the sampled sequences hold every token so far)."""
        rows, settings = self.sampling_inputs(out)
        mask = self._mask(out.sample_seqs) if out.sample_seqs else None
        release, self.released = self.released, []
        return SamplingInput(
            len(out.sample_rows), rows, settings, mask, len(out.score_rows), release, out.watch
        )

    def sampling_inputs(
        self, out: SchedulerOutput
    ) -> tuple[list[SamplingRow] | None, SamplingTensors | None]:
        """The sampler's rows and per-row filter settings: both None when the step is plain greedy; only the
        settings (no rows built) when every row is plain sampling (:attr:`Request.plain_sampling`)."""
        if out.plain_greedy:
            return None, None
        seqs = out.sample_seqs
        settings = self.sampling_batch.gather([s.seq_id for s in seqs], [s.params for s in seqs])
        return (None if out.plain_sampling else self.sampling_rows(out)), settings

    def sampling_rows(self, out: SchedulerOutput) -> list[SamplingRow]:
        """One :class:`SamplingRow` per sampled sequence (the steps :meth:`sampling_inputs` needs them for)."""
        return [
            SamplingRow(
                params=seq.params,
                prompt_token_ids=seq.request.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                seed=seq.seed,
                key=seq.seq_id,
                banned_token_ids=self.stop.banned_token_ids(seq),
            )
            for seq in out.sample_seqs
        ]
