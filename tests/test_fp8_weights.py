"""fp8 weights: fine-grained block fp8 (``quant_method: fp8``, ``weight_scale_inv``) and compressed-tensors
``float-quantized`` (per-channel and per-tensor ``weight_scale``): greedy output equal token for token to
transformers' own CPU loading of the same checkpoint (which dequantizes to float32), the dequantized weights bit
for bit transformers', one byte per weight in memory; schemes not run refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_helpers import batchgen_greedy, transformers_greedy, transformers_model

from batchgen import LLM
from batchgen.models.quant import writers
from batchgen.models.quant.fp8 import Fp8Linear
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint


@pytest.fixture(scope="module")
def llama_256(ckpt_factory) -> str:
    return ckpt_factory("llama", seed=34, hidden_size=256, intermediate_size=512)


def _write(kind: str, base: str, out: Path) -> str:
    if kind == "block":
        return writers.write_block_fp8(base, out, block=(32, 64))
    if kind == "block-ragged":  # blocks that do not divide the shapes (ceil-sized scale grids)
        return writers.write_block_fp8(base, out, block=(48, 96))
    pytest.importorskip(
        "compressed_tensors", reason="compressed-tensors (transformers' decompressor) not installed"
    )
    return writers.write_compressed_fp8(base, out, strategy=kind.removeprefix("ct-"))


@pytest.mark.parametrize("kind", ["block", "ct-channel", "ct-tensor"])
def test_greedy_equals_transformers(llama_256, tmp_path, kind) -> None:
    path = _write(kind, llama_256, tmp_path / "fp8")
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    model = llm.engine.model
    quantized = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(quantized) == 4 * model.config.num_layers
    assert all(w.dtype == torch.uint8 for m in quantized for w in m.weights)  # one byte per weight
    got = batchgen_greedy(llm)
    hf = transformers_model(path)
    want = transformers_greedy(hf)
    assert got == want and len({t for row in got for t in row}) > 6
    layer, ref = model.model.layers[1], hf.model.layers[1]
    assert torch.equal(
        layer.self_attn.qkv_proj.dense_weight(),
        torch.cat([getattr(ref.self_attn, f"{n}_proj").weight for n in "qkv"]),
    )
    assert torch.equal(layer.mlp.down_proj.dense_weight(), ref.mlp.down_proj.weight)


def test_block_scales_that_do_not_divide_the_shapes(llama_256, tmp_path) -> None:
    """Scale grids of ceil(N / bn) x ceil(K / bk): each weight times its block's scale, float64 reference."""
    from safetensors.torch import load_file

    path = _write("block-ragged", llama_256, tmp_path / "fp8")
    model = LLM(path, num_blocks=64, block_size=8).engine.model
    state = load_file(str(Path(path) / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    w, s = state[f"{name}.weight"].double(), state[f"{name}.weight_scale_inv"].double()
    rows = torch.arange(w.shape[0]) // 48
    cols = torch.arange(w.shape[1]) // 96
    # the exact product rounded once to float32 (what transformers' float32 multiplication gives)
    assert torch.equal(model.model.layers[0].mlp.down_proj.dense_weight(), (w * s[rows][:, cols]).float())


REFUSED = {
    "static activations": ({"activation_scheme": "static"}, "activation_scheme='static'"),
    "no block size": ({"weight_block_size": None}, "weight_block_size=None"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_block_fp8_schemes_not_run_are_refused_by_name(llama_256, tmp_path, case) -> None:
    path = _write("block", llama_256, tmp_path / "fp8")
    cfg = json.loads((Path(path) / "config.json").read_text())
    change, message = REFUSED[case]
    cfg["quantization_config"].update(change)
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpoint, match=message):
        LLM(path, num_blocks=64, block_size=8)


def test_fp8_inputs_of_other_widths_are_refused_by_name(llama_256, tmp_path) -> None:
    """fp8 weights with 4-bit float inputs (an NVFP4-style W4A4 group): named at load."""
    path = _write("ct-channel", llama_256, tmp_path / "fp8")
    cfg = json.loads((Path(path) / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "dynamic": True,
                                  "group_size": 16}  # fmt: skip
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpoint, match=r"float inputs of 4 bits"):
        LLM(path, num_blocks=64, block_size=8)


def test_llm_compressor_fp8_block_preset_equals_transformers(llama_256, tmp_path) -> None:
    # FP8_BLOCK as llm-compressor writes it: 128 x 128 weight blocks, fp8 inputs quantized dynamically per
    # token in groups of 128 inputs, every QuantizationArgs field saved (observer_kwargs a dict)
    pytest.importorskip(
        "compressed_tensors", reason="compressed-tensors (transformers' decompressor) not installed"
    )
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    from batchgen.models.quant.input_quant import InputQuantLinear

    path = writers.write_compressed_fp8_block(llama_256, tmp_path / "fp8-block")
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    model = llm.engine.model
    wrapped = [m for m in model.modules() if isinstance(m, InputQuantLinear)]
    assert len(wrapped) == 4 * model.config.num_layers and all(
        isinstance(m.inner, Fp8Linear) for m in wrapped
    )
    hf = transformers_model(path)
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(hf) and len({t for row in got for t in row}) > 6
    ours, theirs = model.model.layers[1].mlp.down_proj, hf.model.layers[1].mlp.down_proj
    x = torch.randn(5, ours.in_features, generator=torch.Generator().manual_seed(0)) * 3
    spiked = x.clone()
    spiked[2, :128] *= 50  # one group of one token far larger: only that group's scale grows
    with torch.no_grad():
        args = theirs.quantization_scheme.input_activations
        q = ours.quantize_input(spiked)
        assert torch.equal(q, forward_quantize(theirs, spiked[None], "input", args)[0])
        assert torch.equal(q[2, 128:], ours.quantize_input(x)[2, 128:]) and not torch.equal(
            q[2], ours.quantize_input(x)[2]
        )


def test_input_groups_that_do_not_divide_a_projection_are_refused_at_load(tmp_path) -> None:
    pytest.importorskip(
        "compressed_tensors", reason="compressed-tensors (transformers' decompressor) not installed"
    )
    tiny = (
        Path(__file__).resolve().parents[1] / "batchgen/models/tiny_lm"
    )  # hidden 192: not whole groups of 128
    path = writers.write_compressed_fp8_block(tiny, tmp_path / "fp8-block")
    with pytest.raises(
        UnsupportedCheckpoint, match="not whole groups of the input activations' group_size 128"
    ):
        LLM(path, num_blocks=16, block_size=8)
