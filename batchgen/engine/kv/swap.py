"""The CPU swap space of swap-mode preemption and the block copies between it and the KV cache.

The CPU pool is one tensor ``[num_cpu_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block-major,
so that one block (K and V of every layer) is one contiguous span and a batch of blocks gathered from the KV
cache (``kv_cache[:, :, ids]`` moved to the front) is one contiguous tensor. On CUDA the pool is pinned.

* **CPU device**: both copies are one batched tensor index copy (``index_select`` + ``index_copy_``).
* **CUDA**: copies run on a side stream. A swap-out gathers the blocks into one contiguous GPU tensor (a
  batched ``index_select``), after which the compute stream may overwrite the source blocks (it waits on an
  event recorded right after the gather), then copies it asynchronously into pinned staging memory while the
  forward runs; the staged blocks are scattered into the pool (a CPU ``index_copy_``) when :meth:`flush` is
  called (before the next swap-in and at the start of the next step). A swap-in gathers the CPU blocks into
  pinned staging memory, copies them to the GPU and scatters them into the KV cache (``index_copy_``) on the
  side stream after the compute stream's earlier work; the compute stream waits for it before the forward.

Copies go in chunks of at most ``CHUNK_BYTES`` (bounded temporary GPU and pinned memory, which the memory
profile does not account for). Ordering within a step (the runner's job): swap-outs, then swap-ins, then copy-on-write copies, then the
forward, because blocks freed by a preemption may be handed out again in the same step.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

CHUNK_BYTES = 64 << 20
"""Most bytes of KV blocks moved by one batched copy (temporary gather buffers are this big at most)."""


class BlockSwapper:
    """Owns the CPU swap pool of one engine and performs swap-out / swap-in block copies."""

    def __init__(self, kv_cache: Tensor, num_cpu_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        num_layers, _, _, block_size, heads, head_dim = kv_cache.shape
        self.block_shape = (num_layers, 2, block_size, heads, head_dim)
        shape = (num_cpu_blocks, *self.block_shape)
        dtype = kv_cache.dtype
        block_bytes = math.prod(self.block_shape) * kv_cache.element_size()
        self.chunk_blocks = max(1, CHUNK_BYTES // block_bytes)
        if self.device.type == "cuda":
            self.cpu_cache = torch.empty(shape, dtype=dtype, pin_memory=True)
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device=self.device)
        else:
            # calloc'd by numpy: pages are only touched when blocks are swapped into them.
            itemsize = torch.tensor([], dtype=dtype).element_size()
            raw = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
            self.cpu_cache = torch.from_numpy(raw).view(dtype).view(shape)
            self.stream = None
        self._pending: list[tuple[torch.cuda.Event, Tensor, Tensor, Tensor]] = []
        self._staged_in: list[tuple[torch.cuda.Event, Tensor]] = []  # pinned buffers of swap-ins in flight

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_cache.shape[0]

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy GPU blocks ``mapping[i][0]`` into CPU blocks ``mapping[i][1]``."""
        for i in range(0, len(mapping), self.chunk_blocks):
            self._swap_out(mapping[i : i + self.chunk_blocks])

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy CPU blocks ``mapping[i][0]`` into GPU blocks ``mapping[i][1]`` (done before the forward)."""
        for i in range(0, len(mapping), self.chunk_blocks):
            self._swap_in(mapping[i : i + self.chunk_blocks])

    def _swap_out(self, mapping: list[tuple[int, int]]) -> None:
        src = torch.tensor([g for g, _ in mapping], dtype=torch.long)
        dst = torch.tensor([c for _, c in mapping], dtype=torch.long)
        kv = self.kv_cache
        if self.stream is None:
            self.cpu_cache.index_copy_(0, dst, kv.index_select(2, src).movedim(2, 0))
            return
        main = torch.cuda.current_stream(self.device)
        side = self.stream
        side.wait_stream(main)  # the forwards that wrote these blocks
        with torch.cuda.stream(side):
            gathered = kv.index_select(2, src.to(self.device, non_blocking=True)).movedim(2, 0).contiguous()
            gathered_ready = torch.cuda.Event()
            gathered_ready.record(side)
            staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        main.wait_event(gathered_ready)  # only then may the compute stream reuse the source blocks
        self._pending.append((copied, staging, dst, gathered))

    def flush(self) -> None:
        """Finish pending swap-outs: wait for their device-to-host copies and scatter them into the pool."""
        for copied, staging, dst, _gathered in self._pending:
            copied.synchronize()
            self.cpu_cache.index_copy_(0, dst, staging)
        self._pending.clear()
        for done, _staging in self._staged_in:
            done.synchronize()
        self._staged_in.clear()

    def _swap_in(self, mapping: list[tuple[int, int]]) -> None:
        src = torch.tensor([c for c, _ in mapping], dtype=torch.long)
        dst = torch.tensor([g for _, g in mapping], dtype=torch.long)
        kv = self.kv_cache
        if self.stream is None:
            kv.index_copy_(2, dst, self.cpu_cache.index_select(0, src).movedim(0, 2))
            return
        self.flush()
        staging = torch.empty((len(mapping), *self.block_shape), dtype=kv.dtype, pin_memory=True)
        torch.index_select(self.cpu_cache, 0, src, out=staging)
        main = torch.cuda.current_stream(self.device)
        side = self.stream
        side.wait_stream(main)  # earlier readers/writers of the destination blocks
        with torch.cuda.stream(side):
            blocks = staging.to(self.device, non_blocking=True)
            kv.index_copy_(2, dst.to(self.device, non_blocking=True), blocks.movedim(0, 2))
            done = torch.cuda.Event()
            done.record(side)
        main.wait_stream(side)
        self._staged_in.append((done, staging))  # keep the pinned buffer until the copy is done
