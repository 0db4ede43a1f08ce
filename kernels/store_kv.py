"""Triton ``store_kv``: write the new tokens' K and V into their paged-cache slots (slot −1 = skip).

One program per token copies its ``[Hkv, D]`` key and value rows (the innermost ``head_dim`` stays contiguous in
both the source and the cache, so loads and stores coalesce). Semantics: :func:`reference.store_kv`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._jit import kernel
from .kv_cache_dtype import narrow, storage_view


@kernel
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads_to_store = tl.where(slot >= 0, num_kv_heads, 0)  # slot -1: store nothing
    mask = (h[:, None] < heads_to_store) & (d[None, :] < head_dim)
    dst = tl.maximum(slot, 0) * stride_cache_slot + h[:, None] * stride_cache_head + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``k_cache``/``v_cache`` ``[NB, BS, Hkv, D]`` at
    ``slot_mapping`` ``[T]`` (int64; −1 = skip), in place."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "paged caches must be contiguous"
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim)
    # Rounded into the cache dtype by torch (to nearest even, fp8 saturating: kv_cache_dtype.narrow), so the
    # kernel only moves bits (fp8 as bytes): the same values on every backend.
    key, value = storage_view(narrow(key, k_cache.dtype)), storage_view(narrow(value, v_cache.dtype))
    k_cache, v_cache = storage_view(k_cache), storage_view(v_cache)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _store_kv_kernel.on(key.device)[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
