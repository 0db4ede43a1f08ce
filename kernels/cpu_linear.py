"""The linear layer of the CPU models: ``y = x wᵀ + b`` in float32 by the C kernel ``csrc/linear_cpu.c`` over a
weight packed once into 16-column panels, held in float32, bfloat16 or float16 (narrow weights are widened to
float32 in registers: the result is bit for bit the float32 kernel's on the widened weights).

:func:`pack` lays a ``[out, in]`` weight out as the kernel reads it (``[ceil(out / 16), in, 16]``, zero past
``out``; the bias padded to match); :func:`linear` multiplies. Each output element is one chain of fused
multiply-adds over the input features in order, started from the bias: a row's result does not depend on the
batch it came in, the thread count or the run (the kernel's docstring has the blocking and the invariants).

Why our own GEMM: at the shapes a decode step multiplies (a few to a few hundred rows against weights read
from memory once per step) it is faster than both oneDNN's packed linear and MKL's GEMM on the 2-CPU AVX2
machine of the benchmarks, from 1 row to 1,024 (`python -m batchgen.bench.decode_ceiling`, BENCHMARKS.md).

Invariants: :func:`available` is True only when ``BATCHGEN_CPU_KERNEL`` is not ``0`` and the kernel library
builds and loads (:mod:`.cpu_kernel`); :func:`linear` takes CPU float32 inputs whose last dimension is the
packed weight's ``in`` and returns a new contiguous ``[..., out]`` tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_kernel

PANEL = 16
"""Output columns per packed panel (the kernel's register tile is 6 rows x 16 columns)."""


available = cpu_kernel.available
"""Whether this kernel can run here (:func:`.cpu_kernel.available`)."""


WEIGHT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16w", torch.float16: "f16w"}
"""Panel dtypes the kernel multiplies by, with the suffix of their C entry point."""


BF16_ORDER = [c for i in range(PANEL // 2) for c in (i, i + PANEL // 2)]
"""The column order within a bfloat16 panel row (0, 8, 1, 9, ...): the kernel widens its two halves with one
shift and one mask."""


def pack(weight: Tensor) -> Tensor:
    """``[out, in]`` CPU weight (float32, bfloat16 or float16) → ``[ceil(out / 16), in, 16]`` contiguous panels
    of the same dtype (zero past ``out``; a bfloat16 panel's columns in :data:`BF16_ORDER`)."""
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(
            f"the CPU linear kernel packs float32, bfloat16 or float16 weights, not {weight.dtype}"
        )
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = torch.zeros(panels * PANEL, in_features, dtype=weight.dtype)
    padded[:out_features] = weight.detach()
    rows = padded.view(panels, PANEL, in_features)
    if weight.dtype == torch.bfloat16:
        rows = rows[:, BF16_ORDER]
    return rows.transpose(1, 2).contiguous()


def pack_bias(bias: Tensor, out_features: int) -> Tensor:
    """The bias padded with zeros to the packed weight's ``ceil(out / 16) * 16`` columns."""
    padded = torch.zeros(-(-out_features // PANEL) * PANEL, dtype=torch.float32)
    padded[:out_features] = bias.detach()
    return padded


def unpack(packed: Tensor, out_features: int) -> Tensor:
    """The ``[out, in]`` weight back from :func:`pack`'s panels (a copy)."""
    panels, in_features, _ = packed.shape
    rows = packed.transpose(1, 2)
    if packed.dtype == torch.bfloat16:
        rows = rows[:, [BF16_ORDER.index(c) for c in range(PANEL)]]
    return rows.reshape(panels * PANEL, in_features)[:out_features].clone()


def linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """``x [..., in] @ weightᵀ + bias`` → ``[..., out]`` (``packed``/``bias`` from :func:`pack`/:func:`pack_bias`).
    Raises RuntimeError when the library is unavailable or rejects the call (check :func:`available` first)."""
    lib = cpu_kernel.library()
    if lib is None:
        raise RuntimeError("the CPU linear kernel is unavailable (BATCHGEN_CPU_KERNEL=0 or no C compiler)")
    in_features = packed.shape[1]
    lead = x.shape[:-1]
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < in_features):
        rows = rows.contiguous()
    if rows.dtype != torch.float32:
        raise TypeError(f"the CPU linear kernel takes float32 inputs, not {rows.dtype}")
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0]:
        status = getattr(lib, f"batchgen_linear_{WEIGHT_DTYPES[packed.dtype]}")(
            rows.data_ptr(), max(rows.stride(0), in_features), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, rows.shape[0], in_features,
            out_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(
                f"batchgen_linear_{WEIGHT_DTYPES[packed.dtype]} rejected [{rows.shape[0]}, {in_features}] x {out_features}"
            )
    return out.view(*lead, out_features)
