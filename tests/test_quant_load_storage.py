"""Loading a quantized checkpoint never gives its quantized projections dense storage: the model is built on
the meta device, the packed modules are swapped in on the target device, and only then does the rest get
storage (on a GPU an uninitialised dense weight is allocated at once, so a model that fits packed would not
load)."""

from __future__ import annotations

import pytest
from quant_helpers import write_compressed_tensors, write_gguf

from batchgen import LLM
from batchgen.models import loader
from batchgen.models.quant import writers

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_256(ckpt_factory) -> str:
    return ckpt_factory("llama", seed=33, hidden_size=256, intermediate_size=512)


def _gguf(base: str, out) -> str:
    pytest.importorskip("gguf", reason="the gguf extra (pip install batchgen[gguf]) is not installed")
    return write_gguf(base, out / "q.gguf", 2)  # Q4_0


def _compressed(base: str, out) -> str:
    pytest.importorskip("compressed_tensors", reason="the quant extra (compressed-tensors) is not installed")
    return write_compressed_tensors(base, out / "ct")


@pytest.mark.parametrize(
    "write",
    [
        _gguf,
        _compressed,
        lambda base, out: writers.write_gptq(base, out / "gptq"),
        lambda b, o: writers.write_awq(b, o / "awq"),
    ],
    ids=["gguf", "compressed-tensors", "gptq", "awq"],
)
def test_quantized_projections_never_get_dense_storage(llama_256, tmp_path, monkeypatch, write) -> None:
    path = write(llama_256, tmp_path)
    given: list[set[str]] = []
    real = loader.materialize

    def spy(model, dtype, device):
        given.append({n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta})
        return real(model, dtype, device)

    monkeypatch.setattr(loader, "materialize", spy)
    llm = LLM(str(path), num_blocks=16, block_size=8)
    assert len(given) == 1
    stored = given[0]
    assert any("embed_tokens" in n for n in stored)  # the float parameters get storage then
    dense = sorted(n for n in stored if any(f".{p}." in n for p in PROJECTIONS))
    assert not dense, f"dense storage given to quantized projections: {dense[:3]}"
    assert not [
        n for n, p in llm.engine.model.named_parameters() if p.is_meta
    ]  # nothing left without storage
