"""Builds the flat batch tensors for one step, runs the model over the paged KV cache, returns logits.

Also owns the KV cache tensor and its sizing: on CUDA a profiling forward at the full token budget measures
peak activation memory and the pool takes ``total * gpu_memory_utilization - weights - activations``; on CPU
``kv_cache_memory`` bytes; ``num_blocks`` overrides both.
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import torch
from torch import Tensor

from batchgen.engine import prompt_logprobs
from batchgen.engine.attention import AttentionMetadata, ForwardContext, PagedAttention
from batchgen.engine.config import EngineConfig, parse_bytes
from batchgen.engine.scheduler import SchedulerOutput
from batchgen.engine.swap import BlockSwapper

logger = logging.getLogger(__name__)


def copy_runs(copies: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Split block copies ``(src, dst)`` into consecutive runs whose source and destination sets are disjoint
    (the copy kernel's contract), so that running them run after run equals copying one by one in order.

    Usually one run: a block only becomes both a source and a destination in one step when a preemption frees
    a block that an earlier copy of the step read, and a later copy is handed that block.
    """
    runs: list[list[tuple[int, int]]] = []
    srcs: set[int] = set()
    dsts: set[int] = set()
    for src, dst in copies:
        if not runs or dst in srcs or src in dsts:
            runs.append([])
            srcs, dsts = set(), set()
        runs[-1].append((src, dst))
        srcs.add(src)
        dsts.add(dst)
    return runs


class ModelRunner:
    """Invariant: ``kv_cache`` is zero-initialised and only ever holds finite K/V written by ``store_kv``."""

    def __init__(
        self, model: torch.nn.Module, config: EngineConfig, device: torch.device, backend: str
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        mc = model.config
        self.num_layers = mc.num_layers
        self.num_kv_heads = mc.num_kv_heads
        self.head_dim = mc.head_dim
        self.dtype = next(model.parameters()).dtype
        self.block_size = config.block_size
        self.attn = PagedAttention(backend)
        self.kv_cache: Tensor | None = None
        self.swapper: BlockSwapper | None = None
        self.collect_prompt_logprobs = False  # set by the engine while a request wants prompt logprobs

    # ------------------------------------------------------------------------------------------ sizing
    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak_activations = self.profile_activation_memory()
            budget = int(total * cfg.gpu_memory_utilization) - self.weights_bytes() - peak_activations
            used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
            budget -= max(0, used_elsewhere)
            num_blocks = budget // self.bytes_per_block
            logger.info(
                "CUDA memory: total %.1f GiB, weights %.2f GiB, peak activations %.2f GiB, KV budget %.2f GiB",
                total / 2**30,
                self.weights_bytes() / 2**30,
                peak_activations / 2**30,
                max(budget, 0) / 2**30,
            )
        else:
            num_blocks = parse_bytes(cfg.kv_cache_memory) // self.bytes_per_block
        if num_blocks < 1:
            raise RuntimeError(
                "no memory left for the KV cache: raise engine.gpu_memory_utilization / engine.kv_cache_memory, "
                "lower engine.max_num_batched_tokens, or set engine.num_blocks"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def profile_activation_memory(self) -> int:
        """Run one forward at the full token budget on a tiny KV cache and measure peak activation memory."""
        tokens = self.config.max_num_batched_tokens
        blocks = -(-tokens // self.block_size)
        self.allocate_kv_cache(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(tokens, dtype=torch.long, device=self.device) % max(1, tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, dtype=torch.long, device=self.device),
            num_decode_seqs=0,
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            max_seq_len=tokens,
            max_query_len=tokens,
        )
        hidden = self.model(ids, positions, ForwardContext(self.attn, meta, self.kv_cache))
        self.model.compute_logits(hidden[-min(tokens, self.config.max_num_seqs) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_cache = None
        torch.cuda.empty_cache()
        return int(peak)

    def determine_num_swap_blocks(self) -> int:
        """CPU swap blocks for preemption_mode=swap: num_swap_blocks, else swap_space // bytes_per_block."""
        cfg = self.config
        if cfg.num_swap_blocks is not None:
            return cfg.num_swap_blocks
        return parse_bytes(cfg.swap_space) // self.bytes_per_block

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """The CPU block pool swapped-out blocks are copied to (after :meth:`allocate_kv_cache`)."""
        assert self.kv_cache is not None
        self.swapper = BlockSwapper(self.kv_cache, num_cpu_blocks) if num_cpu_blocks > 0 else None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":
            # calloc'd by numpy: the OS hands out zero pages lazily, so a multi-GiB pool costs nothing until
            # blocks are written (torch.zeros would touch every page at start-up).
            itemsize = torch.tensor([], dtype=self.dtype).element_size()
            raw = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
            self.kv_cache = torch.from_numpy(raw).view(self.dtype).view(shape)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ----------------------------------------------------------------------------------------- forward
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies, with the meaning of performing them one by one in list order."""
        for run in copy_runs(copies):
            mapping = torch.tensor(run, dtype=torch.long, device=self.device)
            self.attn.copy_blocks(self.kv_cache, mapping)

    def swap(self, out: SchedulerOutput) -> None:
        """The step's block moves, in the only safe order: swap-outs, copies on write, swap-ins."""
        if self.swapper is not None:
            self.swapper.flush()
            self.swapper.swap_out(out.swap_out)
        elif out.swap_out or out.swap_in:
            raise RuntimeError("swap copies scheduled but no swap space was allocated")
        self.copy_blocks(out.copies)
        if self.swapper is not None:
            self.swapper.swap_in(out.swap_in)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> Tensor:
        """Run one step: swap-outs, copy-on-write copies, swap-ins, then one packed forward over ``out.seqs``.
        Returns float32 logits ``[len(out.logit_rows), V]``: row i is the last-token logits of
        ``out.seqs[out.logit_rows[i]]`` (the sampled rows, then the beam rows).
        """
        self.swap(out)
        ids, pos, meta, last = self.prepare_inputs(out)
        hidden = self.model(ids, pos, ForwardContext(self.attn, meta, self.kv_cache))
        if self.collect_prompt_logprobs:
            prompt_logprobs.collect(self.model, hidden, out)
        return self.model.compute_logits(hidden[last]).float()

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """Flat token ids, positions, attention metadata, and the token index of each sampled row."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in out.seqs:
            start, table = s.start, s.block_table
            input_ids.extend(s.token_ids)
            if s.num_tokens == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                rng = range(start, start + s.num_tokens)
                positions.extend(rng)
                slots.extend(table[p // bs] * bs + p % bs for p in rng)
        q_lens = [s.num_tokens for s in out.seqs]
        seq_lens = [s.start + s.num_tokens for s in out.seqs]
        cu = [0, *itertools.accumulate(q_lens)]
        max_blocks = max(len(s.block_table) for s in out.seqs)
        padded = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in out.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_seqs=out.num_decodes,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_seq_len=max(seq_lens),
            max_query_len=max(q_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        last = torch.tensor([cu[b + 1] - 1 for b in out.logit_rows], dtype=torch.long, device=dev)
        return ids, pos, meta, last
