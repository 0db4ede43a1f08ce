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
    assert torch.equal(cpu_quant_linear.linear(x[:1], packed, type_id, k, b)[0], got[0])
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
    "rows", [2, 3, 4, 6, 13, 20, 29]
)  # register tiles (x in registers up to 2 rows; 3-6 rows: 3 outputs), buffered; with AMX: vectors up to 12 rows,
# then tiles of 16 rows (13: one padded tile; 20: a tile and 4 rows by the vectors)
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


def _block_integers(x: torch.Tensor) -> torch.Tensor:
    """x as the integer path holds it: each block of 32 values as round-half-even(x / s) s, s = 2^(e - 22) for
    2^e <= the block's largest magnitude < 2^(e + 1) (e at least -103), clamped to [-2^23, 2^23 - 1] s."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    _, e = torch.frexp(blocks.abs().amax(dim=2, keepdim=True))
    s = torch.pow(2.0, (e - 1).clamp(min=-103) - 22).double()
    return (torch.round(blocks / s).clamp(-(2**23), 2**23 - 1) * s).reshape(x.shape)


@needs_compiler
@pytest.mark.parametrize(
    "name", ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
)
def test_the_32_value_block_formats_take_block_integer_inputs_with_amx(name, monkeypatch) -> None:
    """With AMX these formats multiply in integers: each input block is held to 24 bits under its largest
    magnitude (a value far under it keeps fewer bits), the rounded inputs' product is exact up to a few float
    roundings per block, a non-finite input turns its own row's outputs to NaN and no other's, and
    BATCHGEN_QUANT_AMX=0 sends the formats back to the float32 loops."""
    if not cpu_quant_linear.integer_inputs():
        pytest.skip("no AMX here (or BATCHGEN_QUANT_AMX=0): these formats multiply in float32")
    type_id, k = TYPES[name], 256
    packed = random_blocks(21, k, type_id, seed=3)
    w = cpu_quant_linear.dequantize(packed, type_id, k).double()
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))
    x[0, 5] = 2.0**16  # the block's other values keep 6 of their bits
    x[1, 40:60] *= 1e-30  # tiny values beside ordinary ones
    x[2, 64:96] = 0.0  # an all-zero block
    x[3, 64:96] = torch.linspace(-1e-39, 1e-39, 32)  # subnormal values only: s stays a normal float
    x[4, 10], x[5, 33] = float("inf"), float("nan")
    got = cpu_quant_linear.linear(x, packed, type_id, k)
    held = _block_integers(x[:4])
    assert not torch.equal(held, x[:4].double())
    # formats with offsets (w = a c + off) sum a c and off apart: their roundings are of |a c| + |off|, which is
    # at most |w| + twice its block's largest |w| (off being about the weight of code 0)
    offsets = name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
    bound = w.abs() + (2 * w.abs().reshape(21, -1, 32).amax(2).repeat_interleave(32, 1) if offsets else 0)
    want, scale = held @ w.t(), held.abs() @ bound.t()
    assert ((got[:4].double() - want).abs() <= 1e-6 * scale).all()
    assert got[4:].isnan().all() and torch.equal(cpu_quant_linear.linear(x[:4], packed, type_id, k), got[:4])

    # exact arithmetic shows the rounding: integer codes with d = 1, inputs on a grid the sums keep exactly
    codes = torch.randint(-4, 5, (3, 64), generator=torch.Generator().manual_seed(4), dtype=torch.int8)
    codes[:, 0] = 1  # each block's sum and partial sums under 2^24
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    q8 = torch.cat([torch.cat([one, codes[n, 32 * b : 32 * b + 32].view(torch.uint8)]) for n in range(3) for b in
                    range(2)]).reshape(3, 68)  # fmt: skip
    grid = torch.randint(-64, 64, (2, 64), generator=torch.Generator().manual_seed(5)).float() / 64
    grid[:, 0] = 2.0**10  # s = 2^-12 in block 0: multiples of 1/64 are kept; 2^-13 is not
    grid[:, 1] += 2.0**-13
    exact = cpu_quant_linear.linear(grid, q8, 8, 64)
    assert torch.equal(exact.double(), _block_integers(grid) @ codes.double().t())
    assert not torch.equal(exact.double(), grid.double() @ codes.double().t())

    monkeypatch.setenv("BATCHGEN_QUANT_AMX", "0")
    assert not cpu_quant_linear.integer_inputs()
    assert torch.equal(cpu_quant_linear.linear(grid, q8, 8, 64).double(), grid.double() @ codes.double().t())
