"""The KV cache's element type (``engine.kv_cache_dtype``, vLLM's values) and the rounding into it.

``auto`` stores K/V in the model's activation dtype (float32 on the CPU); ``float32``, ``bfloat16`` and
``float16`` store them in that dtype; ``fp8`` (= ``fp8_e4m3``: torch's ``float8_e4m3fn``) and ``fp8_e5m2`` in
one byte. Every attention implementation widens what it reads to float32 (or the query's dtype) and computes
as with a float32 cache: a narrow cache is exact attention over the rounded K/V (:func:`round_trip` gives those
values; the tests hold each kernel to the float64 reference on them).

Rounding (:func:`narrow`): to nearest even, like torch's casts; fp8 saturates at the format's largest finite
value (e4m3: 448, e5m2: 57344) instead of overflowing to NaN/inf, as vLLM's fp8 cache does. The per-tensor
scale is 1 (vLLM's default without calibrated ``k_scale``/``v_scale``).

Invariants: :func:`cache_dtype` is the one place a name becomes a torch dtype; a pool's bytes per block are
``element_size(dtype)`` per value, so a narrower cache fits proportionally more blocks in the same memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
"""The accepted ``engine.kv_cache_dtype`` values (vLLM's names)."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check(name: str) -> None:
    """ValueError naming ``engine.kv_cache_dtype`` unless `name` is one of :data:`KV_CACHE_DTYPES`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"engine.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the pool for ``engine.kv_cache_dtype=name`` and a model computing in `model_dtype`."""
    check(name)
    return model_dtype if name == "auto" else _DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def narrow(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` rounded into the cache dtype (saturating for fp8)."""
    if is_fp8(dtype):
        big = torch.finfo(dtype).max
        return x.clamp(-big, big).to(dtype)
    return x.to(dtype)


def round_trip(x: Tensor, dtype: torch.dtype) -> Tensor:
    """What a cache of `dtype` gives back for `x` (in `x`'s dtype)."""
    return narrow(x, dtype).to(x.dtype)


def storage_view(t: Tensor) -> Tensor:
    """`t` as bytes' worth of plain integers where torch lacks the op for fp8 (index_copy_, copies by index):
    a uint8 view of an fp8 tensor, `t` itself otherwise."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def store_rows(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` rounded into the paged caches at ``slots`` ``[T]`` int64 (−1 =
    skip)."""
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for new, cache in ((key, k_cache), (value, v_cache)):
        rows = storage_view(narrow(new, cache.dtype))
        storage_view(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, rows)
