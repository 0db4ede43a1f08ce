"""The encoder path's packed attention (``batchgen_varlen``) against plain attention of each sequence alone:
mixed lengths, equal lengths (no padding: no gather), one sequence, a sliding window, and both query layouts
transformers' encoders hand it (a transposed ``[1, T, H, D]`` projection, or a contiguous ``[1, H, T, D]``)."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_kernel
from batchgen.pooling.varlen_attention import PackedLayout, packed, varlen_attention

H, D = 4, 8


def _reference(q, k, v, lengths, window):
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        mask = None
        if window is not None:
            pos = torch.arange(n)
            mask = (pos[:, None] - pos[None, :]).abs() < window
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], attn_mask=mask
        )
        outs.append(o.transpose(1, 2))
        start += n
    return torch.cat(outs, dim=1)  # [1, T, H, D]


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [6, 6, 6], [11]])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize(
    "kernel", ["1", "0"]
)  # the C kernel's paged prefill (where it builds), the torch path
def test_packed_attention_equals_each_sequence_alone(lengths, window, transposed, kernel, monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, kernel)
    g = torch.Generator().manual_seed(sum(lengths) + (window or 0))
    t = sum(lengths)

    def make():
        if transposed:  # transformers' projections: [1, T, H, D] viewed as [1, H, T, D]
            return torch.randn(1, t, H, D, generator=g).transpose(1, 2)
        return torch.randn(1, H, t, D, generator=g)

    q, k, v = make(), make(), make()
    with packed(PackedLayout.build(lengths, torch.device("cpu"))):
        out, _ = varlen_attention(None, q, k, v, None, scaling=None, sliding_window=window)
    assert out.shape == (1, t, H, D)
    torch.testing.assert_close(out, _reference(q, k, v, lengths, window), atol=1e-5, rtol=1e-5)
