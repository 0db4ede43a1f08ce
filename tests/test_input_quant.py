"""Quantized input activations (compressed-tensors W8A8 int8 and FP8_DYNAMIC, static int8 / fp8 input scales):
each projection's input quantized and dequantized by compressed-tensors' own arithmetic, bit for bit what
transformers' loading of the checkpoint computes for the same input; greedy output equal to transformers' on the
trained tiny model; schemes not run refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from quant_helpers import batchgen_greedy, transformers_greedy, transformers_model

from batchgen import LLM
from batchgen.models.quant import writers
from batchgen.models.quant.fp8 import Fp8Linear
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.group_linear import GroupQuantLinear
from batchgen.models.quant.input_quant import InputQuant, InputQuantLinear

pytest.importorskip("compressed_tensors", reason="compressed-tensors (the quant extra) is not installed")

TINY_LM = Path(__file__).resolve().parents[1] / "batchgen/models/tiny_lm"
TEXTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "In the morning, the cat"]
SCHEMES = {  # name: writer kwargs
    "int8-dynamic": dict(weights="int8"),  # llm-compressor's W8A8
    "fp8-dynamic": dict(weights="fp8"),  # FP8_DYNAMIC
    "int8-static": dict(weights="int8", inputs="static", input_scale=0.05),
    "fp8-static": dict(weights="fp8", inputs="static", input_scale=0.05),  # FP8
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_LM))
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_greedy_and_quantized_inputs_equal_transformers(tmp_path, prompts, scheme) -> None:
    path = writers.write_compressed_w8a8(TINY_LM, tmp_path / scheme, dtype=torch.bfloat16, **SCHEMES[scheme])
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    model = llm.engine.model
    wrapped = [m for m in model.modules() if isinstance(m, InputQuantLinear)]
    inner = Fp8Linear if scheme.startswith("fp8") else GroupQuantLinear
    assert len(wrapped) == 4 * model.config.num_layers and all(isinstance(m.inner, inner) for m in wrapped)
    hf = transformers_model(path)
    got = batchgen_greedy(llm, prompts, new=24)
    assert got == transformers_greedy(hf, prompts, new=24)
    assert len({t for row in got for t in row}) > 10

    # the same input through one projection each way: the quantized input bit for bit, the product to rounding
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    ours, theirs = model.model.layers[2], hf.model.layers[2]
    with torch.no_grad():
        for fused, parts in ((ours.self_attn.qkv_proj, [theirs.self_attn.q_proj, theirs.self_attn.k_proj,
                                                        theirs.self_attn.v_proj]),
                             (ours.mlp.down_proj, [theirs.mlp.down_proj])):  # fmt: skip
            x = torch.randn(5, fused.in_features, generator=torch.Generator().manual_seed(0)) * 3
            for part in parts:
                args = part.quantization_scheme.input_activations
                assert torch.equal(fused.quantize_input(x), forward_quantize(part, x[None], "input", args)[0])
            want = torch.cat([part(x[None])[0] for part in parts], dim=-1)
            torch.testing.assert_close(fused(x), want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                fused.dense_weight(), torch.cat([p.weight for p in parts]), atol=0, rtol=0
            )


def test_dynamic_inputs_are_quantized_per_token(tmp_path) -> None:
    """A row's result does not depend on the rows batched with it (the engine batches any rows together)."""
    path = writers.write_compressed_w8a8(TINY_LM, tmp_path / "q", weights="int8", dtype=torch.float32)
    proj = LLM(path, num_blocks=16, block_size=8).engine.model.model.layers[0].mlp.down_proj
    x = torch.randn(6, proj.in_features, generator=torch.Generator().manual_seed(1))
    x[3] *= 100  # one row far larger: a per-tensor scale would coarsen every other row
    alone = torch.cat([proj.quantize_input(x[i : i + 1]) for i in range(6)])
    assert torch.equal(proj.quantize_input(x), alone)


def _edit(path: str, out: Path, edit) -> str:
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg["quantization_config"])
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_schemes_not_run_are_refused_by_name(tmp_path) -> None:
    path = writers.write_compressed_w8a8(TINY_LM, tmp_path / "q", weights="int8", dtype=torch.float32)

    def output_acts(q):
        q["config_groups"]["group_0"]["output_activations"] = {
            "num_bits": 8,
            "type": "int",
            "strategy": "token",
        }

    def two_input_schemes(q):
        second = json.loads(json.dumps(q["config_groups"]["group_0"]))
        q["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
        second["targets"] = ["re:.*mlp.*"]
        second["input_activations"]["strategy"] = "tensor"
        q["config_groups"]["group_1"] = second

    for name, edit, message in (
        ("out", output_acts, "quantized output activations"),
        ("two", two_input_schemes, "different input_activations"),
    ):
        with pytest.raises(UnsupportedCheckpoint, match=message):
            LLM(_edit(path, tmp_path / name, edit), num_blocks=16, block_size=8)


def test_fused_parts_with_different_static_input_scales_are_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = writers.write_compressed_w8a8(TINY_LM, tmp_path / "q", weights="fp8", inputs="static",
                                        dtype=torch.float32)  # fmt: skip
    file = Path(path) / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.0.self_attn.k_proj.input_scale"] = torch.tensor([0.5])
    save_file(state, str(file))
    with pytest.raises(UnsupportedCheckpoint, match="different static input scales"):
        LLM(path, num_blocks=16, block_size=8)


def test_without_compressed_tensors_the_checkpoint_is_refused_with_the_extra_to_install(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import fails
    with pytest.raises(UnsupportedCheckpoint, match=r"pip install 'batchgen\[quant\]'"):
        InputQuant.parse({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}, "here")


@pytest.mark.parametrize("kind", ["int", "float"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_symmetric_inputs_are_compressed_tensors_arithmetic_bit_for_bit(kind, dynamic) -> None:
    """The few tensor operations batchgen runs for symmetric 8-bit inputs against compressed-tensors' own
    functions, over magnitudes from 1e-30 to 1e5, zero rows and one-signed rows."""
    from compressed_tensors.quantization import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    acts = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token" if dynamic else "tensor",
            "dynamic": dynamic}  # fmt: skip
    quant = InputQuant.parse(acts, "test")
    layer = InputQuantLinear(torch.nn.Linear(512, 8), quant, None if dynamic else torch.tensor([0.0371]))
    assert layer._fast is not None  # the tensor-operation form, not the library call
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 5, 40)[:, None]
    x[3], x[4], x[5], x[6, ::2] = 0, -x[4].abs(), x[5].abs(), 0
    args = quant.args()
    if dynamic:
        rows = x.reshape(1, -1, 512)
        want = fake_quantize(rows, *compute_dynamic_scales_and_zp(rows, args, None), args).view(x.shape)
    else:
        want = fake_quantize(x, layer.input_scale, None, args)
    assert torch.equal(layer.quantize_input(x), want)


def test_dynamic_inputs_computed_by_compressed_tensors_are_refused_over_ranks() -> None:
    """Asymmetric per-token scales come from compressed-tensors' own functions, which see one rank's slice of a
    row-parallel projection's input: such a checkpoint runs on one device (symmetric ones reduce over ranks)."""
    from batchgen.models.quant.group_linear import IntPart
    from batchgen.models.quant.input_quant import scale_tokens_over_ranks

    inner = GroupQuantLinear(64, [IntPart(torch.full((8, 64), 128), torch.ones(8, 1), bits=8, group=64)])
    acts = {"type": "int", "num_bits": 8, "dynamic": True, "strategy": "token"}
    asym = InputQuantLinear(inner, InputQuant.parse({**acts, "symmetric": False}, "down_proj"))
    with pytest.raises(
        UnsupportedCheckpoint, match="down_proj: dynamic asymmetric input quantization runs on one"
    ):
        scale_tokens_over_ranks(asym, "down_proj")
    sym = InputQuantLinear(inner, InputQuant.parse({**acts, "symmetric": True}, "down_proj"))
    scale_tokens_over_ranks(sym, "down_proj")
    assert sym.token_scales_over_ranks


@pytest.mark.parametrize("inputs", ["dynamic", "static"])
def test_w8a8_layers_take_the_integer_path(tmp_path, monkeypatch, inputs) -> None:
    """A W8A8 checkpoint's projections multiply by integer dot products, equal to the emulated float32 product
    of the same quantized values to rounding (greedy equality with transformers: tests/test_input_quant.py)."""
    from batchgen.kernels import cpu_int8_linear

    kw = dict(inputs="static", input_scale=0.05) if inputs == "static" else {}
    path = writers.write_compressed_w8a8(TINY_LM, tmp_path / "q", weights="int8", dtype=torch.float32, **kw)
    model = LLM(path, num_blocks=16, block_size=8).engine.model
    layers = [m for m in model.modules() if isinstance(m, InputQuantLinear)]
    assert layers and all(m._integer for m in layers)
    calls = []
    real = cpu_int8_linear.linear
    monkeypatch.setattr(cpu_int8_linear, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 3, layers[0].in_features, generator=torch.Generator().manual_seed(2)) * 2
    for layer in (layers[0], layers[-1]):
        xi = x if layer is layers[0] else torch.randn(5, layer.in_features)
        got = layer(xi)
        want = layer.inner(layer.quantize_input(xi))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls
