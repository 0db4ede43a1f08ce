"""Float32 CPU projections over packed weights.

:func:`fast_cpu_weights` is what the loader runs once on a loaded native model, and
:func:`pack_transformers_linears` on a decoder built by transformers' modeling code (the transformers-backed
path; the embedding encoders keep MKL: their batches are thousands of rows). Each `nn.Linear` of the model
becomes a :class:`PackedLinear`: the same module (name, `in_features`, `out_features`, bias) over its weight
packed once, in one of two layouts:

* ``panels`` (where batchgen's C kernels build: :mod:`batchgen.kernels.cpu_linear`): 16-column panels
  multiplied by batchgen's own GEMM;
* ``onednn`` (the C kernels off or unbuildable, torch built with oneDNN): oneDNN's blocked layout for the
  machine's instruction set (`torch.ops.mkldnn._reorder_linear_weight`), multiplied with
  `torch.ops.mkldnn._linear_pointwise`.

Stacked expert weights (not `nn.Linear`) are stored column-major instead, and so is every projection where
neither layout is available (`use_column_major_weights`).

Narrow weights (bfloat16 / float16, :mod:`batchgen.models.quant.weight_dtype`): `fast_cpu_weights(...,
narrow=True)` packs them into panels of their own dtype, which the GEMM widens to float32 in registers; where
the C kernels are off, they stay ``dense`` (`[out, in]`, widened per call). Either way the module takes and
returns float32; every other floating parameter but the kept tables is widened to float32 once.

Why: on the 2-CPU AVX2 machine the benchmarks run on, a decode step's projections (64 rows) of the benchmark
model took 38.1 ms with batchgen's GEMM, 46.4 ms with oneDNN and 55.2 ms with MKL's column-major GEMM, and
batchgen's GEMM was the fastest from 1 row to 1,024 (`python -m batchgen.bench.decode_ceiling`,
BENCHMARKS.md). Results differ from MKL's in the last bits only (another summation order); greedy outputs
equal transformers' in the equality tests.

Invariants: a `PackedLinear`'s `weight` is a non-trainable parameter in its `layout` (panels: `[ceil(out / 16),
in, 16]`; onednn: an mkldnn tensor of shape `[out, in]`), and `dense_weight()` equals the loaded weight bit for
bit; its forward accepts any leading shape, like `nn.Linear`. A tied LM head (one table with the embedding)
gets a packed copy when the table is at most `TIED_HEAD_COPY_MAX_BYTES`; a larger one stays shared and
unpacked, so packing never costs more than that in memory (a narrow one then multiplies the shared table
``dense``). Only CPU weights are touched.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from batchgen.kernels import cpu_linear

TIED_HEAD_COPY_MAX_BYTES = 1 << 30
"""A tied LM head is packed as its own copy only up to this size (bytes); the embedding keeps the table."""

BATCH_HINT = 64
"""Rows oneDNN tunes its packed layout for (a decode step's batch); any row count is still accepted."""


def onednn_available() -> bool:
    """Whether this torch build can pack float32 linear weights for oneDNN (and ``BATCHGEN_ONEDNN=0`` is not
    set)."""
    if os.environ.get("BATCHGEN_ONEDNN", "1").strip() == "0":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_layout() -> str | None:
    """The layout new `PackedLinear`s take here: ``panels``, ``onednn``, or None (neither: column-major)."""
    if cpu_linear.available():
        return "panels"
    return "onednn" if onednn_available() else None


class PackedLinear(nn.Module):
    """`nn.Linear` over a packed float32 weight (see the module docstring)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, layout: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.layout = layout or packed_layout() or "onednn"
        if weight.dtype != torch.float32 and self.layout == "onednn":
            self.layout = "dense"  # oneDNN's packed float32 linear has no narrow-weight form here
        if self.layout == "dense":
            packed = weight.detach()
            bias = None if bias is None else bias.detach().float().contiguous()
        elif self.layout == "panels":
            packed = cpu_linear.pack(weight)
            bias = None if bias is None else cpu_linear.pack_bias(bias, self.out_features)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
            bias = None if bias is None else bias.detach().contiguous()
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, layout: str | None = None) -> PackedLinear:
        return cls(linear.weight, linear.bias, layout)

    def forward(self, x: Tensor) -> Tensor:
        if self.layout == "panels":
            return cpu_linear.linear(x, self.weight, self.bias, self.out_features)
        if self.layout == "dense":
            return nn.functional.linear(x, self.weight.to(x.dtype), self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def dense_weight(self) -> Tensor:
        """The `[out, in]` weight as loaded (a copy)."""
        if self.layout == "panels":
            return cpu_linear.unpack(self.weight, self.out_features)
        if self.layout == "dense":
            return self.weight.clone()
        return self.weight.to_dense()

    def dense_bias(self) -> Tensor | None:
        """The `[out]` bias as loaded (None without one)."""
        return None if self.bias is None else self.bias[: self.out_features]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"layout={self.layout}"
        )


NARROW_DTYPES = (torch.bfloat16, torch.float16)


def _packable(module: nn.Module, narrow: bool = False) -> bool:
    w = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and w is not None
        and w.device.type == "cpu"
        and (w.dtype == torch.float32 or (narrow and w.dtype in NARROW_DTYPES))
        and not w.is_mkldnn
    )


def pack_linears(model: nn.Module, layout: str, shared: set[int] = frozenset(), narrow: bool = False) -> int:
    """Replace each packable `nn.Linear` under `model` with a `PackedLinear` in `layout`, in place, one at a
    time (peak memory: the model plus one weight); a linear whose weight is in `shared` (ids of tensors other
    modules read too) is packed as a copy only within `TIED_HEAD_COPY_MAX_BYTES` (a narrow one is otherwise
    multiplied ``dense`` over the shared table). `narrow`: bfloat16 / float16 weights are packed too, in their
    dtype. Returns how many were packed."""
    names = [name for name, m in model.named_modules() if _packable(m, narrow)]
    count = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        w = getattr(parent, attr).weight
        how = layout
        if id(w) in shared and w.numel() * w.element_size() > TIED_HEAD_COPY_MAX_BYTES:
            if w.dtype == torch.float32:
                continue
            how = "dense"
        setattr(parent, attr, PackedLinear.from_linear(getattr(parent, attr), how))
        count += 1
    return count


def use_column_major_weights(model: nn.Module, skip: set[int] = frozenset()) -> None:
    """Store float32 CPU matrices (≥ 2-D parameters not in `skip` nor packed) column-major, in place: each `[out, in]`
    weight keeps its shape, name and values, but its memory becomes its transpose, `[in, out]` contiguous
    (experts: `[E, in, out]`).

    Why: `F.linear(x, W)` multiplies by `W.t()`, and MKL's float32 GEMM is faster when that operand is
    untransposed in memory (up to 1.7x at 4-64 rows, about even at 256, 0.8-0.97x at 2-3 rows: `python -m
    batchgen.bench.model_impls --gemm-layout`). From 16 rows on the results are bit for bit the same. Costs one
    parameter's copy at a time.
    """
    packed = {
        id(p)
        for m in model.modules()
        if isinstance(m, PackedLinear) or getattr(m, "keeps_layout", False)  # quantized layers' scales
        for p in m.parameters()
    }
    for param in model.parameters():
        if param.device.type != "cpu" or param.dtype != torch.float32 or param.dim() < 2 or param.is_mkldnn:
            continue
        if id(param) in skip or id(param) in packed:
            continue
        param.data = param.data.transpose(-2, -1).contiguous().transpose(-2, -1)


@torch.no_grad()
def pack_transformers_linears(model: nn.Module) -> int:
    """Pack the `nn.Linear` layers of a model built by transformers' own modeling code (float32 CPU only; its
    embeddings keep their tables, a tied head is a tied head as above). Other layouts are left as loaded:
    transformers' code multiplies by some weights untransposed (GPT-2's `Conv1D`)."""
    layout = packed_layout()
    if layout is None:
        return 0
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return pack_linears(model, layout, shared=tables)


@torch.no_grad()
def fast_cpu_weights(model: nn.Module, keep: list[Tensor], narrow: bool = False) -> None:
    """Lay out a loaded model's CPU weights for speed (module docstring). `keep` are tables read row by row
    (embeddings), which keep their layout and dtype; a linear sharing one of them is a tied head. `narrow`:
    the model was loaded in bfloat16 / float16 to compute in float32: its linears are packed narrow (``dense``
    without the C kernels) and every other floating parameter and buffer is widened to float32."""
    kept = {id(t) for t in keep}
    layout = packed_layout()
    if layout is not None or narrow:
        pack_linears(model, layout or "dense", shared=kept, narrow=narrow)
    if narrow:
        _widen_the_rest(model, kept)
    use_column_major_weights(model, skip=kept)


def _widen_the_rest(model: nn.Module, kept: set[int]) -> None:
    """Every floating parameter and buffer to float32, except `PackedLinear` weights and the kept tables."""
    packed = {id(m.weight) for m in model.modules() if isinstance(m, PackedLinear)}
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != torch.float32 and id(param) not in kept | packed:
            param.data = param.data.float()
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                setattr(module, name, buf.float())


def dense_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """`model.state_dict()` with every `PackedLinear`'s weight and bias as loaded (`[out, in]`, `[out]`)."""
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            prefix = f"{name}." if name else ""
            state[f"{prefix}weight"] = module.dense_weight()
            if module.bias is not None:
                state[f"{prefix}bias"] = module.dense_bias()
    return state
