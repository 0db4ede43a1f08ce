"""compressed-tensors checkpoints (what vLLM's llm-compressor writes), loaded from their ``quantization_config``
without dequantizing the model: the ``pack-quantized`` format with integer weights (W4A16 / W8A16: 4- or 8-bit,
``group`` or ``channel`` strategy), the ``int-quantized`` format (an int8 ``weight`` per value, W8A8) and, through
:mod:`.fp8`, ``float-quantized`` fp8 weights. Symmetric packed weights with unquantized inputs stream in as they
are stored; asymmetric ones (``weight_zero_point``), activation order ``group`` (``weight_g_idx``),
``int-quantized`` weights, quantized inputs and mixes of config groups are repacked at load
(:class:`RepackedIntScheme`); quantized input activations wrap the projection (:mod:`.input_quant`).

Each streamed projection becomes an :class:`IntQuantLinear` holding the checkpoint's own tensors —
``weight_packed`` (int32 words, compressed-tensors' bit layout) and ``weight_scale`` (widened to float32) — so the
loader streams them like any parameter (q/k/v and gate/up fuse by rows, as float weights do); the C kernel of
:mod:`batchgen.kernels.cpu_quant_linear` dequantizes a group chunk at a time in L1 with compressed-tensors'
arithmetic (``(q - offset) * scale``, the scales widened to float32 as transformers' float32 loading widens
them), so greedy output equals transformers' own loading of the checkpoint (which decompresses to float32)
token for token.

Invariant: :func:`quantization_scheme` is the one reading of a ``quantization_config``: it returns the scheme of
each format batchgen runs (this module's :class:`IntScheme` / :class:`RepackedIntScheme`; GPTQ / AWQ:
:mod:`.gptq_awq`; fp8 weights: :mod:`.fp8`) and refuses anything else by name at load and at planning — another
``quant_method`` (bitsandbytes...), another compressed-tensors format or scheme (input activations other than
8-bit int / fp8, output activations, targets other than ``Linear`` and ``re:`` patterns, int beside fp8 groups) —
with an :class:`~batchgen.models.quant.gguf_checkpoint.UnsupportedCheckpoint`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from batchgen.kernels import cpu_quant_linear
from batchgen.models.quant.fp8 import Fp8Scheme, block_fp8_scheme
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.gptq_awq import awq_scheme, gptq_scheme
from batchgen.models.quant.input_quant import InputQuant, with_inputs
from batchgen.models.quant.quant_linear import on_triton

ACTORDER_CONTIGUOUS = ("weight", "static")
"""GPTQ activation orders that change only how the weights were calibrated: the checkpoint's groups are runs of
consecutive inputs, its tensors the same as without one."""
ACTORDER_GROUP = ("group", "dynamic")
"""Activation orders whose groups are scattered over the inputs, mapped by a ``weight_g_idx`` tensor ``[K]`` (older
compressed-tensors checkpoints): repacked at load with the inputs permuted into group order."""


@dataclass(frozen=True)
class IntScheme:
    """Integer weights of one config group: `bits` per value, one scale per `group_size` inputs (None: per output
    row), `symmetric` (no zero points). `round_bf16`: round each dequantized weight to bfloat16 (what
    compressed-tensors computes with bfloat16 scales kept in bfloat16); off for checkpoints, whose scales are
    widened to float32 first, as transformers' float32 loading does. `g_idx`: groups scattered over the inputs
    (activation order ``group``: a ``weight_g_idx`` per projection). `inputs`: quantized input activations
    (:mod:`.input_quant`). `packed`: ``pack-quantized`` (int32 words), else ``int-quantized`` (an int8 ``weight``
    per value). Which projections are quantized is read
    from the checkpoint's tensors (:func:`replace_linears`), not from ``targets`` / ``ignore``."""

    bits: int
    group_size: int | None
    symmetric: bool = True
    round_bf16: bool = False
    g_idx: bool = False
    inputs: InputQuant | None = None
    packed: bool = True

    @property
    def streams(self) -> bool:
        """Whether the checkpoint's tensors stream in as stored (:class:`IntQuantLinear`); else repacked."""
        return self.symmetric and not self.g_idx and self.inputs is None and self.packed


def tensor_parallel_refusal(path: str | Path) -> str | None:
    """Why the quantized checkpoint at `path` cannot be split over tensor-parallel ranks (None: it can). A
    scattered activation order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``) gives each group inputs
    all over a row-parallel projection, so no rank holds whole groups."""
    q = _quantization_config(path) or {}
    if q.get("quant_method") == "gptq" and q.get("desc_act"):
        return "GPTQ desc_act (activation order) checkpoints run on one device"
    groups = (q.get("config_groups") or {}).values() if q.get("quant_method") == "compressed-tensors" else ()
    if any((g.get("weights") or {}).get("actorder") in ACTORDER_GROUP for g in groups):
        return "compressed-tensors actorder group checkpoints run on one device"
    return None


def _quantization_config(path: str | Path) -> dict | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")


def quantization_scheme(path: str | Path):
    """The checkpoint's quantization scheme (None: not quantized): an :class:`IntScheme` (compressed-tensors
    pack-quantized), a :class:`~batchgen.models.quant.gptq_awq.GPTQScheme` / ``AWQScheme`` or a
    :class:`~batchgen.models.quant.fp8.Fp8Scheme`; or UnsupportedCheckpoint naming what is not run."""
    file = Path(path) / "config.json"
    q = _quantization_config(path)
    if not q:
        return None
    where = f"quantization_config in {file}"
    method = q.get("quant_method")
    if method == "gptq":
        return gptq_scheme(q, where)
    if method == "awq":
        return awq_scheme(q, where)
    if method == "fp8":
        return block_fp8_scheme(q, where)
    if method != "compressed-tensors":
        raise UnsupportedCheckpoint(
            f"{where}: quant_method={method!r} is not supported; batchgen runs compressed-tensors (int4/int8 "
            "W4A16/W8A16, fp8 weights), gptq, awq, fp8 (block) and GGUF files"
        )
    if q.get("kv_cache_scheme") and not _kv_scheme_supported(q["kv_cache_scheme"]):
        raise UnsupportedCheckpoint(
            f"{where}: kv_cache_scheme {q['kv_cache_scheme']} is not supported; batchgen reads per-tensor or "
            "per-head fp8 k_scale / v_scale"
        )
    sparsity = (q.get("sparsity_config") or {}).get("format")
    if sparsity not in (None, "dense"):
        raise UnsupportedCheckpoint(
            f"{where}: compressed-tensors sparsity format {sparsity} is not supported; batchgen runs dense "
            "(unsparsified) weights"
        )
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        return None  # only the KV cache (or nothing) is quantized: the weights are float
    schemes = [_group_scheme(g, q, where) for g in groups]
    fp8 = [s for s in schemes if isinstance(s, Fp8Scheme)]
    if fp8 and len(fp8) != len(schemes):
        raise UnsupportedCheckpoint(
            f"{where}: compressed-tensors config_groups mixing fp8 and int weights are not supported; batchgen runs "
            "groups of int weights (W4A16, W8A16) or groups of fp8 weights"
        )
    if fp8:  # tensor and channel scales are told apart by their shapes; one block shape at most
        blocks = {s.block for s in fp8 if s.block is not None}
        if len(blocks) > 1:
            raise UnsupportedCheckpoint(f"{where}: compressed-tensors fp8 groups with block shapes "
                                        f"{sorted(blocks)} are not supported; batchgen runs one block shape")  # fmt: skip
        return Fp8Scheme(
            "weight_scale", next(iter(blocks), None), "compressed-tensors fp8", _inputs(fp8, where)
        )
    if len(schemes) == 1 and schemes[0].streams:
        return schemes[0]  # streamed in as stored
    return RepackedIntScheme(inputs=_inputs(schemes, where))


def _inputs(schemes: list, where: str) -> InputQuant | None:
    """The config groups' one input quantization (a fused projection's parts may come from different groups)."""
    kinds = {s.inputs for s in schemes}
    if len(kinds) > 1:
        raise UnsupportedCheckpoint(f"{where}: compressed-tensors config_groups with different input_activations "
                                    "are not supported; batchgen runs one input activation scheme per checkpoint")  # fmt: skip
    return kinds.pop()


def _group_scheme(group: dict, q: dict, where: str):
    """One config group's scheme: an :class:`IntScheme` or an :class:`Fp8Scheme`; UnsupportedCheckpoint naming
    what is not run."""
    fmt = group.get("format") or q.get("format")
    if fmt not in ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized"):
        raise UnsupportedCheckpoint(
            f"{where}: compressed-tensors format {fmt} is not supported; batchgen runs pack-quantized (W4A16, "
            "W8A16), int-quantized (W8A8) and float-quantized (fp8 weights) schemes"
        )
    weights = group.get("weights") or {}
    problems = []
    targets = group.get("targets")
    if not targets or not all(t == "Linear" or str(t).startswith("re:") for t in targets):
        problems.append(f"targets {targets}")
    if group.get("output_activations"):
        problems.append("quantized output activations")
    inputs = InputQuant.parse(group.get("input_activations"), where)
    if weights.get("type") == "float" and fmt != "pack-quantized":
        if weights.get("num_bits") != 8:
            problems.append(f"float weights of {weights.get('num_bits')} bits")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            problems.append(f"strategy {weights.get('strategy')!r}")
        if problems:
            raise UnsupportedCheckpoint(f"{where}: compressed-tensors {', '.join(problems)} not supported; batchgen "
                                        "runs fp8 weight-only quantization (tensor, channel or block scales)")  # fmt: skip
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        return Fp8Scheme("weight_scale", tuple(block) if block else None, "compressed-tensors fp8", inputs)
    if fmt not in ("pack-quantized", "int-quantized"):
        problems.append(f"format {fmt} with {weights.get('type')} weights")
    if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
        problems.append(f"{weights.get('type')} weights of {weights.get('num_bits')} bits")
    if weights.get("strategy") not in ("group", "channel"):
        problems.append(f"strategy {weights.get('strategy')!r}")
    actorder = weights.get("actorder")
    if actorder not in (None, False, *ACTORDER_CONTIGUOUS, *ACTORDER_GROUP):
        problems.append(f"actorder={actorder!r}")
    if problems:
        raise UnsupportedCheckpoint(f"{where}: compressed-tensors {', '.join(problems)} not supported; batchgen runs "
                                    "int4/int8 weight-only group or channel quantization (W4A16, W8A16)")  # fmt: skip
    group_size = weights.get("group_size") if weights.get("strategy") == "group" else None
    return IntScheme(int(weights["num_bits"]), group_size, symmetric=bool(weights.get("symmetric", True)),
                     g_idx=actorder in ACTORDER_GROUP, inputs=inputs, packed=fmt == "pack-quantized")  # fmt: skip


@dataclass(frozen=True)
class RepackedIntScheme:
    """pack-quantized weights with zero points (``symmetric: false``), activation order ``group`` (a
    ``weight_g_idx`` ``[K]`` giving each input's group) or several config groups (e.g. int4
    attention beside int8 MLP): ``weight_packed`` ``[N, K * bits / 32]`` (as :class:`IntScheme`), ``weight_scale``
    ``[N, G]`` and, for asymmetric groups, ``weight_zero_point`` ``[N * bits / 32, G]`` int32 (packed along the
    outputs, stored with the same offset of 2^(bits-1)); ``w = (q - zero_point) * scale``. Each projection's
    bits and group come from its tensors' shapes. Repacked at load into a
    :class:`~batchgen.models.quant.group_linear.GroupQuantLinear` (zero points' share added after the GEMM)."""

    method: str = "compressed-tensors pack-quantized"
    tensors = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale",
               "input_zero_point")  # fmt: skip
    inputs: InputQuant | None = None

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.weight_packed" in names or f"{prefix}.weight_scale" in names

    def build(self, in_features: int, prefixes: list[str], get, bias):
        from batchgen.models.quant.gptq_awq import to_part
        from batchgen.models.quant.group_linear import GroupQuantLinear, unpack_words

        parts = []
        for p in prefixes:
            get(f"{p}.weight_shape", None)  # the shape is the model's
            scale = get(f"{p}.weight_scale").float()  # [N, G]
            zero = get(f"{p}.weight_zero_point", None)
            packed = get(f"{p}.weight_packed", None)
            if packed is None:  # int-quantized: one int8 value per weight, zero points unpacked
                bits, q = 8, _naive_values(p, get(f"{p}.weight"), in_features)
                z = None if zero is None else zero.to(torch.int64) + 128
            else:
                bits = packed_bits(p, packed.shape[1], in_features)
                q = unpack_words(packed, bits, dim=1)  # [N, K], offset values
                z = None if zero is None else unpack_words(zero, bits, dim=0)[: scale.shape[0]]  # [N, G]
            if z is None:  # symmetric: every zero point is the stored offset
                z = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int64)
            g_idx = get(f"{p}.weight_g_idx", None)  # activation order "group": each input's group
            g_idx = None if g_idx is None else g_idx.to(torch.int64)
            parts.append(to_part(p, q.t(), z.t(), scale.t(), bits, in_features, g_idx))
        return with_inputs(GroupQuantLinear(in_features, parts, bias), self.inputs, prefixes, get)


def _naive_values(prefix: str, weight: Tensor, in_features: int) -> Tensor:
    """An ``int-quantized`` int8 ``weight`` ``[N, K]`` as unsigned values with the offset of 128."""
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != in_features:
        raise UnsupportedCheckpoint(
            f"{prefix}.weight is {weight.dtype} {tuple(weight.shape)}: an int-quantized weight is int8 [out, "
            f"{in_features}]"
        )
    return weight.to(torch.int64) + 128


def packed_bits(prefix: str, words: int, in_features: int) -> int:
    """The bits per value of a ``weight_packed`` of `words` int32 words per row over `in_features` inputs."""
    for bits in (4, 8):
        if words * 32 == in_features * bits:
            return bits
    raise UnsupportedCheckpoint(
        f"{prefix}.weight_packed holds {words} int32 words per row for {in_features} inputs: batchgen runs "
        "int4 and int8 pack-quantized weights"
    )


def _kv_scheme_supported(kv: dict) -> bool:
    return (
        kv.get("type") == "float"
        and kv.get("num_bits") == 8
        and kv.get("strategy") in ("tensor", "attn_head")
    )


class IntQuantLinear(nn.Module):
    """A projection over compressed-tensors' packed integer weights (module docstring). Invariants: `weight_packed`
    is ``[out, in * bits / 32]`` int32, `weight_scale` ``[out, in / group]`` float32 contiguous (never re-laid
    out: `keeps_layout`); forward takes any leading shape and returns `x`'s dtype (float32 on the CPU; on CUDA the
    Triton kernel multiplies)."""

    keeps_layout = True

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: IntScheme) -> None:
        super().__init__()
        if in_features % (32 // scheme.bits):
            raise UnsupportedCheckpoint(
                f"in_features={in_features} does not pack into int32 words of int{scheme.bits}"
            )
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.group = scheme.group_size or in_features
        words = in_features * scheme.bits // 32
        self.weight_packed = nn.Parameter(
            torch.empty(out_features, words, dtype=torch.int32), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, in_features // self.group), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if on_triton(x):
            from batchgen.kernels.quant_linear_triton import int_linear_triton  # Triton only where it runs

            return int_linear_triton(x, self.weight_packed, self.scheme.bits, self.weight_scale, self.group,
                                     self.bias, round_bf16=self.scheme.round_bf16)  # fmt: skip
        if not cpu_quant_linear.available():
            return nn.functional.linear(x, self.dense_weight(), self.bias)
        return cpu_quant_linear.int_linear(
            x,
            self.weight_packed,
            self.scheme.bits,
            self.weight_scale,
            self.group,
            self.bias,
            self.scheme.round_bf16,
        )

    def dense_weight(self) -> Tensor:
        """The dequantized ``[out, in]`` float32 weight (compressed-tensors' arithmetic)."""
        b = self.scheme.bits
        nib = self.weight_packed.view(torch.uint8).to(torch.int32)
        if b == 4:
            nib = torch.stack([nib & 15, nib >> 4], dim=-1).reshape(self.out_features, -1)
        q = (nib - (1 << (b - 1))).float()
        scale = self.weight_scale.repeat_interleave(self.group, dim=1)
        w = q * scale
        return w.to(torch.bfloat16).float() if self.scheme.round_bf16 else w

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.scheme.bits}, group={self.group}"


def replace_linears(model: nn.Module, config, scheme: IntScheme, names, device: torch.device) -> list[str]:
    """Swap each `nn.Linear` whose checkpoint tensors (`names`: the checkpoint's tensor names) include a
    ``weight_packed`` for an uninitialised `IntQuantLinear` on `device` (before the checkpoint is streamed in), and stacked
    MoE experts whose experts have them for :class:`~batchgen.models.moe.PackedExperts` of such layers: layers
    the checkpoint leaves in float (``ignore``, plain names or ``re:`` patterns; a tied ``lm_head``; a router)
    are found by their absence. Returns the replaced module names."""
    from batchgen.models.loader import _checkpoint_names

    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or (name == "lm_head" and config.tie_word_embeddings):
            continue
        parts = _checkpoint_names(config, f"{name}.weight", tuple(module.weight.shape))[0]
        prefixes = [hf.removesuffix(".weight") for hf, _ in parts]
        packed = [f"{p}.weight_packed" in names for p in prefixes]
        if not any(packed):
            continue
        if not all(packed):
            raise UnsupportedCheckpoint(
                f"{', '.join(prefixes)} of fused {name} mix quantized and float tensors (compressed-tensors): batchgen "
                "runs fused q/k/v and gate/up projections whose parts are all quantized or all float"
            )
        parent, _, attr = name.rpartition(".")
        quant = IntQuantLinear(module.in_features, module.out_features, module.bias is not None, scheme)
        quant = quant.to(device)
        setattr(model.get_submodule(parent), attr, quant)
        replaced.append(name)
    from batchgen.models.quant.linear_loader import replace_experts

    def expert(k: int, n: int, prefixes: list[str]) -> nn.Module | None:
        return (
            IntQuantLinear(k, n, False, scheme)
            if all(f"{p}.weight_packed" in names for p in prefixes)
            else None
        )

    replaced += replace_experts(
        model, config, expert, device
    )  # streamed in per expert (loader's expert names)
    if not replaced:
        raise UnsupportedCheckpoint(
            "no projection of the checkpoint holds compressed-tensors weight_packed tensors"
        )
    return replaced
