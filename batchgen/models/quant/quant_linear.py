"""`QuantLinear`: a linear layer over weight-only quantized rows (GGUF's block formats), multiplied in float32 by
the C kernel of :mod:`batchgen.kernels.cpu_quant_linear` without ever widening the weights in memory.

A fused projection (q/k/v, gate/up) may hold parts in different formats (llama.cpp's mixes, e.g. ``attn_v`` in
Q6_K beside ``attn_q`` in Q4_K): each part is one packed ``[rows, row_bytes]`` uint8 parameter and writes its own
columns of the output. Invariants: `out_features` is the parts' rows summed, in order; `dense_weight()` is the
dequantized ``[out, in]`` weight (bit for bit gguf-py's dequantization); the forward takes and returns float32
and accepts any leading shape, like `nn.Linear`. Without the C kernels the forward multiplies by the dequantized
weight (correct, slow). On a GPU a GGUF checkpoint's projections are repacked at load into
:class:`~batchgen.models.quant.group_linear.GroupQuantLinear` (:mod:`.gguf_repack`), which the Triton kernels
multiply by.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from batchgen.kernels import cpu_quant_linear


def on_triton(x: Tensor) -> bool:
    """Whether the quantized layers multiply `x` with the Triton kernels of
    :mod:`batchgen.kernels.quant_linear_triton`: CUDA inputs, or any input under ``TRITON_INTERPRET=1`` (every
    launch interpreted: how the CPU tests run the GPU path). Otherwise the C kernels (CPU)."""
    return x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def multiply_parts(
    x: Tensor,
    in_features: int,
    rows: Sequence[int],
    bias: Tensor | None,
    product: Callable[[int, Tensor, Tensor | None, Tensor], object],
) -> Tensor:
    """``x [..., in_features]`` times a fused projection's parts -> ``[..., sum(rows)]`` in `x`'s dtype: part ``i``
    (``rows[i]`` outputs) writes its columns of one output with ``product(i, x_rows, bias_slice, out_view)``
    (``x_rows`` ``[M, in_features]``, ``out_view`` the part's ``[M, rows[i]]`` columns, ``bias_slice`` its
    slice of ``bias`` or None). The quantized layers' shared frame: one output, no concatenation."""
    lead = x.shape[:-1]
    x_rows = x.reshape(-1, in_features)
    out = torch.empty(x_rows.shape[0], sum(rows), dtype=x.dtype, device=x.device)
    col = 0
    for i, n in enumerate(rows):
        product(i, x_rows, None if bias is None else bias[col : col + n], out[:, col : col + n])
        col += n
    return out.view(*lead, out.shape[1])


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, parts: list[tuple[Tensor, int]], bias: Tensor | None = None) -> None:
        super().__init__()
        merged: list[tuple[Tensor, int]] = []
        for packed, type_id in parts:  # consecutive parts of one format become one (fewer kernel calls)
            if type_id not in cpu_quant_linear.FORMATS:
                raise ValueError(f"unsupported block format {type_id}")
            if merged and merged[-1][1] == type_id:
                merged[-1] = (torch.cat([merged[-1][0], packed]), type_id)
            else:
                merged.append((packed.contiguous(), type_id))
        self.in_features = in_features
        self.out_features = sum(p.shape[0] for p, _ in merged)
        self.weights = nn.ParameterList(nn.Parameter(p, requires_grad=False) for p, _ in merged)
        self.type_ids = [t for _, t in merged]
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        )

    def forward(self, x: Tensor) -> Tensor:
        if not cpu_quant_linear.available():
            return nn.functional.linear(x, self.dense_weight(), self.bias)

        def product(i: int, rows: Tensor, bias: Tensor | None, out: Tensor) -> None:
            cpu_quant_linear.linear(rows, self.weights[i], self.type_ids[i], self.in_features, bias, out=out)

        return multiply_parts(x, self.in_features, [w.shape[0] for w in self.weights], self.bias, product)

    def dense_weight(self) -> Tensor:
        """The dequantized ``[out, in]`` float32 weight."""
        return torch.cat(
            [cpu_quant_linear.dequantize(p, t, self.in_features) for p, t in zip(self.weights, self.type_ids)]
        )

    def extra_repr(self) -> str:
        formats = "+".join(cpu_quant_linear.FORMATS[t].name for t in self.type_ids)
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={formats}"
