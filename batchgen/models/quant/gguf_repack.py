"""GGUF's block formats as grouped integer weights: each ggml block format written as an
:class:`~batchgen.models.quant.group_linear.IntPart` (``w = (u - 2^(bits-1)) * scale + zero_term`` per group of
consecutive inputs), the layout the Triton weight-only GEMM multiplies by on a GPU. On the CPU the C kernel
multiplies the block bytes as they are (:class:`~batchgen.models.quant.quant_linear.QuantLinear`); a GPU load
repacks once, here.

Per format (``d``, ``m``, ``dmin``: the block's float16 fields widened to float32; ``q``: its stored values):

======  =======================  =====  =====  ==============================  ================
format  gguf-py's dequantization  bits   group  scale, zero_term                exact?
======  =======================  =====  =====  ==============================  ================
Q4_0    ``d (q - 8)``            4      32     ``d``, none                     bit for bit
Q4_1    ``d q + m``              4      32     ``d``, ``8 d + m``              to rounding
Q5_0    ``d (q - 16)``           8      32     ``d``, none                     bit for bit
Q5_1    ``d q + m``              8      32     ``d``, ``m`` (u = q + 128)      bit for bit
Q8_0    ``d q`` (q int8)         8      32     ``d``, none                     bit for bit
Q2_K    ``(d sc) q - dmin mn``   4      16     ``d sc``, ``-dmin mn`` (u=q+8)  bit for bit
Q3_K    ``(d (sc-32)) q``        8      16     ``d (sc - 32)``, none           bit for bit
Q4_K    ``(d sc) q - dmin mn``   4      32     ``d sc``, ``8 d sc - dmin mn``  to rounding
Q5_K    ``(d sc) q - dmin mn``   8      32     ``d sc``, ``-dmin mn``          bit for bit
Q6_K    ``(d sc) (q - 32)``      8      16     ``d sc``, none                  bit for bit
IQ4_NL  ``d level[q]``           8      32     ``d``, none (u = level + 128)   bit for bit
IQ4_XS  ``(d (sc-32)) level[q]`` 8      32     ``d (sc - 32)``, none           bit for bit
======  =======================  =====  =====  ==============================  ================

"to rounding": the float32 sum ``(u - 8) s + zero_term`` may differ from gguf-py's ``s q + m`` in its last bit.
The 5- and 6-bit formats take a byte per value, plus a float32 scale (and zero term) per group: a repacked
weight is larger than its GGUF blocks (Q4_0 4.5 → 5 bits per weight, Q4_K 4.5 → 6, Q6_K 6.6 → 10, Q8_0 8.5 → 9).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from batchgen.kernels.cpu_quant_linear import FORMATS
from batchgen.models.quant.group_linear import IntPart


def repack(packed: Tensor, type_id: int, in_features: int) -> IntPart:
    """The ``[rows, row_bytes]`` uint8 rows of one GGUF tensor (type `type_id`) as an :class:`IntPart`."""
    fmt = FORMATS.get(type_id)
    if fmt is None:
        raise ValueError(f"unsupported block format {type_id}")
    rows = packed.shape[0]
    blocks = packed.numpy().reshape(rows * (in_features // fmt.block_values), fmt.block_bytes)
    u, scale, zero, bits, group = _SPLIT[fmt.name](blocks)
    n_groups = in_features // group
    return IntPart(
        values=torch.from_numpy(u.reshape(rows, in_features).astype(np.int64)),
        scales=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, n_groups)),
        bits=bits,
        group=group,
        zero_term=None
        if zero is None
        else torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32).reshape(rows, n_groups)),
    )


def _f16(b: np.ndarray) -> np.ndarray:
    """A float16 field (2 bytes per block) widened to float32 ``[blocks, 1]``."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """ggml's 4-bit packing: in each run of `half` bytes, the low nibbles are values ``0 .. half-1`` and the high
    nibbles values ``half .. 2 half - 1``."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _crumbs(b: np.ndarray) -> np.ndarray:
    """ggml's 2-bit packing: in each run of 32 bytes, bits ``2j .. 2j+1`` of byte ``i`` are value ``32 j + i``."""
    n = b.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((b.reshape(n, -1, 1, 32) >> shifts) & np.uint8(3)).reshape(n, -1)


def _bit_planes(b: np.ndarray) -> np.ndarray:
    """32 bytes per block holding one bit per value: bit ``j`` of byte ``i`` is value ``32 j + i``."""
    n = b.shape[0]
    return ((b.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)).reshape(
        n, 256
    )


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: the fifth bit of each of 32 values, bit ``j`` of a little-endian uint32."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _q4_0(b):
    d, qs = b[:, :2], b[:, 2:]
    return _nibbles(qs, 16), _f16(d), None, 4, 32


def _q4_1(b):
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:]
    return _nibbles(qs, 16), d, 8 * d + m, 4, 32


def _q5_0(b):
    d, qh, qs = _f16(b[:, :2]), b[:, 2:6], b[:, 6:]
    q = _nibbles(qs, 16) | (_high_bits(qh) << np.uint8(4))
    return q.astype(np.int64) - 16 + 128, d, None, 8, 32


def _q5_1(b):
    d, m, qh, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:8], b[:, 8:]
    q = _nibbles(qs, 16) | (_high_bits(qh) << np.uint8(4))
    return q.astype(np.int64) + 128, d, m, 8, 32


def _q8_0(b):
    d, qs = _f16(b[:, :2]), np.ascontiguousarray(b[:, 2:]).view(np.int8)
    return qs.astype(np.int64) + 128, d, None, 8, 32


IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int64
)
"""IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml's ``kvalues_iq4nl``)."""


def _iq4_nl(b):
    d, qs = _f16(b[:, :2]), b[:, 2:]
    return IQ4_LEVELS[_nibbles(qs, 16)] + 128, d, None, 8, 32


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1) >> (
        2 * np.arange(8, dtype=np.uint16)
    )
    low = (b[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, 8)
    sc = ((low & 0x0F) | ((high & 3).astype(np.uint8) << 4)).astype(np.int64) - 32
    return IQ4_LEVELS[_nibbles(b[:, 8:], 16)] + 128, d * sc.astype(np.float32), None, 8, 32


def _k_scales(b) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-32-value scale ``d sc`` and min ``dmin m`` ``[blocks, 8]`` float32: the fp16 d and
    dmin, then 8 six-bit scales and mins packed in 12 bytes (gguf-py's ``Q4_K.get_scale_min``)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    packed = b[:, 4:16].reshape(n, 3, 4)
    lo, hi, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), dmin * mn.astype(np.float32)


def _q4_k(b):
    scale, low = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scale, 8 * scale - low, 4, 32


def _q6_k(b):
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    q = _nibbles(ql, 64) | (_crumbs(qh) << np.uint8(4))
    scale = d * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)  # [n, 16]
    return q.astype(np.int64) - 32 + 128, scale, None, 8, 16


def _q2_k(b):
    sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    scale = d * (sc & 0x0F).astype(np.float32)  # [n, 16]
    zero = -(dmin * (sc >> 4).astype(np.float32))
    return _crumbs(qs).astype(np.int64) + 8, scale, zero, 4, 16


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, s, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (s[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (s[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(
        n, 16
    )
    sc = ((low & 0x0F) | ((high & 3) << 4)).astype(np.int64) - 32
    q = _crumbs(qs).astype(np.int64) - 4 * (1 - _bit_planes(hmask).astype(np.int64))
    return q + 128, d * sc.astype(np.float32), None, 8, 16


def _q5_k(b):
    scale, low = _k_scales(b)
    q = _nibbles(b[:, 48:176], 32) | (_bit_planes(b[:, 16:48]) << np.uint8(4))
    return q.astype(np.int64) + 128, scale, -low, 8, 32


_SPLIT = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}
