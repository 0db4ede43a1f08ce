"""Float32 CPU projections with oneDNN-packed weights.

:func:`fast_cpu_weights` is what the loader runs once on a loaded native model, and
:func:`pack_transformers_linears` on a decoder built by transformers' modeling code (the transformers-backed
path; the embedding encoders keep MKL: their batches are thousands of rows). Where oneDNN is available
(torch's x86-64 builds have it), each `nn.Linear` of the model becomes a :class:`PackedLinear`: the
same module (name, `in_features`, `out_features`, bias), its weight reordered once into oneDNN's blocked
layout for the machine's instruction set (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied with
`torch.ops.mkldnn._linear_pointwise`. Stacked expert weights (not `nn.Linear`) are stored column-major instead,
and so is every projection where oneDNN is missing (`use_column_major_weights`).

Why: on the 2-CPU AVX2 machine the benchmarks run on, a decode step's projections (64 rows) of the
benchmark model took 56 ms with oneDNN against 89 ms with MKL's column-major GEMM, and 4096-wide weights ran
1.2-3.7x faster than as loaded from 2-3 rows on; prefill-sized products gain 0-50% (`python -m
batchgen.bench.decode_ceiling`, `python -m batchgen.bench.model_impls --gemm-layout`, BENCHMARKS.md). The cost:
a fixed ~35 us per call, which makes 1-4 rows on small weights slower than MKL. Results differ from MKL's in
the last bits only (another summation order); greedy outputs equal transformers' in the equality tests.

Invariants: a `PackedLinear`'s `weight` is a non-trainable parameter holding an mkldnn tensor
(`weight.is_mkldnn`, shape `[out, in]`), and `weight.to_dense()` equals the loaded weight bit for bit; its
forward accepts any leading shape, like `nn.Linear`. A tied LM head (one table with the embedding) gets a packed
copy when the table is at most `TIED_HEAD_COPY_MAX_BYTES`; a larger one stays shared and unpacked, so packing
never costs more than that in memory. Only float32 CPU weights are touched.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

TIED_HEAD_COPY_MAX_BYTES = 1 << 30
"""A tied LM head is packed as its own copy only up to this size (bytes); the embedding keeps the table."""

BATCH_HINT = 64
"""Rows oneDNN tunes the packed layout for (a decode step's batch); any row count is still accepted."""


def onednn_available() -> bool:
    """Whether this torch build can pack float32 linear weights for oneDNN (and ``BATCHGEN_ONEDNN=0`` is not
    set: that keeps MKL's column-major path)."""
    if os.environ.get("BATCHGEN_ONEDNN", "1").strip() == "0":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """`nn.Linear` over a oneDNN-packed float32 weight (see the module docstring)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and w is not None
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and not w.is_mkldnn
    )


def pack_linears(model: nn.Module, shared: set[int] = frozenset()) -> int:
    """Replace each packable `nn.Linear` under `model` with a `PackedLinear`, in place, one at a time (peak
    memory: the model plus one weight); a linear whose weight is in `shared` (ids of tensors other modules read
    too) is packed as a copy only within `TIED_HEAD_COPY_MAX_BYTES`. Returns how many were packed."""
    names = [name for name, m in model.named_modules() if _packable(m)]
    count = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        w = getattr(parent, attr).weight
        if id(w) in shared and w.numel() * w.element_size() > TIED_HEAD_COPY_MAX_BYTES:
            continue
        setattr(parent, attr, PackedLinear.from_linear(getattr(parent, attr)))
        count += 1
    return count


def use_column_major_weights(model: nn.Module, skip: set[int] = frozenset()) -> None:
    """Store float32 CPU matrices (≥ 2-D parameters not in `skip`) column-major, in place: each `[out, in]`
    weight keeps its shape, name and values, but its memory becomes its transpose, `[in, out]` contiguous
    (experts: `[E, in, out]`).

    Why: `F.linear(x, W)` multiplies by `W.t()`, and MKL's float32 GEMM is faster when that operand is
    untransposed in memory (up to 1.7x at 4-64 rows, about even at 256, 0.8-0.97x at 2-3 rows: `python -m
    batchgen.bench.model_impls --gemm-layout`). From 16 rows on the results are bit for bit the same. Costs one
    parameter's copy at a time.
    """
    for param in model.parameters():
        if param.device.type != "cpu" or param.dtype != torch.float32 or param.dim() < 2 or param.is_mkldnn:
            continue
        if id(param) in skip:
            continue
        param.data = param.data.transpose(-2, -1).contiguous().transpose(-2, -1)


@torch.no_grad()
def pack_transformers_linears(model: nn.Module) -> int:
    """Pack the `nn.Linear` layers of a model built by transformers' own modeling code (float32 CPU only; its
    embeddings keep their tables, a tied head is a tied head as above). Other layouts are left as loaded:
    transformers' code multiplies by some weights untransposed (GPT-2's `Conv1D`)."""
    if not onednn_available():
        return 0
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return pack_linears(model, shared=tables)


@torch.no_grad()
def fast_cpu_weights(model: nn.Module, keep: list[Tensor]) -> None:
    """Lay out a loaded model's float32 CPU weights for speed (module docstring). `keep` are tables read row by
    row (embeddings), which keep their layout; a linear sharing one of them is a tied head."""
    kept = {id(t) for t in keep}
    if onednn_available():
        pack_linears(model, shared=kept)
    use_column_major_weights(model, skip=kept)
