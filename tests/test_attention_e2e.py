"""End to end: the engine with ``attention_backend=triton`` gives the same greedy tokens as the torch backend.

On the CPU the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, which the engine requires for
triton off CUDA); on a GPU (marker ``gpu``) they run compiled, against the torch backend on the same device.
One workload exercises every kernel: prefix-cache hits (prefill after cached blocks), chunked prefill mixed
with decodes in one batch, block-boundary prompt lengths, and ``n=2`` forks whose shared partial block is
copied on write (``copy_blocks``).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
# Import the kernels (and with them triton.language) before TRITON_INTERPRET is set below: Triton reads that
# variable when its library is first imported, and the compiled GPU tests need it unset then.
import batchgen.kernels.decode_attention  # noqa: E402,F401
from batchgen import LLM, SamplingParams  # noqa: E402

BS = 8


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    shared = [rng.randrange(5, 4096) for _ in range(2 * BS + 3)]
    prompts = [shared + [rng.randrange(5, 4096) for _ in range(k)] for k in (1, BS, 2 * BS + 1)]
    prompts += [[rng.randrange(5, 4096) for _ in range(n)] for n in (1, BS - 1, 5 * BS + 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * len(prompts)
    params[1] = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    return prompts, params


def _run(path: str, backend: str, device: str) -> tuple[list[list[list[int]]], int, int]:
    llm = LLM(
        path,
        attention_backend=backend,
        device=device,
        block_size=BS,
        num_blocks=64,
        max_num_batched_tokens=24,
    )
    assert llm.engine.runner.attn.backend == backend
    prompts, params = _workload()
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)  # fills the prefix cache
    rest = llm.generate(prompts[1:], params[1:], use_tqdm=False)
    tokens = [[o.token_ids for o in r.outputs] for r in first + rest]
    stats = llm.engine.stats
    return tokens, stats.prompt_tokens_cached, stats.num_cow_copies


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_triton_backend_matches_torch_backend_greedy(llama_ckpt: str, device: str, monkeypatch) -> None:
    expected, cached, copies = _run(llama_ckpt, "torch", device)
    assert cached > 0 and copies > 0, "the workload must hit the prefix cache and copy a block on write"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, cached_triton, copies_triton = _run(llama_ckpt, "triton", device)
    assert (cached_triton, copies_triton) == (cached, copies)
    assert got == expected
