"""`QuantLinear`: a linear layer over weight-only quantized rows (GGUF's block formats), multiplied in float32 by
the C kernel of :mod:`batchgen.kernels.cpu_quant_linear` without ever widening the weights in memory.

A fused projection (q/k/v, gate/up) may hold parts in different formats (llama.cpp's mixes, e.g. ``attn_v`` in
Q6_K beside ``attn_q`` in Q4_K): each part is one packed ``[rows, row_bytes]`` uint8 parameter and writes its own
columns of the output. Invariants: `out_features` is the parts' rows summed, in order; `dense_weight()` is the
dequantized ``[out, in]`` weight (bit for bit gguf-py's dequantization); the forward takes and returns float32
and accepts any leading shape, like `nn.Linear`. Without the C kernels the forward multiplies by the dequantized
weight (correct, slow).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchgen.kernels import cpu_quant_linear


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
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if not cpu_quant_linear.available():
            return nn.functional.linear(x, self.dense_weight(), self.bias)
        if len(self.type_ids) == 1:
            out = cpu_quant_linear.linear(
                rows, self.weights[0], self.type_ids[0], self.in_features, self.bias
            )
            return out.view(*lead, self.out_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        col = 0
        for packed, type_id in zip(self.weights, self.type_ids):
            n = packed.shape[0]
            bias = None if self.bias is None else self.bias[col : col + n]
            cpu_quant_linear.linear(rows, packed, type_id, self.in_features, bias, out=out[:, col : col + n])
            col += n
        return out.view(*lead, self.out_features)

    def dense_weight(self) -> Tensor:
        """The dequantized ``[out, in]`` float32 weight."""
        return torch.cat(
            [cpu_quant_linear.dequantize(p, t, self.in_features) for p, t in zip(self.weights, self.type_ids)]
        )

    def extra_repr(self) -> str:
        formats = "+".join(cpu_quant_linear.FORMATS[t].name for t in self.type_ids)
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={formats}"
