"""A decoder layer's elementwise steps on the CPU in float32, one C pass each (``csrc/layer_ops_cpu.c``):
RMSNorm (after a residual add, optionally), SiLU(gate)·up, rotary embeddings and the KV-cache store.

At a decode step's sizes (tens of rows of a few thousand floats) torch spends most of each of these in per-op
overhead and in the temporaries between its ops (a norm is five ops); here each is one call. Each function
returns None when the C library cannot serve the call (``BATCHGEN_CPU_KERNEL=0``, no compiler, not float32 on
the CPU, a layout it does not take), and the caller runs its torch code instead: the semantics are that torch
code's (:mod:`batchgen.models.llama`, :func:`.torch_backend.store_kv`). RoPE and the KV store are bit for bit
torch's; the norm's sum of squares and SiLU's exp may differ from torch's in the last bits (fixed order, run to
run and for any thread count the same).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from . import cpu_kernel


def _lib(*tensors: Tensor) -> ctypes.CDLL | None:
    if not cpu_kernel.enabled():
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32:
            return None
    return cpu_kernel.library()


def rms_norm(x: Tensor, weight: Tensor, eps: float, gemma: bool, add: Tensor | None = None) -> Tensor | None:
    """RMSNorm of ``x`` ``[T, D]`` or ``[T, H, D]`` (last dim contiguous, heads ``D`` apart) with ``weight``
    ``[D]`` or ``[H, D]`` → a new contiguous tensor shaped like ``x``. With ``add`` (``[T, D]``, ``x`` 2-D),
    ``x += add`` in place first and the sum is normed. None when the kernel cannot serve it."""
    lib = _lib(x, weight) if add is None else _lib(x, weight, add)
    if lib is None or x.dim() not in (2, 3) or x.stride(-1) != 1:
        return None
    t, d = x.shape[0], x.shape[-1]
    h = x.shape[1] if x.dim() == 3 else 1
    if (h > 1 and x.stride(1) != d) or (add is not None and (h != 1 or add.stride(-1) != 1)):
        return None
    w = weight.reshape(-1, d)
    if not w.is_contiguous() or w.shape[0] not in (1, h):
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.batchgen_rms_norm_f32(
        x.data_ptr(), x.stride(0), d, None if add is None else add.data_ptr(), 0 if add is None else add.stride(0),
        w.data_ptr(), w.shape[0], out.data_ptr(), t, h, d, eps, int(gemma), torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: Tensor) -> Tensor | None:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2I]`` (gate first, rows may be strided) → ``[T, I]``."""
    lib = _lib(gate_up)
    if lib is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        return None
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=torch.float32)
    lib.batchgen_silu_mul_f32(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t, inter, torch.get_num_threads()
    )
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """Rotary embeddings of ``x`` ``[T, H, D]`` (heads ``D`` apart) with ``cos``/``sin`` ``[T, 1, R]`` (R <= D,
    sin's first half negated, as :func:`batchgen.models.llama.rope_tables` makes them) → new ``[T, H, D]``."""
    lib = _lib(x, cos, sin)
    if lib is None or x.dim() != 3 or x.stride(-1) != 1 or x.stride(1) != x.shape[2]:
        return None
    t, h, d = x.shape
    c, s = cos.reshape(t, -1), sin.reshape(t, -1)
    if not (c.is_contiguous() and s.is_contiguous()) or c.shape[1] > d or c.shape[1] % 2:
        return None
    out = torch.empty(t, h, d, dtype=torch.float32)
    lib.batchgen_rope_f32(
        x.data_ptr(), x.stride(0), c.data_ptr(), s.data_ptr(), out.data_ptr(), t, h, d, c.shape[1],
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> bool:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches ``[blocks, block_size, Hkv, D]`` at ``slots``
    ``[T]`` int64 (−1: skip). False when the kernel cannot serve the call (nothing written; a slot out of
    range included: the caller's torch path reports it)."""
    lib = _lib(key, value, k_cache, v_cache)
    if lib is None or slots.dtype != torch.int64 or not slots.is_contiguous():
        return False
    t, hkv, d = key.shape
    if (
        key.stride(-1) != 1
        or value.stride(-1) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return False
    status = lib.batchgen_store_kv_f32(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
        slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.numel() // (hkv * d), t, hkv, d,
    )  # fmt: skip
    return status == 0
