"""The weight-only quantized GEMM (kernels/csrc/quant_linear_cpu.c via kernels/cpu_quant_linear.py): its
dequantization bit for bit gguf-py's, its product within float32 rounding of the float64 product with the
dequantized weights, rows independent of their batch, results written into column slices."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from quant_helpers import random_blocks

from batchgen.kernels import cpu_kernel, cpu_quant_linear

gguf = pytest.importorskip("gguf", reason="the gguf extra (pip install batchgen[gguf]) is not installed")
needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}  # fmt: skip


@needs_compiler
@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("rows", [1, 4, 5, 70])
def test_quant_linear_matches_float64_on_dequantized_weights(name, rows) -> None:
    type_id = TYPES[name]
    k, n = 512, 37
    packed = random_blocks(n, k, type_id, seed=rows)
    want_w = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(packed.numpy(), type_id)))
    w = cpu_quant_linear.dequantize(packed, type_id, k)
    assert w.shape == (n, k) and torch.equal(w, want_w)  # gguf-py's dequantization, bit for bit
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    got = cpu_quant_linear.linear(x, packed, type_id, k, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    scale = x.abs().double() @ w.abs().double().t()
    assert got.shape == (rows, n) and ((got.double() - want).abs() <= 1e-6 * scale + 1e-6).all()
    # a row's output does not depend on its batch; a column slice of a wider output is written in place
    assert torch.equal(cpu_quant_linear.linear(x[-1:], packed, type_id, k, b)[0], got[-1])
    wide = torch.zeros(rows, n + 10)
    cpu_quant_linear.linear(x, packed, type_id, k, b, out=wide[:, 4 : 4 + n])
    assert torch.equal(wide[:, 4 : 4 + n], got) and not wide[:, :4].any() and not wide[:, 4 + n :].any()


def _fp8_weights(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 bytes over every value but NaN (subnormals, both zeros) and positive scales per group."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    packed[(packed & 0x7F) == 0x7F] = 0x3C
    return packed, torch.rand(n, k // group, generator=g) * 0.02 + 1e-3


@needs_compiler
@pytest.mark.parametrize("group", [8, 32, 128, 384])  # 8: the plain-C loops; 384: one scale per row
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_fp8_linear_matches_float64_on_dequantized_weights(group, rows) -> None:
    """fp8 (e4m3) bytes widened in registers: the product within float32 rounding of the float64 product with
    torch's fp8 -> float32 cast times the scale (every byte value but NaN: subnormals and both zeros)."""
    k, n = 384, 37
    packed, scales = _fp8_weights(n, k, group, seed=rows)
    w = packed.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(group, dim=1)
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    got = cpu_quant_linear.fp8_linear(x, packed, scales, group, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    scale = x.abs().double() @ w.abs().double().t()
    assert got.shape == (rows, n) and ((got.double() - want).abs() <= 1e-6 * scale + 1e-6).all()
    assert torch.equal(cpu_quant_linear.fp8_linear(x[-1:], packed, scales, group, b)[0], got[-1])
    with pytest.raises(RuntimeError, match="rejected group 40"):
        cpu_quant_linear.fp8_linear(x, packed, scales, 40, b)
    with pytest.raises(ValueError, match="scales must be contiguous float32"):
        cpu_quant_linear.fp8_linear(x, packed, scales, 48, b)


@needs_compiler
def test_bad_shapes_are_refused() -> None:
    packed = random_blocks(4, 64, 8)
    with pytest.raises(RuntimeError, match="rejected Q8_0"):
        cpu_quant_linear.linear(torch.randn(2, 48), packed[:, :51], 8, 48)


@needs_compiler
@pytest.mark.parametrize(
    "rows", [2, 3, 4, 6, 29]
)  # register tiles (x in registers up to 2 rows; 3-6 rows: 3 outputs), buffered
def test_simd_build_equals_generic_build(monkeypatch, rows) -> None:
    """The SIMD kernels (in-register widening, table lookups, register tiles) give the plain-C loops' bits: the
    same dequantized weights, multiplied and summed in the same order, for every format (fp8 included)."""
    g = torch.Generator().manual_seed(rows)
    cases = []  # (in_features, the product as a function of x)
    for type_id in TYPES.values():
        k = 512 if cpu_quant_linear.FORMATS[type_id].block_values == 256 else 544  # 544: a short last chunk
        packed = random_blocks(37, k, type_id, seed=rows)
        cases.append((k, partial(cpu_quant_linear.linear, packed=packed, type_id=type_id, in_features=k)))
    for bits, group, bf16 in [(4, 32, False), (4, 64, True), (8, 96, False), (4, 8, False)]:
        k = 576
        packed = torch.randint(-(2**31), 2**31 - 1, (37, k * bits // 32), generator=g, dtype=torch.int32)
        scales = torch.rand(37, k // group, generator=g) * 0.01
        product = partial(cpu_quant_linear.int_linear, packed=packed, bits=bits, scales=scales, group=group)
        cases.append((k, partial(product, round_bf16=bf16)))
    for group in (32, 64, 576):
        packed, scales = _fp8_weights(37, 576, group, seed=rows + group)
        cases.append((576, partial(cpu_quant_linear.fp8_linear, packed=packed, scales=scales, group=group)))
    xs = [torch.randn(rows, k, generator=g) for k, _ in cases]
    fast = [f(x) for (_, f), x in zip(cases, xs)]
    generic = cpu_kernel._load(("BATCHGEN_GENERIC",))
    assert generic is not None
    monkeypatch.setitem(cpu_kernel._state, "lib", generic)
    for (_, f), x, want in zip(cases, xs, fast):
        assert torch.equal(f(x), want)
