"""`GroupQuantLinear`: a projection over integer weights with one float scale per group of inputs, in the layout
the integer GEMM of :mod:`batchgen.kernels.cpu_quant_linear` multiplies by (``int_linear``: each output row's
values packed along the inputs into int32 words, lowest bits first, stored with an offset of ``2^(bits-1)``;
``w = (u - 2^(bits-1)) * scale[row, input // group]``).

Checkpoints in other layouts (GPTQ, AWQ: :mod:`.gptq_awq`) are repacked into it once at load:

* symmetric weights (every zero point ``2^(bits-1)``) are the kernel's layout as they are; other zero points
  stay int4 / int8 and add their share after the GEMM: ``w = (u - 2^(bits-1)) s + (2^(bits-1) - zero) s``, so
  ``y += (x summed over each group) @ ((2^(bits-1) - zero) s)ᵀ`` (`zero_term`, ``[rows, in / group]`` float32:
  a small GEMM of one column per group). Exact in real arithmetic; in float32 it differs from multiplying by
  ``(u - zero) s`` by rounding only;
* groups that are not runs of consecutive inputs (GPTQ's activation order, ``g_idx``) are made consecutive by a
  permutation of the inputs: the part keeps it (`perm`) and gathers the input columns in that order before the
  GEMM (``x[:, perm] @ w[:, perm]ᵀ = x @ wᵀ``).

A fused projection (q/k/v, gate/up) holds one :class:`IntPart` per distinct (bits, group, permutation); each
writes its own columns of the output. Invariants: `dense_weight()` is the dequantized ``[out, in]`` float32
weight in the checkpoint's input order (exact for symmetric parts; ``(u - 2^(bits-1)) s + zero_term`` otherwise); the forward takes any leading shape, like
`nn.Linear`, and returns `x`'s dtype (float32 on the CPU). On CUDA the Triton kernel of
:mod:`batchgen.kernels.quant_linear_triton` multiplies, adding `zero_term` to each weight in registers; without
either kernel the layer multiplies by `dense_weight()` (correct, slow).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from batchgen.kernels import cpu_quant_linear
from batchgen.models.quant.quant_linear import multiply_parts, on_triton


@dataclass
class IntPart:
    """Rows of one projection: `values` ``[rows, in]`` unsigned stored values (in the order of `perm` when set),
    `scales` ``[rows, in / group]`` float32, `perm` ``[in]`` int64 or None, `zero_term` ``[rows, in / group]``
    float32 ``(2^(bits-1) - zero) * scale`` or None (symmetric)."""

    values: Tensor
    scales: Tensor
    bits: int
    group: int
    perm: Tensor | None = None
    zero_term: Tensor | None = None

    def same_layout(self, other: IntPart) -> bool:
        if (self.bits, self.group) != (other.bits, other.group) or (self.perm is None) != (
            other.perm is None
        ):
            return False
        if (self.zero_term is None) != (other.zero_term is None):
            return False
        return self.perm is None or torch.equal(self.perm, other.perm)


def pack_along_inputs(values: Tensor, bits: int) -> Tensor:
    """``[rows, in]`` unsigned values → ``[rows, in * bits / 32]`` int32 words, value ``j`` of a word in bits
    ``bits*j ...`` (compressed-tensors' pack_to_int32 layout)."""
    per = 32 // bits
    v = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    words = np.bitwise_or.reduce(v << shifts, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(words).view(np.int32))


def unpack_words(words: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words → their unsigned `bits`-bit values, value ``j`` of each word (bits ``bits*j ...``) at index
    ``word * (32 / bits) + j`` along `dim` (0: packed along rows, as GPTQ's qweight; 1: along columns)."""
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        v = (w.unsqueeze(1) >> shifts[None, :, None]) & mask  # [R, per, C]
        return v.reshape(words.shape[0] * per, words.shape[1])
    v = (w.unsqueeze(-1) >> shifts) & mask  # [R, C, per]
    return v.reshape(words.shape[0], words.shape[1] * per)


def add_to_each_value(words: Tensor, bits: int) -> Tensor:
    """Add 1 to every `bits`-bit value of int32 words as one 32-bit addition (GPTQModel's v1 → v2 zero-point
    conversion: a value 2^bits - 1 carries into the next one)."""
    ones = sum(1 << s for s in range(0, 32, bits))
    return (words.to(torch.int64) + ones) & 0xFFFFFFFF


class GroupQuantLinear(nn.Module):
    keeps_layout = True

    def __init__(self, in_features: int, parts: list[IntPart], bias: Tensor | None = None) -> None:
        super().__init__()
        merged: list[IntPart] = []
        for p in parts:  # consecutive parts of one layout become one (fewer kernel calls, one gather)
            if merged and merged[-1].same_layout(p):
                last = merged[-1]
                zero = None if p.zero_term is None else torch.cat([last.zero_term, p.zero_term])
                merged[-1] = IntPart(torch.cat([last.values, p.values]), torch.cat([last.scales, p.scales]),
                                     p.bits, p.group, p.perm, zero)  # fmt: skip
            else:
                merged.append(p)
        self.in_features = in_features
        self.out_features = sum(p.values.shape[0] for p in merged)
        self.bits = [p.bits for p in merged]
        self.groups = [p.group for p in merged]
        self.packed = nn.ParameterList(
            nn.Parameter(pack_along_inputs(p.values, p.bits), requires_grad=False) for p in merged
        )
        self.scales = nn.ParameterList(
            nn.Parameter(p.scales.float().contiguous(), requires_grad=False) for p in merged
        )
        for i, p in enumerate(merged):
            self.register_buffer(f"perm{i}", p.perm, persistent=False)
            zero = (
                None
                if p.zero_term is None
                else nn.Parameter(p.zero_term.float().contiguous(), requires_grad=False)
            )
            self.register_parameter(f"zero{i}", zero)  # a parameter: the engine's memory sizing counts it
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        )

    def _perm(self, i: int) -> Tensor | None:
        return getattr(self, f"perm{i}")

    def forward(self, x: Tensor) -> Tensor:
        triton = on_triton(x)
        if not triton and not cpu_quant_linear.available():
            return nn.functional.linear(x, self.dense_weight(), self.bias)

        def product(i: int, rows: Tensor, bias: Tensor | None, out: Tensor) -> None:
            perm = self._perm(i)
            inputs = rows if perm is None else rows.index_select(1, perm)
            zero = getattr(self, f"zero{i}")
            if triton:  # the zero term is added to each weight in registers (Triton imported only here)
                from batchgen.kernels.quant_linear_triton import int_linear_triton

                int_linear_triton(inputs, self.packed[i], self.bits[i], self.scales[i], self.groups[i], bias,
                                  zero=zero, out=out)  # fmt: skip
                return
            cpu_quant_linear.int_linear(inputs, self.packed[i], self.bits[i], self.scales[i], self.groups[i], bias,
                                        out=out)  # fmt: skip
            if (
                zero is not None
            ):  # the zero points' share: each group's input sum times (offset - zero) * scale
                out.addmm_(inputs.reshape(inputs.shape[0], -1, self.groups[i]).sum(-1), zero.t())

        return multiply_parts(x, self.in_features, [p.shape[0] for p in self.packed], self.bias, product)

    def dense_weight(self) -> Tensor:
        """The dequantized ``[out, in]`` float32 weight, inputs in the checkpoint's order."""
        ws = []
        for i, (packed, scales) in enumerate(zip(self.packed, self.scales)):
            b = self.bits[i]
            u = unpack_words(packed.data, b, dim=1)
            w = (u - (1 << (b - 1))).float() * scales.repeat_interleave(self.groups[i], dim=1)
            zero = getattr(self, f"zero{i}")
            if zero is not None:
                w += zero.repeat_interleave(self.groups[i], dim=1)
            perm = self._perm(i)
            if perm is not None:
                w = torch.empty_like(w).index_copy_(1, perm, w)
            ws.append(w)
        return torch.cat(ws)

    def extra_repr(self) -> str:
        kinds = "+".join(
            f"int{b}/g{g}{'/perm' if self._perm(i) is not None else ''}"
            for i, (b, g) in enumerate(zip(self.bits, self.groups))
        )
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"
