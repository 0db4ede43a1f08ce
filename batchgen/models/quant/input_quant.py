"""Quantized input activations (compressed-tensors W8A8 int8, FP8_DYNAMIC, static fp8 or int8 input scales): each
quantized projection's input is quantized and dequantized before the weight-only GEMM, as compressed-tensors'
forward does in transformers' loading of the checkpoint (``fake_quantize``: the same arithmetic, computed by the
compressed-tensors library itself), so greedy output equals transformers' token for token.

:class:`InputQuant` reads a config group's ``input_activations``: 8-bit ``int`` or ``float`` (fp8 e4m3),
``dynamic`` per token (a scale from each token's own values) or static per tensor (the checkpoint's
``input_scale``, and ``input_zero_point`` for asymmetric int8). :class:`InputQuantLinear` wraps a quantized
projection (:class:`~batchgen.models.quant.group_linear.GroupQuantLinear`,
:class:`~batchgen.models.quant.fp8.Fp8Linear`) with it.

Invariants: per-token quantization depends on each token's values alone (rows are independent, so batching does
not change a row's result); a fused projection (q/k/v, gate/up) quantizes its input once, so static parts must
share one input scale (their observers saw the same input; others are refused by name).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from batchgen.kernels import cpu_int8_linear
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.group_linear import GroupQuantLinear
from batchgen.models.quant.quant_linear import multiply_parts


@dataclass(frozen=True)
class InputQuant:
    """A config group's ``input_activations``: the dict as the checkpoint states it, kept as its JSON text with
    sorted keys, so that equal schemes compare and hash equal whatever their fields hold (lists, dicts)."""

    text: str

    @classmethod
    def parse(cls, acts: dict | None, where: str) -> InputQuant | None:
        """None for unquantized inputs; UnsupportedCheckpoint naming what batchgen does not run."""
        if not acts:
            return None
        problems = []
        if acts.get("type") not in ("int", "float") or acts.get("num_bits") != 8:
            problems.append(f"{acts.get('type')} inputs of {acts.get('num_bits')} bits")
        dynamic = acts.get("dynamic") in (True, "true", "local")
        strategy = acts.get("strategy")
        if dynamic and strategy not in ("token", "tensor", "group"):
            problems.append(f"dynamic input strategy {strategy!r}")
        if dynamic and strategy == "group" and not acts.get("group_size"):
            problems.append("dynamic group inputs without a group_size")
        if not dynamic and strategy != "tensor":
            problems.append(f"static input strategy {strategy!r}")
        if acts.get("dynamic") == "local":
            problems.append("dynamic 'local' input scales")
        if problems:
            raise UnsupportedCheckpoint(
                f"{where}: compressed-tensors {', '.join(problems)} not supported; batchgen runs 8-bit int or fp8 "
                "input activations, dynamic per token, per group or per tensor, or static per tensor"
            )
        _library(where)
        quant = cls(json.dumps(acts, sort_keys=True))
        try:
            quant.args()
        except ValueError as e:  # pydantic's validation error names the field
            raise UnsupportedCheckpoint(f"{where}: input_activations {acts} not understood ({e})") from e
        return quant

    @functools.cached_property
    def fields(self) -> dict:
        """``input_activations`` as the checkpoint states it."""
        return json.loads(self.text)

    def get(self, key: str, default=None):
        """One field of ``input_activations``."""
        return self.fields.get(key, default)

    @property
    def dynamic(self) -> bool:
        return self.get("dynamic") in (True, "true")

    @property
    def symmetric(self) -> bool:
        return bool(self.get("symmetric", True))

    def args(self):
        """compressed-tensors' ``QuantizationArgs`` of these inputs."""
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(**self.fields)


def scale_tokens_over_ranks(module: nn.Module, name: str) -> None:
    """Mark the row-parallel projection `name`, split over tensor-parallel ranks, so that its dynamic per-token
    input scales come from each token's whole input (:attr:`InputQuantLinear.token_scales_over_ranks`).
    UnsupportedCheckpoint where compressed-tensors' own functions compute the scales (asymmetric or per-tensor
    dynamic inputs): those run on one device."""
    if not isinstance(module, InputQuantLinear) or not module.quant.dynamic:
        return
    if module._fast is None:
        raise UnsupportedCheckpoint(
            f"{name}: dynamic {'asymmetric' if not module.quant.symmetric else module.quant.get('strategy')} input "
            "quantization runs on one device; set engine.tensor_parallel_size=1"
        )
    module.token_scales_over_ranks = True


def _integer_group(inner: nn.Module, form: _Symmetric | None) -> int:
    """The group of `inner`'s weights when int8 inputs of `form` can be multiplied by them with integer dot
    products (symmetric int8 weights in one group size, inputs in their checkpoint order), else 0."""
    if form is None or form.fp8 or not isinstance(inner, GroupQuantLinear):
        return 0
    groups = set(inner.groups)
    if set(inner.bits) != {8} or len(groups) != 1 or min(groups) > cpu_int8_linear.MAX_GROUP:
        return 0
    if any(
        inner._perm(i) is not None or getattr(inner, f"zero{i}") is not None for i in range(len(inner.bits))
    ):
        return 0
    return groups.pop()


def _library(where: str) -> None:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as e:
        raise UnsupportedCheckpoint(
            f"{where}: quantized input activations are computed with the compressed-tensors library, which is not "
            "installed: pip install 'batchgen[quant]'"
        ) from e


class InputQuantLinear(nn.Module):
    """``inner(fake_quantize(x))``: a quantized projection whose input is quantized first (module docstring).
    `input_scale` / `input_zero_point`: the static scale (and zero point) of the input, ``[1]``; None when the
    scale is dynamic."""

    keeps_layout = True

    def __init__(
        self,
        inner: nn.Module,
        quant: InputQuant,
        input_scale: Tensor | None = None,
        input_zero_point: Tensor | None = None,
    ) -> None:
        super().__init__()
        if not quant.dynamic and input_scale is None:
            raise ValueError("static input quantization needs the checkpoint's input_scale")
        self.inner = inner
        self.quant = quant
        self._args = quant.args()
        self._fast = _fast_form(self._args, quant, input_zero_point)
        self._integer = _integer_group(inner, self._fast)
        self.token_scales_over_ranks = False
        """Set on a row-parallel projection split over tensor-parallel ranks: each rank holds a slice of every
        token's input, so a token's dynamic scale is its largest magnitude over all ranks (one all-reduce)."""
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.register_buffer("input_scale", input_scale, persistent=False)
        self.register_buffer("input_zero_point", input_zero_point, persistent=False)

    @property
    def bias(self) -> Tensor | None:
        return self.inner.bias

    def quantize_input(self, x: Tensor) -> Tensor:
        """``x`` quantized and dequantized in its own dtype (compressed-tensors' ``fake_quantize``)."""
        if x.numel() == 0:
            return x
        if self._fast is not None:
            return _fake_quantize_symmetric(x, self._fast, self.input_scale, self.token_scales_over_ranks)
        from compressed_tensors.quantization import fake_quantize
        from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

        if self.quant.dynamic:
            # [1, tokens, in]: compressed-tensors reduces a token's scale over the dimensions after the first two
            rows = x.reshape(1, -1, x.shape[-1])
            scale, zero = compute_dynamic_scales_and_zp(rows, self._args, self)
            return fake_quantize(rows, scale, zero, self._args).view(x.shape)
        return fake_quantize(x, self.input_scale, self.input_zero_point, self._args)

    def forward(self, x: Tensor) -> Tensor:
        if (
            self._integer
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and cpu_int8_linear.available()
        ):
            return self._integer_product(x)
        return self.inner(self.quantize_input(x))

    def _integer_product(self, x: Tensor) -> Tensor:
        """The inner int8 weights times the int8 inputs by integer dot products (:mod:`~batchgen.kernels.
        cpu_int8_linear`): the same quantized values as :meth:`quantize_input`'s, their products summed exactly."""
        inner = self.inner
        flat = x.reshape(-1, self.in_features)
        scales = self.input_scale
        if self._fast.dynamic:  # None: each row's scale from its own values, computed by the kernel
            scales = _token_scales(flat, self._fast) if self.token_scales_over_ranks else None
        rows = cpu_int8_linear.quantize_rows(flat, self._integer, scales)

        def product(i: int, _x: Tensor, bias: Tensor | None, out: Tensor) -> None:
            cpu_int8_linear.linear(rows, inner.packed[i], inner.scales[i], bias, out=out)

        return multiply_parts(x, self.in_features, [p.shape[0] for p in inner.packed], inner.bias, product)

    def dense_weight(self) -> Tensor:
        return self.inner.dense_weight()

    def extra_repr(self) -> str:
        kind = self.quant.get("type")
        return f"inputs {kind}8 {'dynamic' if self.quant.dynamic else 'static'}"


@dataclass(frozen=True)
class _Symmetric:
    """The one case compressed-tensors computes with a few tensor operations: symmetric 8-bit inputs, per token
    dynamically or by a static scale (no global scale, no rounded scale dtype). `half`: half the type's range
    (127.5 for int8, 448 for fp8): a token's scale is its largest magnitude over it."""

    fp8: bool
    dynamic: bool
    half: float
    low: float
    high: float


def _fast_form(args, quant: InputQuant, zero_point: Tensor | None) -> _Symmetric | None:
    if not quant.symmetric or zero_point is not None or getattr(args, "scale_dtype", None) is not None:
        return None
    if quant.get("num_bits") != 8 or (quant.dynamic and quant.get("strategy") != "token"):
        return None
    fp8 = quant.get("type") == "float"
    low, high = (-448.0, 448.0) if fp8 else (-128.0, 127.0)
    return _Symmetric(fp8, quant.dynamic, (high - low) / 2, low, high)


def _token_scales(x: Tensor, form: _Symmetric, over_ranks: bool = True) -> Tensor:
    """Each token's dynamic scale ``[..., 1]``: its largest magnitude (over every tensor-parallel rank's slice of
    its input when `over_ranks`) / `half`, ``finfo.eps`` where that is 0."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    if over_ranks and dist.is_available() and dist.is_initialized():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    scale = amax / form.half
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def _fake_quantize_symmetric(
    x: Tensor, form: _Symmetric, static_scale: Tensor | None, over_ranks: bool = False
) -> Tensor:
    """compressed-tensors' ``compute_dynamic_scales_and_zp`` + ``fake_quantize`` for a :class:`_Symmetric` form,
    operation for operation (the tests hold the two bit for bit): scale = max |x| over the token / `half`
    (``finfo.eps`` where that is 0; over the ranks' slices of the token with `over_ranks`) or the static scale;
    ``clamp(x / scale)`` rounded (half to even for int8, to e4m3 for fp8), times the scale."""
    if form.dynamic:
        scale = _token_scales(x, form, over_ranks)
    else:
        scale = static_scale.to(x.dtype)
    q = torch.clamp(x / scale, form.low, form.high)
    q = q.to(torch.float8_e4m3fn).to(x.dtype) if form.fp8 else torch.round(q)
    return q * scale


def static_input_scale(get, prefixes: list[str], where: str) -> tuple[Tensor, Tensor | None]:
    """The one ``input_scale`` (and ``input_zero_point``) of the fused parts `prefixes`, as float32 ``[1]``;
    UnsupportedCheckpoint when the parts' scales differ."""
    scales = [get(f"{p}.input_scale").float().reshape(-1) for p in prefixes]
    zeros = [get(f"{p}.input_zero_point", None) for p in prefixes]
    if any(s.numel() != 1 for s in scales):
        raise UnsupportedCheckpoint(f"{where}: input_scale of shape {tuple(scales[0].shape)}; batchgen runs "
                                    "one static input scale per projection")  # fmt: skip
    if any(not torch.equal(s, scales[0]) for s in scales[1:]):
        raise UnsupportedCheckpoint(
            f"{where}: the fused parts {', '.join(prefixes)} have different static input scales; batchgen "
            "quantizes a fused projection's input once"
        )
    zero = None
    if zeros[0] is not None:
        zero = zeros[0].reshape(-1)
        if any(z is None or not torch.equal(z.reshape(-1), zero) for z in zeros[1:]):
            raise UnsupportedCheckpoint(f"{where}: the fused parts {', '.join(prefixes)} have different input "
                                        "zero points")  # fmt: skip
    return scales[0], zero


def with_inputs(module: nn.Module, quant: InputQuant | None, prefixes: list[str], get) -> nn.Module:
    """`module` (the projection built from `prefixes`' tensors) with its input quantized when `quant` says so."""
    if quant is None:
        return module
    scale = zero = None
    if not quant.dynamic:
        scale, zero = static_input_scale(get, prefixes, ", ".join(prefixes))
    group = quant.get("group_size") if quant.get("strategy") == "group" else None
    if group and module.in_features % int(group):
        raise UnsupportedCheckpoint(
            f"{', '.join(prefixes)}: {module.in_features} input features are not whole groups of the input "
            f"activations' group_size {group}; compressed-tensors cannot quantize these inputs either"
        )
    return InputQuantLinear(module, quant, scale, zero)
