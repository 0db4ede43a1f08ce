"""Weight-only quantized GEMMs in Triton: ``y = x wᵀ (+ b)`` with ``w`` dequantized tile by tile in registers
for decode batches, and into a dense buffer multiplied by ``torch.matmul`` for larger ones. The GPU counterpart of :mod:`.cpu_quant_linear`, over the same packed layouts:

* :func:`int_linear_triton`: integer weights packed along the inputs into int32 words (value ``j`` of a word in
  bits ``bits*j ...``, lowest first; compressed-tensors' ``pack_to_int32`` layout), stored with an offset of
  ``2^(bits-1)``, one float32 scale per output row and group of ``group`` consecutive inputs, and optionally one
  float32 additive term per (row, group): ``w[n, k] = (u[n, k] - 2^(bits-1)) * scale[n, k // group]
  (+ zero[n, k // group])``; with ``round_bf16`` the weight is rounded to bfloat16 before the product
  (compressed-tensors' decompression to a bfloat16 model). ``bits`` is 4 or 8.
* :func:`fp8_linear_triton`: float8_e4m3fn bytes ``[N, K]`` (held as uint8) with one float32 scale per output row
  and group of ``group`` inputs: ``w[n, k] = fp8(q[n, k]) * scale[n, k // group]``. The bytes are decoded with
  integer arithmetic (exact; no fp8 hardware needed).

Up to :data:`DEQUANTIZE_ABOVE` rows (a decode step's batch), one kernel runs both: program ``(i, j, s)`` computes
the ``BLOCK_M x BLOCK_N`` output tile ``(i, j)`` over the ``s``-th of ``SPLIT`` equal slices of ``K``. The weight
tile is read ``[BLOCK_N, BLOCK_K]``, along the inputs, which is how the weights lie in memory (each output row's
words are contiguous), and decoded in registers by the format's ``@helper`` (``_int_tile``, ``_fp8_tile``); where a
tile lies inside one scale group (``GROUP`` a multiple of ``BLOCK_K``) each row's scale is loaded once per tile.
With ``SPLIT = 1`` each output element is written once; with ``SPLIT > 1`` (decode batches: more programs in flight,
each streaming a slice of the weight) each slice writes its float32 partial tile to a workspace and the slices are
summed in a fixed order afterwards, so results are deterministic and independent of the launch. Accumulation is
float32. With float32 inputs the products are exact float32 (``input_precision="ieee"``), so the result equals ``x @
dense_weightᵀ`` up to summation order; 16-bit inputs multiply the weight tile rounded to the input's dtype on the
tensor cores. Above that many rows the tensor cores bound the product, and :func:`_dequantize_kernel` writes the
whole weight in the activations' dtype, by the same tile helpers, for cuBLAS to multiply: the same values
multiplied, at one extra write and read of the dense weight. All run compiled on CUDA tensors and interpreted on CPU
tensors (:mod:`._jit`), which is how the CPU test suite holds them, under every tile configuration the GPU picks, to
their float64 references.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._jit import helper, interpreting, kernel


@helper
def _scales(s_ptr, z_ptr, rn, n_ok, k0, K, stride_s, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
            BLOCK_K: tl.constexpr):  # fmt: skip
    """``(scale, zero)`` of the rows ``rn`` and inputs ``k0 .. k0 + BLOCK_K``: ``[BLOCK_N, 1]`` when the tile lies
    in one group, else ``[BLOCK_N, BLOCK_K]``; ``zero`` is the scale itself (unused) without ``HAS_ZERO``."""
    if GROUP % BLOCK_K == 0:
        g = rn * stride_s + k0 // GROUP
        mask = n_ok  # k0 < K: the loop stops at K
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        g = rn[:, None] * stride_s + (k // GROUP)[None, :]
        mask = n_ok[:, None] & (k < K)[None, :]
    s = tl.load(s_ptr + g, mask=mask, other=0.0)
    z = s
    if HAS_ZERO:
        z = tl.load(z_ptr + g, mask=mask, other=0.0)
    if GROUP % BLOCK_K == 0:
        s = s[:, None]
        z = z[:, None]
    return s, z


@helper
def _int_tile(w_ptr, s_ptr, z_ptr, rn, n_ok, k0, K, stride_w, stride_s, GROUP: tl.constexpr, BITS: tl.constexpr,
              PER_WORD: tl.constexpr, MASK: tl.constexpr, OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
              ROUND_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The float32 weights ``[BLOCK_N, BLOCK_K]`` of rows ``rn``, inputs ``k0 ..``, from packed integer words: the
    ``BLOCK_K / PER_WORD`` words of each row are loaded once and shifted apart into ``PER_WORD`` values each."""
    kw = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    words = tl.load(w_ptr + rn[:, None] * stride_w + kw[None, :],
                    mask=n_ok[:, None] & (kw < K // PER_WORD)[None, :], other=0)  # fmt: skip
    shifts = tl.arange(0, PER_WORD) * BITS
    u = (words[:, :, None] >> shifts[None, None, :]) & MASK  # arithmetic shift: the mask keeps the value
    u = tl.reshape(u, [BLOCK_N, BLOCK_K])  # input k0 + PER_WORD * word + j, row-major: k in order
    s, z = _scales(s_ptr, z_ptr, rn, n_ok, k0, K, stride_s, GROUP, HAS_ZERO, BLOCK_K)
    w = (u - OFFSET).to(tl.float32) * s
    if HAS_ZERO:
        w += z
    if ROUND_BF16:  # to the nearest bfloat16, ties to even, in integer bits (the interpreter's cast is wrong)
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        w = bits.to(tl.float32, bitcast=True)
    return w


@helper
def _fp8_tile(w_ptr, s_ptr, rn, n_ok, k0, K, stride_w, stride_s, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 weights ``[BLOCK_N, BLOCK_K]`` of rows ``rn``, inputs ``k0 ..``, from e4m3fn bytes: sign, 4
    exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff are NaN."""
    k = k0 + tl.arange(0, BLOCK_K)
    b = tl.load(w_ptr + rn[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0)
    b = b.to(tl.int32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = ((exp + 120) << 23) | (man << 20)  # the same value's float32 bits
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    mag = tl.where((b & 127) == 127, float("nan"), mag)
    sign = tl.where((b & 128) != 0, -1.0, 1.0)
    s, _ = _scales(s_ptr, s_ptr, rn, n_ok, k0, K, stride_s, GROUP, False, BLOCK_K)
    return sign * mag * s


@helper
def _weight_tile(w_ptr, s_ptr, z_ptr, rn, n_ok, k0, K, stride_w, stride_s, FP8: tl.constexpr, GROUP: tl.constexpr,
                 BITS: tl.constexpr, PER_WORD: tl.constexpr, MASK: tl.constexpr, OFFSET: tl.constexpr,
                 HAS_ZERO: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """The float32 weight tile ``[BLOCK_N, BLOCK_K]`` of rows ``rn``, inputs ``k0 ..``, in the format's layout."""
    if FP8:
        w = _fp8_tile(w_ptr, s_ptr, rn, n_ok, k0, K, stride_w, stride_s, GROUP, BLOCK_K)
    else:
        w = _int_tile(w_ptr, s_ptr, z_ptr, rn, n_ok, k0, K, stride_w, stride_s, GROUP, BITS, PER_WORD, MASK, OFFSET,
                      HAS_ZERO, ROUND_BF16, BLOCK_N, BLOCK_K)  # fmt: skip
    return w


@kernel
def _linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_x,
    stride_w,
    stride_s,
    stride_y,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER_WORD: tl.constexpr,
    MASK: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    rn64 = rn.to(tl.int64)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    k_lo = tl.program_id(2) * K_SPLIT  # a multiple of BLOCK_K (and of PER_WORD)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, rn64, n_ok, k0, K, stride_w, stride_s, FP8, GROUP, BITS, PER_WORD,
                         MASK, OFFSET, HAS_ZERO, ROUND_BF16, BLOCK_N, BLOCK_K)  # fmt: skip
        if FP32_DOT:
            acc += tl.dot(xt.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:  # this slice's partial sums, float32, into the workspace [SPLIT, M, N]
        part = y_ptr + (tl.program_id(2) * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(part, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@kernel
def _dequantize_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    stride_s,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    PER_WORD: tl.constexpr,
    MASK: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The dense weight ``[N, K]`` (row-major, ``out``'s dtype), tile ``(i, j)`` per program: the same tile
    helper as :func:`_linear_kernel`, so both paths multiply the same values."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    w = _weight_tile(w_ptr, s_ptr, z_ptr, rn64, n_ok, k0, K, stride_w, stride_s, FP8, GROUP, BITS, PER_WORD, MASK,
                     OFFSET, HAS_ZERO, ROUND_BF16, BLOCK_N, BLOCK_K)  # fmt: skip
    k = k0 + tl.arange(0, BLOCK_K)
    dest = out_ptr + rn64[:, None] * K + k[None, :]
    tl.store(dest, w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (k < K)[None, :])


class Tiles(NamedTuple):
    """A launch configuration: output tile ``block_m x block_n``, ``block_k`` inputs per step, ``split`` slices
    of K (1: no workspace), and the compiler's ``num_warps`` / ``num_stages`` (ignored when interpreted)."""

    block_m: int
    block_n: int
    block_k: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3


DEQUANTIZE_ABOVE = 16
"""Products of more rows than this dequantize the weight into a buffer and multiply it with ``torch.matmul``."""


def gpu_tiles(m: int, k: int, group: int, per_word: int) -> Tiles | None:
    """The tiles a ``[m, k] x [k, n]`` product runs with on a GPU, or ``None`` above
    :data:`DEQUANTIZE_ABOVE` rows: there the weight is dequantized into a buffer of the activations' dtype (one
    read of the packed weight, one write and read of the dense one) and multiplied by ``torch.matmul`` (cuBLAS),
    which outruns any fused tile configuration once the tensor cores, not the weight bytes, bound the product.
    Decode batches (a few rows) are bound by the weight bytes: narrow output tiles (16 x 32 for packed integers,
    16 x 16 for fp8 bytes) over 64 inputs per step (one scale load per row and tile where the group is a multiple
    of 64), K in 4 slices summed afterwards, 2 warps: of a sweep of candidates on an H200 (``python -m
    batchgen.bench.quant_gemm --sweep``) the best for int4 on every shape and batch size tried, and within 5% of
    the best for fp8. ``tl.dot`` needs every tile side to be 16 or more."""
    if m > DEQUANTIZE_ABOVE:
        return None
    bk = max(64 if group % 64 == 0 else 128, 2 * per_word)
    return Tiles(16, 32 if per_word > 1 else 16, bk, min(4, max(1, k // bk)), 2, 4)


def tiles_for(m: int, k: int, group: int, per_word: int, device: torch.device) -> Tiles | None:
    """:func:`gpu_tiles` on CUDA; the interpreter runs whole tiles as numpy arrays, so larger tiles are cheaper
    there (and takes the same dequantizing path above :data:`DEQUANTIZE_ABOVE` rows)."""
    if interpreting(device):
        return None if m > DEQUANTIZE_ABOVE else Tiles(16, 64, 64)
    return gpu_tiles(m, k, group, per_word)


def _dequantized(weight: Tensor, scales: Tensor, zero: Tensor | None, k: int, fmt: dict, dtype) -> Tensor:
    """The dense ``[N, k]`` weight in ``dtype``, written by :func:`_dequantize_kernel`."""
    n = weight.shape[0]
    bk = max(fmt["GROUP"] if fmt["GROUP"] in (64, 128) else 128, 2 * fmt["PER_WORD"])
    dense = torch.empty(n, k, dtype=dtype, device=weight.device)
    _dequantize_kernel.on(weight.device)[(triton.cdiv(n, 32), triton.cdiv(k, bk))](
        weight, scales, scales if zero is None else zero, dense, n, k, weight.stride(0), scales.stride(0),
        HAS_ZERO=zero is not None, BLOCK_N=32, BLOCK_K=bk, num_warps=4, **fmt,
    )  # fmt: skip
    return dense


def _launch(x: Tensor, weight: Tensor, scales: Tensor, zero: Tensor | None, bias: Tensor | None,
            out: Tensor | None, k: int, fmt: dict, tiles: Tiles | None = None) -> Tensor:  # fmt: skip
    """``x [..., k] @ wᵀ (+ bias)`` by :func:`_linear_kernel` with the format's constexprs `fmt` and `tiles`
    (default :func:`tiles_for`; where that is None, the weight dequantized by :func:`_dequantized` and multiplied
    by torch): returns ``[..., N]`` in `x`'s dtype, or writes ``out`` (``[M, N]``, unit stride along N). The interpreter computes and casts 16-bit values wrongly, so there a 16-bit `x` is multiplied in
    float32 and the result cast by torch."""
    if interpreting(x.device) and x.dtype in (torch.bfloat16, torch.float16):
        y = _launch(x.float(), weight, scales, zero, bias, None, k, fmt, tiles)
        return y.to(x.dtype) if out is None else out.copy_(y.reshape(out.shape))
    assert x.shape[-1] == k
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if out is None:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        result = y.view(*x.shape[:-1], n)
    else:
        assert out.shape == (m, n) and out.stride(-1) == 1
        y = result = out
    if m == 0:
        return result
    scales = scales.contiguous()
    if zero is not None:
        zero = zero.contiguous()
        assert zero.shape == scales.shape
    t = tiles or tiles_for(m, k, fmt["GROUP"], fmt["PER_WORD"], x.device)
    if t is None:  # many rows: dequantize, then the dense product
        w_t = _dequantized(weight, scales, zero, k, fmt, x.dtype).t()
        if out is not None:  # a strided column slice: the product is written whole, then copied in
            y.copy_(rows @ w_t if bias is None else torch.addmm(bias.to(x.dtype), rows, w_t))
        elif bias is None:
            torch.matmul(rows, w_t, out=y)
        else:
            torch.addmm(bias.to(x.dtype), rows, w_t, out=y)
        return result
    assert t.block_k % fmt["PER_WORD"] == 0 and t.block_k // fmt["PER_WORD"] >= 1
    steps = triton.cdiv(k, t.block_k)
    split = max(1, min(t.split, steps))
    k_split = triton.cdiv(steps, split) * t.block_k
    split = triton.cdiv(k, k_split)  # no empty slice
    dest = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _linear_kernel.on(x.device)[(triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)](
        rows, weight, scales, scales if zero is None else zero, scales if bias is None else bias, dest,
        m, n, k, k_split, rows.stride(0), weight.stride(0), scales.stride(0), y.stride(0),
        HAS_ZERO=zero is not None, HAS_BIAS=bias is not None, FP32_DOT=x.dtype == torch.float32, SPLIT=split,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
        **fmt,
    )  # fmt: skip
    if split > 1:  # the slices summed in a fixed order
        total = dest.sum(0)
        if bias is not None:
            total += bias.float()
        y.copy_(total)
    return result


def int_linear_triton(
    x: Tensor,
    packed: Tensor,
    bits: int,
    scales: Tensor,
    group: int,
    bias: Tensor | None = None,
    zero: Tensor | None = None,
    round_bf16: bool = False,
    out: Tensor | None = None,
    tiles: Tiles | None = None,
) -> Tensor:
    """``x [..., K] @ wᵀ (+ bias)`` for packed integer weights (module docstring): `packed` ``[N, K * bits / 32]``
    int32, `scales` (and `zero`) ``[N, K / group]`` float32. Returns ``[..., N]`` in `x`'s dtype, or writes
    ``out`` (``[M, N]``, unit stride along N, e.g. a column slice of a fused projection's output)."""
    assert bits in (4, 8) and packed.dtype == torch.int32
    per = 32 // bits
    n, k = packed.shape[0], packed.shape[1] * per
    assert k % group == 0 and scales.shape == (n, k // group)
    fmt = dict(FP8=False, GROUP=group, BITS=bits, PER_WORD=per, MASK=(1 << bits) - 1, OFFSET=1 << (bits - 1),
               ROUND_BF16=round_bf16)  # fmt: skip
    return _launch(x, packed, scales, zero, bias, out, k, fmt, tiles)


def fp8_linear_triton(
    x: Tensor,
    weight: Tensor,
    scales: Tensor,
    group: int,
    bias: Tensor | None = None,
    out: Tensor | None = None,
    tiles: Tiles | None = None,
) -> Tensor:
    """``x [..., K] @ wᵀ (+ bias)`` for fp8 e4m3fn weights (module docstring): `weight` ``[N, K]`` uint8 (the fp8
    bytes), `scales` ``[N, ceil(K / group)]`` float32. Returns ``[..., N]`` in `x`'s dtype, or writes ``out``."""
    assert weight.dtype == torch.uint8 and weight.stride(-1) == 1
    n, k = weight.shape
    assert scales.shape == (n, -(-k // group))
    fmt = dict(FP8=True, GROUP=group, BITS=8, PER_WORD=1, MASK=255, OFFSET=0, ROUND_BF16=False)
    return _launch(x, weight, scales, None, bias, out, k, fmt, tiles)
