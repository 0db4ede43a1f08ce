"""Weight-only quantized linear layer for the CPU: ``y = x wᵀ + b`` in float32 by the C kernel
``csrc/quant_linear_cpu.c``, the weight held in GGUF's (ggml's) block formats and dequantized a block at a time
in L1 as the GEMM reads it (the formats and the arithmetic: the C file's docstring). On CPUs with AMX the formats
whose weights come in blocks of 32 or 16 with one scale (and offset) each (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
Q4_K, Q5_K, Q6_K, IQ4_XS) multiply in integers instead, each input block held as 24-bit integers under its largest magnitude
(``csrc/quant_digits_cpu.c``; :func:`integer_inputs`).

A packed weight is ``[out, row_bytes]`` uint8: each row the blocks of one output's weights along ``in``, as a GGUF
file stores them, so rows can be sliced (tensor parallelism), permuted or concatenated (fused projections) as
bytes. :func:`dequantize` gives the float32 weights, bit for bit gguf-py's ``gguf.quants.dequantize``.

Invariants: :func:`linear` takes CPU float32 inputs whose last dimension is ``in`` and returns a new contiguous
``[..., out]`` tensor (or writes into ``out``'s columns); each output row depends only on its input row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import cpu_kernel


@dataclass(frozen=True)
class BlockFormat:
    """A ggml block format: its name, type id, values and bytes per block."""

    name: str
    type_id: int
    block_values: int
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_values * self.block_bytes


FORMATS: dict[int, BlockFormat] = {
    f.type_id: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20),
        BlockFormat("Q5_0", 6, 32, 22),
        BlockFormat("Q5_1", 7, 32, 24),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("Q2_K", 10, 256, 84),
        BlockFormat("Q3_K", 11, 256, 110),
        BlockFormat("Q4_K", 12, 256, 144),
        BlockFormat("Q5_K", 13, 256, 176),
        BlockFormat("Q6_K", 14, 256, 210),
        BlockFormat("IQ4_NL", 20, 32, 18),
        BlockFormat("IQ4_XS", 23, 256, 136),
    )
}
"""The block formats the kernel multiplies by, by ggml type id."""


available = cpu_kernel.available
"""Whether this kernel can run here (:func:`.cpu_kernel.available`)."""


def _lib():
    lib = cpu_kernel.library()
    if lib is None:
        raise RuntimeError(
            "the CPU quantized linear kernel is unavailable (BATCHGEN_CPU_KERNEL=0 or no C compiler)"
        )
    return lib


def _multiply(
    x: Tensor,
    in_features: int,
    rows_out: int,
    out: Tensor | None,
    call: Callable[[Tensor, Tensor], int],
    rejected: Callable[[int], str],
    kernel: str | None = None,
) -> Tensor:
    """The shared frame of the products below: ``x``'s rows with unit stride (float32 ones when ``kernel``
    names the kernel for the error), ``out`` (a new ``[M, rows_out]`` tensor, or the caller's view), the C
    ``call(rows, out)`` unless there is nothing to multiply (RuntimeError with ``rejected(M)`` when it returns
    non-zero), and the result in ``x``'s leading shape."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < in_features):
        rows = rows.contiguous()
    if kernel is not None and rows.dtype != torch.float32:
        raise TypeError(f"the CPU {kernel} kernel takes float32 inputs, not {rows.dtype}")
    if out is None:
        out = torch.empty(rows.shape[0], rows_out, dtype=torch.float32)
    if rows.shape[0] and rows_out and call(rows, out) != 0:
        raise RuntimeError(rejected(rows.shape[0]))
    return out.view(*lead, rows_out) if out.is_contiguous() else out


def linear(
    x: Tensor,
    packed: Tensor,
    type_id: int,
    in_features: int,
    bias: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``x [..., in] @ wᵀ + bias`` → ``[..., rows]`` for the ``[rows, row_bytes]`` packed weight. With ``out``
    (a ``[M, *]`` float32 view whose rows are contiguous, e.g. a column slice of a wider output) the result is
    written there and returned."""
    fmt = FORMATS[type_id]
    rows_out = packed.shape[0]

    def call(rows: Tensor, out: Tensor) -> int:
        return _lib().batchgen_quant_linear(
            rows.data_ptr(), max(rows.stride(0), in_features), packed.data_ptr(), packed.shape[1], type_id,
            None if bias is None else bias.data_ptr(), out.data_ptr(), max(out.stride(0), rows_out),
            rows.shape[0], in_features, rows_out, torch.get_num_threads(),
        )  # fmt: skip

    return _multiply(
        x, in_features, rows_out, out, call,
        lambda m: f"batchgen_quant_linear rejected {fmt.name} [{m}, {in_features}] x {rows_out}",
        "quantized linear",
    )  # fmt: skip


def integer_inputs() -> bool:
    """Whether this process multiplies Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS weights by
    integer products over 24-bit block integer inputs (a CPU with AMX, and ``BATCHGEN_QUANT_AMX`` not ``0``)
    rather than in float32."""
    return available() and bool(_lib().batchgen_quant_integer_inputs())


def dequantize(packed: Tensor, type_id: int, in_features: int) -> Tensor:
    """The ``[rows, in]`` float32 weights of a packed one."""
    out = torch.empty(packed.shape[0], in_features, dtype=torch.float32)
    if packed.shape[0]:
        if not available():
            import numpy as np
            from gguf.quants import dequantize as gguf_dequantize

            return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(packed.numpy(), type_id)))
        status = _lib().batchgen_quant_dequantize(
            packed.data_ptr(), packed.shape[1], type_id, out.data_ptr(), in_features, packed.shape[0]
        )
        if status != 0:
            raise RuntimeError(f"batchgen_quant_dequantize rejected {FORMATS[type_id].name} x {in_features}")
    return out


def int_linear(
    x: Tensor, packed: Tensor, bits: int, scales: Tensor, group: int, bias: Tensor | None = None,
    round_bf16: bool = False, out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``x [..., in] @ wᵀ + bias`` for integer weights with group scales (compressed-tensors' pack-quantized,
    symmetric: the C file's second half): ``packed`` ``[rows, in * bits / 32]`` int32 (or the same bytes as
    uint8), ``scales`` ``[rows, in / group]`` float32. ``out`` as in :func:`linear`."""
    rows_out, in_features = packed.shape[0], packed.shape[1] * packed.element_size() * 8 // bits

    def call(rows: Tensor, out: Tensor) -> int:
        return _lib().batchgen_int_linear(
            rows.data_ptr(), max(rows.stride(0), in_features), packed.data_ptr(), bits, scales.data_ptr(), group,
            int(round_bf16), None if bias is None else bias.data_ptr(), out.data_ptr(), max(out.stride(0), rows_out),
            rows.shape[0], in_features, rows_out, torch.get_num_threads(),
        )  # fmt: skip

    return _multiply(
        x, in_features, rows_out, out, call,
        lambda m: f"batchgen_int_linear rejected int{bits} group {group} [{m}, {in_features}]",
    )  # fmt: skip


def fp8_linear(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    group: int,
    bias: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``x [..., in] @ wᵀ + bias`` for fp8 (float8_e4m3fn) weights: ``packed`` ``[rows, in]`` their bytes
    (uint8), ``scales`` ``[rows, in / group]`` float32; ``w = float32(q) * scale``, widened in registers (the C
    file's fp8 section). ``out`` as in :func:`linear`."""
    rows_out, in_features = packed.shape
    if in_features % group == 0 and (
        scales.shape != (rows_out, in_features // group)
        or scales.dtype != torch.float32
        or not scales.is_contiguous()
    ):
        raise ValueError(
            f"fp8 scales must be contiguous float32 [{rows_out}, {in_features // group}] for group {group}, "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )

    def call(rows: Tensor, out: Tensor) -> int:
        return _lib().batchgen_fp8_linear(
            rows.data_ptr(), max(rows.stride(0), in_features), packed.data_ptr(), scales.data_ptr(), group,
            None if bias is None else bias.data_ptr(), out.data_ptr(), max(out.stride(0), rows_out),
            rows.shape[0], in_features, rows_out, torch.get_num_threads(),
        )  # fmt: skip

    return _multiply(
        x, in_features, rows_out, out, call,
        lambda m: f"batchgen_fp8_linear rejected group {group} [{m}, {in_features}]",
        "fp8 linear",
    )  # fmt: skip
