"""GPTQ and AWQ checkpoints (``quantization_config.quant_method`` ``gptq`` / ``awq``), repacked at load into
:class:`~batchgen.models.quant.group_linear.GroupQuantLinear` parts for the CPU integer GEMM.

The layouts, as AutoGPTQ / GPTQModel and AutoAWQ write them (``K`` inputs, ``N`` outputs, ``G`` groups):

* **GPTQ**: ``qweight`` ``[K * bits / 32, N]`` int32, packed along K (value ``j`` of word ``i`` is input
  ``i * 32/bits + j``, bits ``bits*j ...``); ``qzeros`` ``[G, N * bits / 32]`` int32 packed along N the same
  way; ``scales`` ``[G, N]`` float16; ``g_idx`` ``[K]`` int32, the group of each input (``k // group_size``
  without ``desc_act``, any assignment with it). ``w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``,
  where ``checkpoint_format`` ``gptq`` (v1, the default and what checkpoints on the hub are) stores ``z - 1``
  (read back as GPTQModel does: one 32-bit addition of 1 to every value) and ``gptq_v2`` stores ``z``.
* **AWQ** (``version: gemm``): ``qweight`` ``[K, N * 4 / 32]`` int32 packed along N in AutoAWQ's interleaved
  order (value ``i`` of word ``c`` is output ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``); ``qzeros`` ``[G, N / 8]``
  packed the same way (no offset); ``scales`` ``[G, N]`` float16. ``w[n, k] = (q[k, n] - z[k // g, n]) * s``.

Symmetric weights dequantize exactly in float32 (a ≤ 8-bit integer times a float16 scale): their
:meth:`GroupQuantLinear.dense_weight` equals a float64 dequantization bit for bit; other zero points add their
share after the GEMM (:mod:`.group_linear`), equal to it up to float32 rounding.

Groups need not divide the inputs: GPTQ stores ``ceil(K / group_size)`` groups, the last one short
(:func:`to_part` cuts them into equal runs). Refused by name (:class:`UnsupportedCheckpoint`): other bit widths
(GPTQ 2/3-bit, AWQ other than 4-bit), other serialisations (GPTQ ``marlin``/``bitblas``, AWQ
``gemv``/``gemv_fast``/``marlin``/``exllama``), and group sizes sharing no multiple of 8 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.group_linear import GroupQuantLinear, IntPart, add_to_each_value, unpack_words

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's GEMM packing: value ``i`` of a word holds output ``AWQ_ORDER[i]`` of its eight."""


@dataclass(frozen=True)
class GPTQScheme:
    """`bits` 4 or 8; `v1`: zero points stored minus one (``checkpoint_format`` ``gptq``)."""

    bits: int
    v1: bool = True
    group_size: int | None = None
    """Inputs per group (None: one group per row), for projections stored without a ``g_idx``."""
    method: str = "gptq"
    tensors = ("qweight", "qzeros", "scales", "g_idx")

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.qweight" in names

    def build(self, in_features: int, prefixes: list[str], get, bias: Tensor | None) -> GroupQuantLinear:
        parts = [self.part(in_features, p, get) for p in prefixes]
        return GroupQuantLinear(in_features, parts, bias)

    def part(self, k: int, prefix: str, get) -> IntPart:
        qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
        q = unpack_words(qweight, self.bits, dim=0)  # [K, N]
        if self.v1:  # zero points stored minus one
            qzeros = add_to_each_value(qzeros, self.bits)
        z = unpack_words(qzeros, self.bits, dim=1)  # [G, N]
        g_idx = get(f"{prefix}.g_idx", None)
        g_idx = None if g_idx is None else g_idx.long()
        return to_part(prefix, q, z, scales, self.bits, k, g_idx, self.group_size)


@dataclass(frozen=True)
class AWQScheme:
    bits: int = 4
    method: str = "awq"
    tensors = ("qweight", "qzeros", "scales")

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.qweight" in names

    def build(self, in_features: int, prefixes: list[str], get, bias: Tensor | None) -> GroupQuantLinear:
        parts = []
        for p in prefixes:
            q = _awq_columns(unpack_words(get(f"{p}.qweight"), 4, dim=1))
            z = _awq_columns(unpack_words(get(f"{p}.qzeros"), 4, dim=1))
            parts.append(to_part(p, q, z, get(f"{p}.scales"), 4, in_features, None))
        return GroupQuantLinear(in_features, parts, bias)


def _awq_columns(v: Tensor) -> Tensor:
    """Columns unpacked in AWQ's interleaved order → outputs in order."""
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # output j of a word sits at value inverse[j]
    cols = v.shape[1]
    index = (torch.arange(0, cols, 8)[:, None] + inverse[None, :]).reshape(-1)
    return v.index_select(1, index)


def to_part(
    prefix: str,
    q: Tensor,
    z: Tensor,
    scales: Tensor,
    bits: int,
    k: int,
    g_idx: Tensor | None,
    group_size: int | None = None,
) -> IntPart:
    """One checkpoint projection as an :class:`IntPart`: `q` ``[K, N]`` and `z` ``[G, N]`` unsigned integers,
    `scales` ``[G, N]``, `g_idx` ``[K]`` the group of each input (None: ``k // group_size``, or ``k // (K / G)``
    without a `group_size`).

    Groups may hold unequal numbers of inputs (a last group cut short when ``group_size`` does not divide K, as
    GPTQ quantizes such rows: ``G = ceil(K / group_size)``; act-order over such groups). The inputs are put in
    group order (`perm`, when `g_idx` is not already sorted) and cut into runs of the greatest common divisor of
    the group sizes, each run taking its group's scale and zero point: the same weights, in equal groups."""
    if q.shape[0] != k:
        raise ValueError(f"{prefix}.qweight holds {q.shape[0]} inputs, the model has {k}")
    groups, n = scales.shape
    if z.shape != (groups, n) or q.shape[1] != n:
        raise ValueError(
            f"{prefix}: qzeros {tuple(z.shape)} / scales {tuple(scales.shape)} do not match {k} inputs x {n} outputs"
        )
    if g_idx is None:
        if not group_size or group_size < 0:
            if k % groups:
                raise ValueError(f"{prefix}: {groups} groups of scales do not divide {k} inputs")
            group_size = k // groups
        g_idx = torch.arange(k) // group_size
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{prefix}.g_idx must hold {k} group indices in [0, {groups})")
    perm = None if bool((g_idx[1:] >= g_idx[:-1]).all()) else torch.argsort(g_idx, stable=True)
    sizes = torch.bincount(g_idx, minlength=groups).tolist()
    group = math.gcd(*sizes)
    if group % 8:
        raise UnsupportedCheckpoint(
            f"{prefix}: groups of {', '.join(map(str, sorted(set(sizes))))} inputs share no multiple of 8 inputs: "
            "batchgen runs group sizes whose greatest common divisor is a multiple of 8"
        )
    owner = (g_idx if perm is None else g_idx.index_select(0, perm))[::group]  # each run's group
    scales, z = scales.index_select(0, owner), z.index_select(0, owner)
    values = (q if perm is None else q.index_select(0, perm)).t()  # [N, K] in group order
    offset = 1 << (bits - 1)
    zero_term = None
    if not bool((z == offset).all()):  # the zero points' share, added after the GEMM (group_linear)
        zero_term = ((offset - z).double() * scales.double()).t().float()
    return IntPart(
        values.to(torch.uint8).contiguous(), scales.float().t().contiguous(), bits, group, perm, zero_term
    )


def gptq_scheme(q: dict, where: str) -> GPTQScheme:
    bits = q.get("bits")
    fmt = q.get("checkpoint_format") or q.get("format") or "gptq"
    if q.get("is_marlin_format"):
        fmt = "marlin"
    problems = []
    if bits not in (4, 8):
        problems.append(f"bits={bits}")
    if fmt not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint_format={fmt!r}")
    if problems:
        raise UnsupportedCheckpoint(
            f"{where}: GPTQ {', '.join(problems)} not supported; batchgen runs 4- and 8-bit GPTQ "
            "(checkpoint_format gptq or gptq_v2; any group size, desc_act, sym or asym)"
        )
    group_size = q.get("group_size")
    group_size = int(group_size) if isinstance(group_size, int) and group_size > 0 else None
    return GPTQScheme(int(bits), v1=fmt == "gptq", group_size=group_size)


def awq_scheme(q: dict, where: str) -> AWQScheme:
    bits, version = q.get("bits", q.get("w_bit")), str(q.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or q.get("zero_point") is False:
        raise UnsupportedCheckpoint(
            f"{where}: AWQ bits={bits} version={version!r} zero_point={q.get('zero_point')} not supported; batchgen "
            "runs 4-bit AWQ with zero points in GEMM packing (version gemm)"
        )
    return AWQScheme()
