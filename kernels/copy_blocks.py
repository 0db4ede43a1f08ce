"""Triton ``copy_blocks``: copy-on-write of whole KV blocks, every layer and both K and V in one launch.

Program ``(pair, plane, chunk)`` copies ``BLOCK`` contiguous elements of block ``src -> dst`` in one
``[num_blocks, block_size, Hkv, D]`` plane (``plane = layer * 2 + kv``). A block is one contiguous
``block_size * Hkv * D`` span of its plane, so the copy is a flat, coalesced memcpy. Semantics:
:func:`reference.copy_blocks`; sources and destinations must be disjoint (programs run in any order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._jit import kernel
from .kv_cache_dtype import storage_view


@kernel
def _copy_blocks_kernel(
    cache_ptr,
    mapping_ptr,
    stride_plane,
    block_numel,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    base = cache_ptr + plane * stride_plane
    x = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, x, mask=mask)


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy physical blocks ``block_mapping[:, 0] -> block_mapping[:, 1]`` (``[N, 2]`` int64) of
    ``kv_cache [L, 2, NB, BS, Hkv, D]`` in every layer, K and V, in place."""
    if block_mapping.numel() == 0:
        return
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    kv_cache = storage_view(kv_cache)  # an fp8 cache moves as bytes
    num_layers, two, num_blocks = kv_cache.shape[:3]
    block_numel = kv_cache[0, 0, 0].numel()
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    block = min(triton.next_power_of_2(block_numel), 4096)
    grid = (mapping.shape[0], num_layers * two, triton.cdiv(block_numel, block))
    _copy_blocks_kernel.on(kv_cache.device)[grid](
        kv_cache, mapping, num_blocks * block_numel, block_numel, BLOCK=block
    )
