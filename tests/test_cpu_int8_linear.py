"""The integer-activation GEMM (kernels/csrc/int8_linear_cpu.c via kernels/cpu_int8_linear.py), against the
machine's build and the plain-C build: the input quantization bit for bit compressed-tensors' arithmetic (as
batchgen's emulation computes it), the integer sums exact (the float64 reference on the same int8 values), the
float epilogue bit for bit its stated order, rows independent of the batch (one row takes the vpdpbusd tiles,
16 or more the AMX tiles where the CPU has them: the same bits). The W8A8 layers' use of it:
tests/test_input_quant.py."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_int8_linear, cpu_kernel
from batchgen.models.quant.group_linear import GroupQuantLinear, IntPart
from batchgen.models.quant.input_quant import _fake_quantize_symmetric, _Symmetric

needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")
pytestmark = needs_compiler


@pytest.fixture(autouse=True, params=["native", "generic"])
def _library(request, monkeypatch):
    """Every test runs against the machine's build (AVX512-VNNI where the CPU has it) and the plain-C build."""
    monkeypatch.delenv(cpu_kernel.ENV_SWITCH, raising=False)
    cpu_kernel.reset()
    if request.param == "generic":
        monkeypatch.setitem(cpu_kernel._state, "lib", cpu_kernel._load(("BATCHGEN_GENERIC",)))
    yield
    cpu_kernel.reset()


def _inputs(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
    if m > 2:
        x[1] = 0.0  # a zero row: the scale is eps
        x[2, : k // 2] = torch.tensor([-127.5, 127.5, 0.5, -0.5, 1.5, 2.5]).repeat(k)[
            : k // 2
        ]  # halves: to even
    return x


def _weights(n: int, k: int, group: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (n, k), generator=g)  # stored w + 128: -128 .. 127, extremes included
    values[0, :8] = torch.tensor([0, 255, 0, 255, 128, 1, 254, 0])
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-4
    return values, scales


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize(("k", "group"), [(200, 40), (256, 64), (208, 208), (1040, 1040)])
def test_rows_are_quantized_as_compressed_tensors_does(dynamic, k, group) -> None:
    """Groups of 16 values and more take the 512-bit loop where the build has it; the others plain C."""
    x = _inputs(7, k)
    x[4, -1] = -50.0  # the largest magnitude in a row's last value (past the last whole vector when k % 16)
    form = _Symmetric(fp8=False, dynamic=dynamic, half=127.5, low=-128.0, high=127.0)
    static = torch.tensor([0.037])
    rows = cpu_int8_linear.quantize_rows(x, group=group, scales=None if dynamic else static)
    want = _fake_quantize_symmetric(x, form, static)
    assert torch.equal(rows.q.float() * rows.scales[:, None], want)
    assert torch.equal(rows.group_sums, rows.q.int().reshape(7, k // group, group).sum(-1).int())
    assert int(rows.q.min()) >= -128 and int(rows.q.max()) <= 127


@pytest.mark.parametrize(
    ("m", "k", "n", "group"),
    [(1, 64, 4, 64), (3, 192, 7, 192), (5, 256, 6, 64), (9, 100, 5, 100), (17, 384, 13, 128), (4, 40, 3, 8)]
    + [
        (40, 256, 50, 64),
        (16, 192, 32, 192),
        (70, 128, 16, 128),
        (33, 320, 40, 320),
    ],  # AMX tiles where there
)
def test_products_against_the_float64_reference_and_the_stated_order(m, k, n, group) -> None:
    x = _inputs(m, k, seed=m)
    values, scales = _weights(n, k, group, seed=n)
    layer = GroupQuantLinear(k, [IntPart(values, scales, bits=8, group=group)])
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
    rows = cpu_int8_linear.quantize_rows(x, group)
    got = cpu_int8_linear.linear(rows, layer.packed[0], layer.scales[0], bias)

    w = (values - 128).double()
    exact = (rows.q.double().reshape(m, 1, k // group, group) * w.reshape(1, n, k // group, group)).sum(-1)
    terms = rows.scales.double()[:, None, None] * exact * scales.double()[None]
    ref64 = terms.sum(-1) + bias.double()
    bound = (k // group + 2) * 2.0**-24 * (terms.abs().sum(-1) + bias.double().abs())  # float32 roundings
    assert bool(((got.double() - ref64).abs() <= bound).all())

    # bit for bit: s = sum over groups in order of ws * float(D), y = xs * s + bias, each step rounded to float32
    s = torch.zeros(m, n)
    for gi in range(k // group):
        s = s + scales[:, gi][None] * exact[:, :, gi].float()
    assert torch.equal(got, rows.scales[:, None] * s + bias[None])

    # a row's result does not depend on the rows beside it
    for i in (0, m - 1):
        one = cpu_int8_linear.quantize_rows(x[i : i + 1], group)
        assert torch.equal(cpu_int8_linear.linear(one, layer.packed[0], layer.scales[0], bias)[0], got[i])


def test_output_columns_and_bad_shapes() -> None:
    values, scales = _weights(8, 128, 128)
    layer = GroupQuantLinear(128, [IntPart(values, scales, bits=8, group=128)])
    rows = cpu_int8_linear.quantize_rows(_inputs(3, 128), 128)
    wide = torch.full((3, 12), 7.0)
    cpu_int8_linear.linear(rows, layer.packed[0], layer.scales[0], out=wide[:, 2:10])
    assert torch.equal(wide[:, 2:10], cpu_int8_linear.linear(rows, layer.packed[0], layer.scales[0]))
    assert torch.equal(wide[:, :2], torch.full((3, 2), 7.0)) and torch.equal(
        wide[:, 10:], torch.full((3, 2), 7.0)
    )
    with pytest.raises(ValueError, match="do not fit"):
        cpu_int8_linear.linear(rows, layer.packed[0][:, :16], layer.scales[0])
    assert cpu_int8_linear.linear(cpu_int8_linear.quantize_rows(torch.zeros(0, 128), 128), layer.packed[0],
                                  layer.scales[0]).shape == (0, 8)  # fmt: skip
