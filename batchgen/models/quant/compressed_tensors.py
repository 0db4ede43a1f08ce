"""compressed-tensors checkpoints (what vLLM's llm-compressor writes), loaded from their ``quantization_config``
without dequantizing the model: the ``pack-quantized`` format with integer weights (W4A16 / W8A16: 4- or 8-bit,
``group`` or ``channel`` strategy, activations unquantized). Symmetric weights stream in as they are stored;
asymmetric ones (``weight_zero_point``) are repacked at load (:class:`ZeroPointScheme`).

Each target projection becomes an :class:`IntQuantLinear` holding the checkpoint's own tensors —
``weight_packed`` (int32 words, compressed-tensors' bit layout) and ``weight_scale`` (widened to float32) — so the
loader streams them like any parameter (q/k/v and gate/up fuse by rows, as float weights do); the C kernel of
:mod:`batchgen.kernels.cpu_quant_linear` dequantizes a group chunk at a time in L1 with compressed-tensors'
arithmetic (``(q - offset) * scale``, the scales widened to float32 as transformers' float32 loading widens
them), so greedy output equals transformers' own loading of
the checkpoint (which decompresses to float32) token for token.

Invariant: :func:`quantization_scheme` is the one reading of a ``quantization_config``: it returns the scheme of
each format batchgen runs (this module's :class:`IntScheme`; GPTQ / AWQ: :mod:`.gptq_awq`; fp8 weights, which
compressed-tensors calls ``float-quantized``: :mod:`.fp8`) and refuses anything else by name at load and at
planning — another ``quant_method`` (bitsandbytes...), another compressed-tensors format or scheme (W8A8 and fp8
activations, activation ordering, per-layer targets) — with an
:class:`~batchgen.models.quant.gguf_checkpoint.UnsupportedCheckpoint`.
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


@dataclass(frozen=True)
class IntScheme:
    """Symmetric integer weights: `bits` per value, one scale per `group_size` inputs (None: per output row),
    projections named in `ignore` left dense. `round_bf16`: round each dequantized weight to bfloat16 (what
    compressed-tensors computes with bfloat16 scales kept in bfloat16); off for checkpoints, whose scales are
    widened to float32 first, as transformers' float32 loading does."""

    bits: int
    group_size: int | None
    ignore: tuple[str, ...]
    round_bf16: bool = False


def quantization_scheme(path: str | Path):
    """The checkpoint's quantization scheme (None: not quantized): an :class:`IntScheme` (compressed-tensors
    pack-quantized), a :class:`~batchgen.models.quant.gptq_awq.GPTQScheme` / ``AWQScheme`` or a
    :class:`~batchgen.models.quant.fp8.Fp8Scheme`; or UnsupportedCheckpoint naming what is not run."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
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
    groups = list((q.get("config_groups") or {}).values())
    if not groups and q.get("kv_cache_scheme"):
        return None  # only the KV cache is quantized: the weights are float
    formats = {g.get("format") or q.get("format") for g in groups}
    if not formats <= {"pack-quantized", "float-quantized", "naive-quantized"} or len(groups) != 1:
        raise UnsupportedCheckpoint(
            f"{where}: compressed-tensors format {', '.join(sorted(map(str, formats)))} is not supported; batchgen "
            "runs pack-quantized (W4A16, W8A16) and float-quantized (fp8 weights) with one scheme for all "
            "Linear layers"
        )
    (group,) = groups
    (fmt,) = formats
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    problems = []
    if group.get("targets") != ["Linear"]:
        problems.append(f"targets {group.get('targets')}")
    if acts:
        problems.append("quantized input activations (W8A8 / fp8)")
    if weights.get("type") == "float" and fmt != "pack-quantized":
        if weights.get("num_bits") != 8:
            problems.append(f"float weights of {weights.get('num_bits')} bits")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            problems.append(f"strategy {weights.get('strategy')!r}")
        if problems:
            raise UnsupportedCheckpoint(f"{where}: compressed-tensors {', '.join(problems)} not supported; batchgen "
                                        "runs fp8 weight-only quantization (tensor, channel or block scales)")  # fmt: skip
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        return Fp8Scheme("weight_scale", tuple(block) if block else None, "compressed-tensors fp8")
    if fmt != "pack-quantized":
        problems.append(f"format {fmt} with {weights.get('type')} weights")
    if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
        problems.append(f"{weights.get('type')} weights of {weights.get('num_bits')} bits")
    if weights.get("strategy") not in ("group", "channel"):
        problems.append(f"strategy {weights.get('strategy')!r}")
    if weights.get("actorder"):
        problems.append(f"actorder={weights.get('actorder')!r}")
    if problems:
        raise UnsupportedCheckpoint(f"{where}: compressed-tensors {', '.join(problems)} not supported; batchgen runs "
                                    "int4/int8 weight-only group or channel quantization (W4A16, W8A16)")  # fmt: skip
    group_size = weights.get("group_size") if weights.get("strategy") == "group" else None
    if not weights.get("symmetric", False):
        return ZeroPointScheme(int(weights["num_bits"]))
    return IntScheme(int(weights["num_bits"]), group_size, tuple(q.get("ignore") or ()))


@dataclass(frozen=True)
class ZeroPointScheme:
    """Asymmetric pack-quantized weights: ``weight_packed`` (as :class:`IntScheme`), ``weight_scale`` ``[N, G]``
    and ``weight_zero_point`` ``[N * bits / 32, G]`` int32 (packed along the outputs, stored with the same offset
    of 2^(bits-1)); ``w = (q - zero_point) * scale``. Repacked at load into a
    :class:`~batchgen.models.quant.group_linear.GroupQuantLinear` (zero points folded into the values)."""

    bits: int
    method: str = "compressed-tensors asymmetric"
    tensors = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")

    def is_quantized(self, prefix: str, names) -> bool:
        return f"{prefix}.weight_packed" in names

    def build(self, in_features: int, prefixes: list[str], get, bias):
        from batchgen.models.quant.gptq_awq import to_part
        from batchgen.models.quant.group_linear import GroupQuantLinear, unpack_words

        parts = []
        for p in prefixes:
            get(f"{p}.weight_shape", None)  # the shape is the model's
            q = unpack_words(get(f"{p}.weight_packed"), self.bits, dim=1)  # [N, K], offset values
            z = unpack_words(get(f"{p}.weight_zero_point"), self.bits, dim=0)  # [N, G]
            scale = get(f"{p}.weight_scale").float()  # [N, G]
            parts.append(to_part(p, q.t(), z.t(), scale.t(), self.bits, in_features, None))
        return GroupQuantLinear(in_features, parts, bias)


def _kv_scheme_supported(kv: dict) -> bool:
    return (
        kv.get("type") == "float"
        and kv.get("num_bits") == 8
        and kv.get("strategy") in ("tensor", "attn_head")
    )


class IntQuantLinear(nn.Module):
    """A projection over compressed-tensors' packed integer weights (module docstring). Invariants: `weight_packed`
    is ``[out, in * bits / 32]`` int32, `weight_scale` ``[out, in / group]`` float32 contiguous (never re-laid
    out: `keeps_layout`); forward takes and returns float32, any leading shape."""

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


def replace_linears(model: nn.Module, scheme: IntScheme) -> int:
    """Swap every `nn.Linear` not named in `scheme.ignore` for an uninitialised `IntQuantLinear` (before the
    checkpoint is streamed in). Returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name in scheme.ignore or name.split(".")[-1] in scheme.ignore:
            continue
        parent, _, attr = name.rpartition(".")
        quant = IntQuantLinear(module.in_features, module.out_features, module.bias is not None, scheme)
        setattr(model.get_submodule(parent), attr, quant)
        count += 1
    return count
