"""Runs one plain :class:`~batchgen.engine.worker.step_input.StepInput` over the paged KV cache: the block moves,
the packed forward, the logits of the rows it asks for, sampling; returns a
:class:`~batchgen.engine.worker.step_input.RunnerOutput`. It never sees a sequence or a request.

Also owns the KV cache tensor and its sizing: on CUDA a profiling forward at the full token budget measures
peak activation memory and the pool takes ``total * gpu_memory_utilization - weights - activations``; on CPU
``kv_cache_memory`` bytes; ``num_blocks`` overrides both.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from batchgen.attention import AttentionMetadata, ForwardContext, PagedAttention
from batchgen.engine.config import EngineConfig, parse_bytes
from batchgen.engine.kv.swap import BlockSwapper
from batchgen.engine.worker.sampler import Sampler
from batchgen.engine.worker.step_input import (
    BlockMoves,
    ForwardInput,
    RunnerOutput,
    SamplingInput,
    SlotLoad,
    StepInput,
)
from batchgen.kernels import cpu_kernel, kv_cache_dtype
from batchgen.models.quant import activation_dtype
from batchgen.runtime import malloc_tuning

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


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes decode steps are padded to (and CUDA graphs captured for): 1, 2, 4, 8, 16, 32, 48, ...,
    and ``max_num_seqs`` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class ModelRunner:
    """Invariant: ``kv_cache`` is zero-initialised and only ever holds finite K/V written by ``store_kv``.

    **Padded decode buckets.** With ``pad_decodes`` (CUDA without ``engine.enforce_eager``), a decode-only step of B sequences runs as a batch of ``bucket(B)`` rows: the padding rows decode
    token 0 at position 0 into a scratch block that the block pool never hands out (the KV cache holds one
    block more than the pool), and their logits are not read. On CUDA each bucket's forward is captured once
    into a CUDA graph over static input buffers and replayed (capture failure: eager, logged once).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        device: torch.device,
        backend: str,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        mc = model.config
        self.num_layers = mc.num_layers
        self.num_kv_heads = mc.num_kv_heads
        self.head_dim = mc.head_dim
        self.dtype = kv_cache_dtype.cache_dtype(config.kv_cache_dtype, activation_dtype(model))
        self.block_size = config.block_size
        self.attn = PagedAttention(backend)
        if device.type == "cpu" and backend == "torch":
            cpu_kernel.start_build()  # the C decode kernel compiles in the background (kernels/cpu_kernel.py)
            malloc_tuning.keep_freed_memory()  # no per-step page faults for activations (batchgen/runtime/malloc_tuning.py)
        self.kv_cache: Tensor | None = None
        self.swapper: BlockSwapper | None = None
        self.use_cuda_graphs = device.type == "cuda" and not config.enforce_eager
        self.pad_decodes = self.use_cuda_graphs
        self.buckets = decode_buckets(config.max_num_seqs)
        self.max_model_len = max_model_len
        self.sampler = Sampler(seed=config.seed)
        self.scratch_block = -1  # set by allocate_kv_cache when padding
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._graph_inputs: dict[str, Tensor] = {}
        self._graphs_failed = False
        self.adapters: Any = None
        """The model's adapter slots (None: none), written by each step's ``loads``; built and read by the
        feature that sends the loads."""
        self.capture_error_mode = "global"
        """CUDA-graph capture mode: an executor that runs steps in a thread of its own while the main thread
        keeps working sets ``thread_local``."""

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
        if getattr(self.model, "has_lm_head", True):  # a model without an LM head computes no logits
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
        pool = kv_cache_dtype.storage_view(self.kv_cache)  # fp8 blocks move as bytes
        self.swapper = BlockSwapper(pool, num_cpu_blocks) if num_cpu_blocks > 0 else None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.pad_decodes:  # one scratch block past the pool's blocks, for the padding rows
            self.scratch_block = num_blocks
            num_blocks += 1
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":
            # calloc'd by numpy: the OS hands out zero pages lazily, so a multi-GiB pool costs nothing until
            # blocks are written (torch.zeros would touch every page at start-up).
            itemsize = torch.tensor([], dtype=self.dtype).element_size()
            raw = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
            malloc_tuning.huge_pages(raw.ctypes.data, raw.nbytes)  # fewer faults and TLB misses, still lazy
            self.kv_cache = torch.from_numpy(raw).view(self.dtype).view(shape)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ----------------------------------------------------------------------------------------- forward
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies, with the meaning of performing them one by one in list order."""
        for run in copy_runs(copies):
            mapping = torch.tensor(run, dtype=torch.long, device=self.device)
            self.attn.copy_blocks(self.kv_cache, mapping)

    def apply_moves(self, moves: BlockMoves) -> None:
        """The step's block moves, in the only safe order: swap-outs (their freed blocks may be handed out
        again in the step), swap-ins, then copies on write (a copy may read a block just swapped in: the
        sequences of a swapped-in group may share their partial block)."""
        if self.swapper is not None:
            self.swapper.flush()
            self.swapper.swap_out(moves.swap_out)
            self.swapper.swap_in(moves.swap_in)
        elif moves.swap_out or moves.swap_in:
            raise RuntimeError("swap copies scheduled but no swap space was allocated")
        self.copy_blocks(moves.copies)

    def apply_loads(self, loads: list[SlotLoad]) -> None:
        """Write each load (this rank's shard) into :attr:`adapters`, in order."""
        for load in loads:
            load.apply(self.adapters)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> RunnerOutput:
        """Run one step: block moves, then (unless the step only moves blocks) the packed forward and the
        sampling of its logit rows."""
        self.apply_moves(step.moves)
        self.apply_loads(step.loads)
        self.sampler.release(step.sampling.release)
        if step.forward is None:
            return RunnerOutput()
        logits, reads = self.forward(step.forward, step.fill)
        out = RunnerOutput() if logits is None else self.sample(logits, step.sampling)
        out.reads = reads
        return out

    def sample(self, logits: Tensor, sampling: SamplingInput) -> RunnerOutput:
        """Sample the first ``sampling.num_rows`` rows of ``logits`` (row mask first); the log-softmax of
        the scored rows after them."""
        n = sampling.num_rows
        if sampling.mask is not None:
            sampling.mask.apply(logits[:n])
        sampled = self.sampler(logits[:n], sampling.rows, sampling.settings, sampling.watch or None)
        scores = self.sampler.log_softmax(logits[n:]) if sampling.num_score_rows else None
        return RunnerOutput(
            sampled.token_ids, sampled.logprobs, sampled.sampled, scores, watched=sampled.watched
        )

    @torch.inference_mode()
    def forward(
        self, fwd: ForwardInput, fill: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor | None, dict[type, Any]]:
        """The forward of ``fwd``: float32 logits of its ``last`` rows (None when it has none: a step of
        hidden-state reads only), and the result of each of its reads of the hidden states, in order.
        ``fill``:
        ``(index, tokens)``: placeholder input ids written in first (a step planned ahead)."""
        ids, pos, meta, last = fwd.ids, fwd.positions, fwd.meta, fwd.last
        if fill is not None:
            ids[fill[0]] = fill[1]
        nd = meta.num_decode_seqs
        if (
            self.pad_decodes
            and not fwd.reads
            and not fwd.context
            and nd == fwd.num_seqs
            and nd <= self.buckets[-1]
        ):
            bucket = next(b for b in self.buckets if b >= nd)
            ids, pos, meta = self.pad_decode_batch(ids, pos, meta, bucket)
            if self.use_cuda_graphs and not self._graphs_failed:
                hidden = self._run_graph(ids, pos, meta, bucket)
                if hidden is not None:  # (no logit rows: only reads of one-token chunks)
                    logits = self.model.compute_logits(hidden[last]).float() if last.numel() else None
                    return logits, {}
        hidden = self.model(ids, pos, ForwardContext(self.attn, meta, self.kv_cache, **fwd.context))
        reads = {kind: read.compute(self.model, hidden) for kind, read in fwd.reads.items()}
        logits = self.model.compute_logits(hidden[last]).float() if last.numel() else None
        return logits, reads

    def pad_decode_batch(
        self, ids: Tensor, pos: Tensor, meta: AttentionMetadata, bucket: int
    ) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """A decode-only batch padded to ``bucket`` rows: token 0 at position 0 writing the scratch block's
        first slot and attending to it alone (real rows unchanged, so their logits are too)."""
        b = ids.shape[0]
        pad = bucket - b
        if pad == 0:
            return ids, pos, meta
        dev = ids.device
        bt = meta.block_tables
        tables = torch.zeros((bucket, bt.shape[1]), dtype=bt.dtype, device=dev)
        tables[:b] = bt
        tables[b:, 0] = self.scratch_block
        meta = AttentionMetadata(
            slot_mapping=torch.cat(
                [meta.slot_mapping, torch.full((pad,), self.scratch_block * self.block_size, device=dev)]
            ),
            num_decode_seqs=bucket,
            seq_lens=torch.cat([meta.seq_lens, torch.ones(pad, dtype=meta.seq_lens.dtype, device=dev)]),
            cu_seqlens_q=torch.arange(bucket + 1, dtype=meta.cu_seqlens_q.dtype, device=dev),
            block_tables=tables,
            max_seq_len=meta.max_seq_len,
            max_query_len=1,
        )
        zeros = torch.zeros(pad, dtype=ids.dtype, device=dev)
        return torch.cat([ids, zeros]), torch.cat([pos, zeros]), meta

    def _run_graph(self, ids: Tensor, pos: Tensor, meta: AttentionMetadata, bucket: int) -> Tensor | None:
        """Replay (capturing on first use) the CUDA graph of this bucket's decode forward; None: run eagerly."""
        max_len = self.max_model_len
        width = -(-max_len // self.block_size)
        if meta.block_tables.shape[1] > width:
            return None
        g = self._graph_inputs
        if not g:
            n, dev = self.buckets[-1], self.device
            g["ids"] = torch.zeros(n, dtype=torch.long, device=dev)
            g["pos"] = torch.zeros(n, dtype=torch.long, device=dev)
            g["slots"] = torch.full((n,), self.scratch_block * self.block_size, dtype=torch.long, device=dev)
            g["lens"] = torch.ones(n, dtype=torch.int32, device=dev)
            g["cu"] = torch.arange(n + 1, dtype=torch.int32, device=dev)
            g["tables"] = torch.zeros((n, width), dtype=torch.int32, device=dev)
        g["ids"][:bucket].copy_(ids, non_blocking=True)
        g["pos"][:bucket].copy_(pos, non_blocking=True)
        g["slots"][:bucket].copy_(meta.slot_mapping, non_blocking=True)
        g["lens"][:bucket].copy_(meta.seq_lens, non_blocking=True)
        tables = g["tables"][:bucket]
        tables.zero_()
        tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        entry = self._graphs.get(bucket)
        if entry is None:
            try:
                entry = self._capture(bucket, max_len)
            except Exception as e:  # a backend that cannot be captured (host syncs): eager from now on
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)
                self._graphs_failed = True
                return None
            self._graphs[bucket] = entry
        graph, hidden = entry
        graph.replay()
        return hidden[:bucket]

    def _capture(self, bucket: int, max_len: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        g = self._graph_inputs
        meta = AttentionMetadata(
            slot_mapping=g["slots"][:bucket],
            num_decode_seqs=bucket,
            seq_lens=g["lens"][:bucket],
            cu_seqlens_q=g["cu"][: bucket + 1],
            block_tables=g["tables"][:bucket],
            max_seq_len=max_len,
            max_query_len=1,
        )
        ctx = ForwardContext(self.attn, meta, self.kv_cache)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, autotuning)
            self.model(g["ids"][:bucket], g["pos"][:bucket], ctx)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self._graphs.values()))[0].pool() if self._graphs else None
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
            hidden = self.model(g["ids"][:bucket], g["pos"][:bucket], ctx)
        return graph, hidden
