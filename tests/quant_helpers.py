"""Helpers for the quantized-checkpoint tests: random but valid GGUF (ggml) blocks, and tiny GGUF files written
with the `gguf` package's writer from a tiny Hugging Face checkpoint."""

from __future__ import annotations

import numpy as np
import torch

from batchgen.kernels.cpu_quant_linear import FORMATS

SCALE_OFFSETS = {2: (0,), 8: (0,), 12: (0, 2), 14: (208,)}
"""Byte offsets of each block's fp16 scale fields, by ggml type id (the rest of a block is any bits)."""


def random_blocks(
    rows: int, in_features: int, type_id: int, seed: int = 0, scale: float = 0.02
) -> torch.Tensor:
    """``[rows, row_bytes]`` uint8: random quantized values with finite random fp16 scales."""
    fmt = FORMATS[type_id]
    rng = np.random.default_rng(seed)
    nblocks = in_features // fmt.block_values
    data = rng.integers(0, 256, size=(rows, nblocks, fmt.block_bytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[type_id]:
        d = (rng.random((rows, nblocks)) * scale + scale / 10).astype(np.float16)
        data[:, :, off : off + 2] = d.view(np.uint8).reshape(rows, nblocks, 2)
    return torch.from_numpy(data.reshape(rows, nblocks * fmt.block_bytes))
