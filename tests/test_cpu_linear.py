"""The CPU linear layer (kernels/csrc/linear_cpu.c via kernels/cpu_linear.py) and PackedLinear over it: equal
to a float64 product within float32 rounding, bit-identical for a row whatever batch it comes in, the plain-C
build equal to the AVX2 one, every tail shape (rows not a multiple of the tile, columns not a multiple of the
panel, K not a multiple of the chunk, strided inputs, a bias)."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_kernel, cpu_linear
from batchgen.models.packed_linear import PackedLinear, dense_state_dict, pack_linears

needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")

SHAPES = [  # (rows, in, out): tiles of 6 rows, panels of 16 columns, chunks of 512 of K, blocks of 144 rows
    (1, 7, 5),
    (6, 64, 16),
    (13, 300, 37),
    (64, 512, 1024),
    (145, 513, 100),
    (300, 40, 33),
    (7, 2048, 17),
]


@pytest.fixture(autouse=True)
def _fresh_kernel(monkeypatch):
    monkeypatch.delenv(cpu_kernel.ENV_SWITCH, raising=False)
    cpu_kernel.reset()
    yield
    cpu_kernel.reset()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())


@needs_compiler
@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(rows, k, n, bias) -> None:
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_linear.pack(w)
    assert packed.shape == (-(-n // 16), k, 16) and torch.equal(cpu_linear.unpack(packed, n), w)
    got = cpu_linear.linear(x, packed, None if b is None else cpu_linear.pack_bias(b, n), n)
    assert got.shape == (rows, n) and got.is_contiguous()
    want = _reference(x, w, b)
    scale = x.abs().double() @ w.abs().double().t()  # the size of what was summed, per output
    assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-6).all()


@needs_compiler
def test_rows_do_not_depend_on_their_batch() -> None:
    """A row's output is bit for bit the same alone, in any batch, at any position, with any thread count."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 700, generator=g), torch.randn(200, 700, generator=g)
    b = torch.randn(100, generator=g)
    packed, pb = cpu_linear.pack(w), cpu_linear.pack_bias(b, 100)
    full = cpu_linear.linear(x, packed, pb, 100)
    threads = torch.get_num_threads()
    try:
        for i, rows in ((0, slice(0, 1)), (5, slice(3, 10)), (150, slice(140, 200)), (199, slice(199, 200))):
            torch.set_num_threads(1 + i % 2)
            part = cpu_linear.linear(x[rows], packed, pb, 100)
            assert torch.equal(part[i - rows.start], full[i])
    finally:
        torch.set_num_threads(threads)


@needs_compiler
def test_strided_and_batched_inputs() -> None:
    """Leading dims kept; a row-strided view (a slice of a wider tensor) read in place; a transposed input
    copied first; zero rows give an empty result."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 32, generator=g)
    packed = cpu_linear.pack(w)
    wide = torch.randn(10, 50, generator=g)
    view = wide[:, 5:37]
    torch.testing.assert_close(cpu_linear.linear(view, packed, None, 48), view @ w.t(), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 32, generator=g)
    assert cpu_linear.linear(x3, packed, None, 48).shape == (2, 3, 48)
    xt = torch.randn(32, 9, generator=g).t()
    torch.testing.assert_close(cpu_linear.linear(xt, packed, None, 48), xt @ w.t(), rtol=1e-5, atol=1e-5)
    assert cpu_linear.linear(torch.empty(0, 32), packed, None, 48).shape == (0, 48)


@needs_compiler
def test_generic_build_equals_avx2_build(monkeypatch) -> None:
    """The plain-C tile (what a CPU without AVX2/FMA compiles) runs the same chains of fused multiply-adds:
    the same bits."""
    g = torch.Generator().manual_seed(5)
    w, x, b = (
        torch.randn(37, 300, generator=g),
        torch.randn(13, 300, generator=g),
        torch.randn(37, generator=g),
    )
    packed, pb = cpu_linear.pack(w), cpu_linear.pack_bias(b, 37)
    fast = cpu_linear.linear(x, packed, pb, 37)
    generic = cpu_kernel._load(("BATCHGEN_GENERIC",))
    assert generic is not None
    monkeypatch.setitem(cpu_kernel._state, "lib", generic)
    assert torch.equal(cpu_linear.linear(x, packed, pb, 37), fast)


@needs_compiler
def test_packed_linear_module(monkeypatch) -> None:
    """pack_linears swaps nn.Linear for PackedLinear (panels) with the same outputs and the same weights back;
    with the C kernels off the layout is oneDNN's (where torch has it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8, bias=False))
    x = torch.randn(5, 24)
    want, state = model(x), {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model, "panels") == 2
    assert all(isinstance(model[i], PackedLinear) and model[i].layout == "panels" for i in (0, 2))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    dense = dense_state_dict(model)
    assert all(torch.equal(dense[k], v) for k, v in state.items())
    assert "layout=panels" in repr(model[0])
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    assert not cpu_linear.available()


NARROW = [torch.bfloat16, torch.float16]


@needs_compiler
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("rows, k, n", [(1, 7, 5), (13, 300, 37), (145, 513, 100)])
def test_narrow_weights_widen_in_registers(dtype, rows, k, n) -> None:
    """bfloat16 / float16 panels: within float32 rounding of the float64 product on the rounded weights, and bit
    for bit the float32 kernel on those weights widened (the same chains of fused multiply-adds); half the
    bytes."""
    g = torch.Generator().manual_seed(rows + k + n)
    w, x, b = (
        torch.randn(n, k, generator=g).to(dtype),
        torch.randn(rows, k, generator=g),
        torch.randn(n, generator=g),
    )
    w[0, :3] = torch.tensor([6.0e-8, -3.0e-5, 0.0]).to(dtype)  # subnormal float16 values widen exactly too
    packed, pb = cpu_linear.pack(w), cpu_linear.pack_bias(b, n)
    assert packed.dtype == dtype and torch.equal(cpu_linear.unpack(packed, n), w)
    got = cpu_linear.linear(x, packed, pb, n)
    assert torch.equal(got, cpu_linear.linear(x, cpu_linear.pack(w.float()), pb, n))
    want = _reference(x, w.float(), b)
    scale = x.abs().double() @ w.abs().double().t()
    assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-6).all()


@needs_compiler
@pytest.mark.parametrize("dtype", NARROW)
def test_narrow_weights_generic_build_equals_avx2_build(monkeypatch, dtype) -> None:
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(37, 300, generator=g).to(dtype), torch.randn(13, 300, generator=g)
    w[1, :4] = torch.tensor([6.0e-8, -3.0e-5, float("inf"), 1.0e-6]).to(dtype)
    x[:, 2] = 0.0  # inf * 0 is nan in both builds; keep the rest finite
    packed = cpu_linear.pack(w)
    fast = cpu_linear.linear(x, packed, None, 37)
    generic = cpu_kernel._load(("BATCHGEN_GENERIC",))
    assert generic is not None
    monkeypatch.setitem(cpu_kernel._state, "lib", generic)
    torch.testing.assert_close(cpu_linear.linear(x, packed, None, 37), fast, rtol=0, atol=0, equal_nan=True)
