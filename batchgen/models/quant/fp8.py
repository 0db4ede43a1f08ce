"""fp8 weights: compressed-tensors' ``float-quantized`` checkpoints (float8_e4m3fn ``weight`` with a per-tensor,
per-channel or block ``weight_scale``) and fine-grained block fp8 (``quant_method: fp8`` with
``weight_block_size``, DeepSeek-V3 / Qwen3-FP8 style: ``weight`` float8_e4m3fn and ``weight_scale_inv``
``[ceil(N / bn), ceil(K / bk)]`` float32).

Each target projection becomes an :class:`Fp8Linear` holding the fp8 bytes (one byte per weight) and its scales
as one float32 scale per output row and block of ``block_k`` inputs. The forward dequantizes the layer's weight
in float32 (``fp8 → float32``, times the scale: the one rounding transformers' dequantization does) and
multiplies in float32; activations are not quantized. That is what transformers computes on a CPU: its
fine-grained fp8 integration dequantizes on machines without an fp8 GPU, and compressed-tensors decompresses to
float32. On the CPU the weight-only GEMM of :mod:`batchgen.kernels.cpu_quant_linear` widens the fp8 bytes in
registers as it multiplies (``fp8_linear``: the same dequantized values), and on CUDA the Triton kernel of
:mod:`batchgen.kernels.quant_linear_triton` decodes the bytes in registers likewise; elsewhere (CPU scale blocks
that do not divide the inputs) the layer's float32 weight is widened for the step. fp8 checkpoints keep a quarter of
float32's weight bytes in memory.

Invariant: `dense_weight()` is ``float32(q) * float32(scale)`` elementwise, bit for bit transformers' and
compressed-tensors' float32 dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from batchgen.kernels import cpu_quant_linear
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.input_quant import InputQuant, with_inputs
from batchgen.models.quant.quant_linear import multiply_parts, on_triton

FP8 = torch.float8_e4m3fn
_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()
"""float32 value of each fp8 byte: a table lookup widens 10x faster than torch's fp8 cast on the CPU, same bits."""


@dataclass(frozen=True)
class Fp8Scheme:
    """`scale_name`: the scale tensor's suffix; `block`: (rows, inputs) per scale for block scales, else None
    (one scale per tensor or per output row)."""

    scale_name: str
    block: tuple[int, int] | None = None
    method: str = "fp8"
    inputs: InputQuant | None = None
    """Quantized input activations (compressed-tensors FP8_DYNAMIC, static fp8 input scales), or None."""

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.{self.scale_name}" in names

    def build(self, in_features: int, prefixes: list[str], get, bias: Tensor | None) -> nn.Module:
        linear = Fp8Linear(in_features, [self.part(in_features, p, get) for p in prefixes], bias)
        return with_inputs(linear, self.inputs, prefixes, get)

    def part(self, k: int, prefix: str, get) -> tuple[Tensor, Tensor, int]:
        w, s = get(f"{prefix}.weight"), get(f"{prefix}.{self.scale_name}").float()
        if w.dtype != FP8:
            raise UnsupportedCheckpoint(
                f"{prefix}.weight is {w.dtype}: batchgen runs fp8 weights in float8_e4m3fn"
            )
        n = w.shape[0]
        if w.shape[1] != k:
            raise ValueError(f"{prefix}.weight has shape {tuple(w.shape)}, the model has {k} inputs")
        if s.numel() == 1:
            return w, s.reshape(1, 1).expand(n, 1).contiguous(), k
        if s.numel() == n and (s.dim() == 1 or s.shape[-1] == 1):
            return w, s.reshape(n, 1).contiguous(), k
        if self.block is None:
            raise ValueError(
                f"{prefix}.{self.scale_name} has shape {tuple(s.shape)} for a weight of {n} rows"
            )
        bn, bk = self.block
        want = (-(-n // bn), -(-k // bk))
        if tuple(s.shape) != want:
            raise ValueError(
                f"{prefix}.{self.scale_name} has shape {tuple(s.shape)}, expected {want} for blocks {self.block}"
            )
        return w, s.repeat_interleave(bn, dim=0)[:n].contiguous(), bk


class Fp8Linear(nn.Module):
    """A projection over fp8 weights (module docstring). Parts of a fused projection with the same scale
    block are concatenated; each part is ``weights[i]`` ``[rows, in]`` (fp8 bytes, held as uint8) and
    ``scales[i]`` ``[rows, ceil(in / block_k[i])]`` float32."""

    keeps_layout = True

    def __init__(
        self, in_features: int, parts: list[tuple[Tensor, Tensor, int]], bias: Tensor | None
    ) -> None:
        super().__init__()
        merged: list[tuple[Tensor, Tensor, int]] = []
        for w, s, bk in parts:
            if merged and merged[-1][2] == bk:
                merged[-1] = (torch.cat([merged[-1][0], w]), torch.cat([merged[-1][1], s]), bk)
            else:
                merged.append((w, s, bk))
        self.in_features = in_features
        self.out_features = sum(w.shape[0] for w, _, _ in merged)
        self.weights = nn.ParameterList(
            nn.Parameter(w.contiguous().view(torch.uint8), requires_grad=False) for w, _, _ in merged
        )  # uint8: fp8 has no CPU ops, and a float dtype would be widened with the model's other weights
        self.scales = nn.ParameterList(nn.Parameter(s, requires_grad=False) for _, s, _ in merged)
        self.block_k = [bk for _, _, bk in merged]
        self.groups = [min(bk, in_features) for bk in self.block_k]
        """Inputs per scale of each part (the whole row for a per-channel or per-tensor scale)."""
        self.groups_fit = all(g % 8 == 0 and in_features % g == 0 for g in self.groups)
        """Every part's scale groups are whole multiples of 8 inputs dividing ``in_features`` (the C kernel's)."""
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        )

    def forward(self, x: Tensor) -> Tensor:
        triton = on_triton(x)
        if not triton and not self._kernel(x):
            return nn.functional.linear(x, self.dense_weight(), self.bias)
        linear = cpu_quant_linear.fp8_linear
        if triton:
            from batchgen.kernels.quant_linear_triton import fp8_linear_triton  # Triton only where it runs

            linear = fp8_linear_triton

        def product(i: int, rows: Tensor, bias: Tensor | None, out: Tensor) -> None:
            linear(rows, self.weights[i], self.scales[i], self.groups[i], bias, out=out)

        return multiply_parts(x, self.in_features, [w.shape[0] for w in self.weights], self.bias, product)

    def _kernel(self, x: Tensor) -> bool:
        """Whether the C kernel multiplies (float32 CPU input, :attr:`groups_fit`); else the float32 weight is
        widened for the step."""
        return (
            self.groups_fit
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and cpu_quant_linear.available()
        )

    def dense_weight(self) -> Tensor:
        """The dequantized ``[out, in]`` float32 weight."""
        ws = []
        for w, s, bk in zip(self.weights, self.scales, self.block_k):
            scale = s if bk >= self.in_features else s.repeat_interleave(bk, dim=1)[:, : self.in_features]
            values = _VALUES.index_select(0, w.reshape(-1).int()).view(w.shape)
            ws.append(values.mul_(scale))
        return ws[0] if len(ws) == 1 else torch.cat(ws)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, block_k={self.block_k}"


def block_fp8_scheme(q: dict, where: str) -> Fp8Scheme:
    """``quant_method: fp8`` (transformers' FineGrainedFP8Config)."""
    block = q.get("weight_block_size")
    problems = []
    if not (isinstance(block, list | tuple) and len(block) == 2):
        problems.append(f"weight_block_size={block!r}")
    if str(q.get("fmt", "e4m3")) != "e4m3":
        problems.append(f"fmt={q.get('fmt')!r}")
    if str(q.get("activation_scheme", "dynamic")) != "dynamic":
        problems.append(f"activation_scheme={q.get('activation_scheme')!r} (static input scales)")
    if problems:
        raise UnsupportedCheckpoint(
            f"{where}: fp8 {', '.join(problems)} not supported; batchgen runs fine-grained block fp8 (e4m3 weights, "
            "weight_block_size [bn, bk], weight_scale_inv, dynamic activations computed in float32)"
        )
    return Fp8Scheme("weight_scale_inv", (int(block[0]), int(block[1])))
