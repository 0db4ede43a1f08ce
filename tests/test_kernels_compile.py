"""Compile the Triton kernels for an H100/H200 (sm_90) without a GPU: the interpreter accepts things the
compiler rejects (and vice versa), so CPU-only CI still checks that the compiled path builds, with the tile
configurations the wrappers choose on CUDA, and that none of them spills registers.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.jit import JITFunction  # noqa: E402

from batchgen.kernels import copy_blocks, decode_attention, prefill_attention, store_kv  # noqa: E402
from batchgen.kernels.aot import compile_launch, recording  # noqa: E402
from batchgen.kernels.options import AttentionOptions  # noqa: E402
from batchgen.kernels.paged_kv import PagedKV  # noqa: E402

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = [
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION"),
    pytest.mark.skipif(not os.path.exists(_PTXAS), reason="Triton's NVIDIA backend (ptxas) is not installed"),
    pytest.mark.skipif(
        not isinstance(triton.language.standard._sum_combine, JITFunction),
        reason="triton was imported with TRITON_INTERPRET=1: its library functions cannot be compiled",
    ),
]


def _decode(head_dim, group, dtype, num_splits, **options):
    q = torch.zeros(3, 2 * group, head_dim, dtype=dtype)
    cache = torch.zeros(8, 16, 2, head_dim, dtype=dtype)
    tables, lens = torch.zeros(3, 4, dtype=torch.int32), torch.full((3,), 40, dtype=torch.int32)
    decode_attention.paged_decode_attention(
        q, PagedKV(cache, cache, tables, lens), AttentionOptions(0.1, **options), num_splits=num_splits
    )


def _prefill(head_dim, group, dtype, **options):
    q = torch.zeros(3, 2 * group, head_dim, dtype=dtype)
    cache = torch.zeros(8, 16, 2, head_dim, dtype=dtype)
    tables, lens = torch.zeros(3, 4, dtype=torch.int32), torch.full((3,), 40, dtype=torch.int32)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    prefill_attention.paged_prefill_attention(
        q, cu, PagedKV(cache, cache, tables, lens), AttentionOptions(0.1, **options)
    )


def _all_options(num_q_heads):
    return dict(sliding_window=4096, softcap=50.0, sinks=torch.zeros(num_q_heads))


CASES = {
    "decode-bf16-d128-g8": lambda: _decode(128, 8, torch.bfloat16, 1),
    "decode-split-bf16-d256-g4": lambda: _decode(256, 4, torch.bfloat16, 4),  # + the merge kernel
    "decode-fp32-d80-g1": lambda: _decode(80, 1, torch.float32, 1),
    "prefill-bf16-d128-g4": lambda: _prefill(128, 4, torch.bfloat16),
    "prefill-bf16-d256-g1": lambda: _prefill(256, 1, torch.bfloat16),
    "prefill-fp16-d80-g7": lambda: _prefill(80, 7, torch.float16),
    "prefill-fp32-d128-g4": lambda: _prefill(128, 4, torch.float32),
    # the attention options (sliding window, soft-capping, sinks): the same tiles must still fit
    "decode-options-bf16-d128-g8": lambda: _decode(128, 8, torch.bfloat16, 1, **_all_options(16)),
    "decode-split-options-bf16-d256-g4": lambda: _decode(256, 4, torch.bfloat16, 4, **_all_options(8)),
    "prefill-options-bf16-d128-g4": lambda: _prefill(128, 4, torch.bfloat16, **_all_options(8)),
    "prefill-options-bf16-d256-g1": lambda: _prefill(256, 1, torch.bfloat16, **_all_options(2)),
    "prefill-window-fp32-d128-g4": lambda: _prefill(128, 4, torch.float32, sliding_window=4096),
    "store_kv-bf16-d96": lambda: store_kv.store_kv(
        torch.zeros(5, 4, 96, dtype=torch.bfloat16),
        torch.zeros(5, 4, 96, dtype=torch.bfloat16),
        torch.zeros(4, 16, 4, 96, dtype=torch.bfloat16),
        torch.zeros(4, 16, 4, 96, dtype=torch.bfloat16),
        torch.zeros(5, dtype=torch.long),
    ),  # fmt: skip
    "copy_blocks": lambda: copy_blocks.copy_blocks(
        torch.zeros(2, 2, 4, 16, 8, 128, dtype=torch.bfloat16), torch.tensor([[0, 1]])
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90_without_spills(case):
    with recording() as launches:
        CASES[case]()
    assert launches, "the wrapper launched nothing"
    for launch in launches:
        result = compile_launch(launch, arch=90)
        assert result.registers > 0, result
        assert result.stack_bytes == 0, f"register spills: {result}"
