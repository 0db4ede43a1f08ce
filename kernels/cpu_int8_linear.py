"""Integer-activation linear layer for the CPU (``csrc/int8_linear_cpu.c``): ``y = x wᵀ + b`` for int8 weights
whose inputs are quantized to int8, symmetric, per token or by a static scale (compressed-tensors' W8A8), by
integer dot products instead of the float32 product of the dequantized values.

:func:`quantize_rows` quantizes the input exactly as compressed-tensors does (the values and scales are bit for
bit those of its ``fake_quantize`` before the dequantization); :func:`linear` multiplies them by the weights in
:class:`~batchgen.models.quant.group_linear.GroupQuantLinear`'s 8-bit layout (``[N, K / 4]`` int32 words, each
``w + 128`` lowest byte first) with ``[N, K / group]`` scales.

Invariants: the integer sums are exact, so the result is ``xs · Σ_g ws_g · (Σ_k w q)`` up to a few float
roundings, the same bits in the SIMD and the plain-C build; each output row depends only on its input row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import cpu_kernel

MAX_GROUP = 65536
"""The longest run of inputs summed in int32 (``group · 255 · 128 < 2³¹``)."""


@dataclass(frozen=True)
class QuantizedRows:
    """`q` ``[M, K]`` int8, `scales` ``[M]`` float32, `group_sums` ``[M, K / group]`` int32 (each group's sum of
    `q`), `group` the run of inputs each sum covers."""

    q: Tensor
    scales: Tensor
    group_sums: Tensor
    group: int


available = cpu_kernel.available
"""Whether this kernel can run here (:func:`.cpu_kernel.available`)."""


def quantize_rows(x: Tensor, group: int, scales: Tensor | None = None) -> QuantizedRows:
    """``x [M, K]`` float32 → its int8 rows: scale ``max |x| / 127.5`` per row (``finfo.eps`` where 0), or the
    given float32 `scales` (``[M]`` per row, or ``[1]`` for every row); ``q = round_half_even(clamp(x / scale,
    -128, 127))``."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise TypeError(f"quantize_rows takes [M, K] float32 rows, not {x.dtype} {tuple(x.shape)}")
    rows = x if x.stride(-1) == 1 else x.contiguous()
    m, k = rows.shape
    q = torch.empty(m, k, dtype=torch.int8)
    out_scales = torch.empty(m, dtype=torch.float32)
    sums = torch.empty(m, k // group, dtype=torch.int32)
    given, stride = None, 0
    if scales is not None:
        given = scales.reshape(-1).to(torch.float32).contiguous()
        if given.numel() not in (1, m):
            raise ValueError(f"{given.numel()} scales for {m} rows")
        stride = 0 if given.numel() == 1 else 1
    status = cpu_kernel.library().batchgen_quantize_rows_s8(
        rows.data_ptr(), max(rows.stride(0), k), m, k, None if given is None else given.data_ptr(), stride, group,
        q.data_ptr(), out_scales.data_ptr(), sums.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"batchgen_quantize_rows_s8 rejected [{m}, {k}] with group {group}")
    return QuantizedRows(q, out_scales, sums, group)


def linear(
    rows: QuantizedRows, packed: Tensor, scales: Tensor, bias: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """The quantized rows times the ``[N, K / 4]`` packed 8-bit weight with ``[N, K / group]`` float32 scales,
    plus `bias` → ``[M, N]`` float32 (written into `out`, a ``[M, N]`` view with contiguous rows, when given)."""
    m, k = rows.q.shape
    n = packed.shape[0]
    if packed.shape[1] * packed.element_size() != k or scales.shape != (n, k // rows.group):
        raise ValueError(
            f"int8 weights [{n}, {packed.shape[1] * packed.element_size()} bytes] with scales "
            f"{tuple(scales.shape)} do not fit inputs of {k} in groups of {rows.group}"
        )
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    if m:
        status = cpu_kernel.library().batchgen_int8_linear(
            rows.q.data_ptr(), k, rows.scales.data_ptr(), rows.group_sums.data_ptr(), packed.data_ptr(), k,
            scales.data_ptr(), rows.group, None if bias is None else bias.data_ptr(), out.data_ptr(),
            max(out.stride(0), n), m, k, n, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"batchgen_int8_linear rejected [{m}, {k}] x {n} in groups of {rows.group}")
    return out
