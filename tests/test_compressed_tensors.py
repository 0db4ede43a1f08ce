"""compressed-tensors pack-quantized checkpoints (W4A16, W8A16; group and channel scales; float32 and bfloat16
scales): greedy output equal token for token to transformers' own loading (compressed-tensors decompresses to
float32), the integer GEMM against float64 on the dequantized weights, and every other scheme or quant_method
refused by name (at load, and as exit status 2 in a job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_helpers import (
    batchgen_greedy,
    dequantized_copy,
    transformers_greedy,
    transformers_model,
    write_compressed_tensors,
)

from batchgen import LLM
from batchgen.kernels import cpu_kernel, cpu_quant_linear
from batchgen.models.quant.compressed_tensors import IntQuantLinear
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint

pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors (transformers' decompressor) not installed"
)
needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")


@pytest.fixture(scope="module")
def llama_256(ckpt_factory) -> str:
    return ckpt_factory("llama", seed=33, hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize(
    "bits, group, dtype", [(4, 128, torch.float32), (8, None, torch.float32), (4, 64, torch.bfloat16)]
)
def test_pack_quantized_greedy_equals_transformers(llama_256, tmp_path, bits, group, dtype) -> None:
    path = write_compressed_tensors(llama_256, tmp_path / "ct", bits=bits, group_size=group, dtype=dtype)
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    quantized = [m for m in llm.engine.model.modules() if isinstance(m, IntQuantLinear)]
    assert len(quantized) == 2 * 4 and all(m.weight_packed.dtype == torch.int32 for m in quantized)
    got = batchgen_greedy(llm)
    hf = transformers_model(path)
    want = transformers_greedy(hf)
    assert got == want and len({t for row in got for t in row}) > 6
    # dequantized weights are transformers' decompressed ones, bit for bit
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    ref = torch.cat([getattr(hf.model.layers[0].self_attn, f"{n}_proj").weight for n in "qkv"])
    assert torch.equal(qkv.dense_weight(), ref)
    if bits == 4:  # int4 + scales: under 30% of bfloat16's bytes
        packed = sum(p.numel() * p.element_size() for m in quantized for p in m.parameters())
        assert packed <= 0.3 * sum(m.in_features * m.out_features * 2 for m in quantized)


@needs_compiler
@pytest.mark.parametrize("bits, group, round_bf16", [(4, 32, False), (8, 96, False), (4, 256, True)])
def test_int_linear_matches_float64_on_dequantized(bits, group, round_bf16) -> None:
    from batchgen.models.quant.compressed_tensors import IntScheme

    g = torch.Generator().manual_seed(bits + group)
    layer = IntQuantLinear(768, 45, True, IntScheme(bits, group, round_bf16=round_bf16))
    layer.weight_packed.copy_(torch.randint(-(2**31), 2**31 - 1, layer.weight_packed.shape, generator=g))
    layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=g) * 0.01)
    layer.bias.copy_(torch.randn(45, generator=g))
    x = torch.randn(7, 768, generator=g)
    w = layer.dense_weight()
    got = layer(x)
    want = torch.nn.functional.linear(x.double(), w.double(), layer.bias.double())
    scale = x.abs().double() @ w.abs().double().t()
    assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-6).all()
    assert torch.equal(cpu_quant_linear.int_linear(x[3:4], layer.weight_packed, bits, layer.weight_scale, group,
                                                   layer.bias, round_bf16)[0], got[3])  # fmt: skip


REFUSED = {
    "bnb": ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
    "marlin": ({"format": "marlin-24"}, "compressed-tensors format marlin-24 is not supported"),
    "fp8-format-int-weights": ({"format": "float-quantized"}, "format float-quantized with int weights"),
    "w4a4": (
        {"input_activations": {"num_bits": 4, "type": "int", "strategy": "token", "dynamic": True}},
        "int inputs of 4 bits",
    ),
    "static per-token inputs": (
        {"input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": False}},
        "static input strategy 'token'",
    ),
    "actorder": ({"actorder": "columns"}, "actorder='columns'"),
    "2:4 sparse": ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity format sparse-24-bitmask"),
    "int and fp8 groups": ({"config_groups": "fp8 beside int"}, "mixing fp8 and int weights"),
    "nvfp4": ({"format": "nvfp4-pack-quantized"}, "format nvfp4-pack-quantized is not supported"),
}


def _variant(path: str, out: Path, change: dict) -> str:
    import shutil

    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    group = q["config_groups"]["group_0"]
    if "quant_method" in change:
        cfg["quantization_config"] = change
    elif "sparsity_config" in change:
        q.update(change)
    elif "config_groups" in change:  # a second group of fp8 weights
        fp8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
        q["config_groups"]["group_1"] = {
            "targets": ["re:.*mlp.*"],
            "weights": fp8,
            "format": "float-quantized",
        }
    elif "format" in change:
        q["format"] = group["format"] = change["format"]
    elif "input_activations" in change:
        group["input_activations"] = change["input_activations"]
    else:
        group["weights"].update(change)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_schemes_not_run_are_refused_by_name(llama_256, tmp_path, case) -> None:
    path = write_compressed_tensors(llama_256, tmp_path / "ct")
    change, message = REFUSED[case]
    with pytest.raises(UnsupportedCheckpoint, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(_variant(path, tmp_path / case, change), num_blocks=64, block_size=8)


def test_job_refuses_a_scheme_with_exit_2(llama_256, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config

    from batchgen.job.run import EXIT_CONFIG, run_job

    path = _variant(write_compressed_tensors(llama_256, tmp_path / "ct"), tmp_path / "bnb", REFUSED["bnb"][0])
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hello"]}), inp)
    res = run_job(job_config(path, inp, tmp_path / "out"), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_CONFIG and "\n" not in res.message
    assert "quant_method='bitsandbytes' is not supported" in res.message


def test_tensor_parallel_refused_for_scattered_activation_order(llama_256, tmp_path) -> None:
    path = write_compressed_tensors(llama_256, tmp_path / "ct", group_size=32, actorder="group")
    with pytest.raises(UnsupportedCheckpoint, match="actorder group checkpoints run on one device"):
        LLM(path, tensor_parallel_size=2, device="cpu", num_blocks=64, block_size=8)


@pytest.mark.parametrize("bits, group", [(4, 64), (8, None)])
def test_asymmetric_pack_quantized_greedy_equals_the_dequantized_model(
    llama_256, tmp_path, bits, group
) -> None:
    """Zero points (weight_zero_point, packed along the outputs) folded into the stored values at load. The
    reference is compressed-tensors' own unpacking, dequantized in float64, run by transformers in float32:
    transformers 5 cannot load packed zero points itself (it expects them unpacked and re-initialises them)."""
    import shutil

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file, save_file

    from batchgen.models.quant.group_linear import GroupQuantLinear

    path = write_compressed_tensors(llama_256, tmp_path / "ct", bits=bits, group_size=group, symmetric=False)
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    quantized = [m for m in llm.engine.model.modules() if isinstance(m, GroupQuantLinear)]
    assert len(quantized) == 2 * 4
    got = batchgen_greedy(llm)
    state, dense = load_file(str(Path(path) / "model.safetensors")), {}
    for name, t in state.items():
        if name.endswith(".weight_packed"):
            m = name.removesuffix(".weight_packed")
            shape = tuple(state[f"{m}.weight_shape"].tolist())
            scale = state[f"{m}.weight_scale"].double()
            q = unpack_from_int32(t, bits, torch.Size(shape)).double()
            zp = unpack_from_int32(state[f"{m}.weight_zero_point"], bits, scale.shape, packed_dim=0).double()
            g = shape[1] // scale.shape[1]
            dense[f"{m}.weight"] = ((q - zp.repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)).float()
        elif not name.endswith((".weight_scale", ".weight_zero_point", ".weight_shape")):
            dense[name] = t.float()
    shutil.copytree(path, tmp_path / "dense")
    save_file(dense, str(tmp_path / "dense" / "model.safetensors"))
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["dtype"] = "float32"
    (tmp_path / "dense" / "config.json").write_text(json.dumps(cfg))
    down = "model.layers.1.mlp.down_proj.weight"
    ours = llm.engine.model.model.layers[
        1
    ].mlp.down_proj.dense_weight()  # zero points' share added in float32
    assert (ours - dense[down]).abs().max() <= 1e-6 * dense[down].abs().max()
    want = transformers_greedy(tmp_path / "dense")
    assert got == want and len({t for row in got for t in row}) > 6


@pytest.mark.parametrize(
    "arch, kwargs",
    [
        (
            "qwen2",
            {"ignore": ("lm_head", "re:.*mlp.down_proj")},
        ),  # ignore by pattern: those layers stay float
        ("qwen3", {"mlp": (8, None, True)}),  # two config groups: int4 attention, int8 per-channel MLP
    ],
)
def test_layers_quantized_are_read_from_the_tensors(tmp_path, arch, kwargs) -> None:
    """Which projections are quantized (and in which scheme) follows the checkpoint's tensors, not a reading of
    ``ignore`` patterns or ``targets``: greedy output equals transformers'."""
    from model_zoo import checkpoint

    from batchgen.models.quant.group_linear import GroupQuantLinear

    path = write_compressed_tensors(
        checkpoint(arch, seed=3), tmp_path / "ct", bits=4, group_size=32, **kwargs
    )
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    model = llm.engine.model
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, (IntQuantLinear, GroupQuantLinear)) == ("ignore" not in kwargs)
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(path) and len({t for row in got for t in row}) > 6


def test_tied_head_without_quantized_tensors_stays_the_embedding(tmp_path) -> None:
    """A tied lm_head not in ``ignore`` has no packed tensors of its own: it stays the embedding table."""
    from model_zoo import checkpoint

    base = checkpoint("llama", seed=3, tie_word_embeddings=True)
    listed = write_compressed_tensors(base, tmp_path / "ignored", bits=4, group_size=32)
    unlisted = write_compressed_tensors(base, tmp_path / "ct", bits=4, group_size=32, ignore=())
    llm = LLM(unlisted, num_blocks=64, block_size=8, max_num_seqs=4)
    assert not isinstance(llm.engine.model.lm_head, IntQuantLinear)
    assert batchgen_greedy(llm) == transformers_greedy(listed)  # the same tensors, lm_head listed in ignore


def test_fused_parts_mixing_quantized_and_float_are_refused_by_name(tmp_path) -> None:
    from model_zoo import checkpoint

    ignore = (
        "lm_head",
        "re:.*k_proj",
    )  # q and v packed, k float: one fused q/k/v projection cannot hold both
    path = write_compressed_tensors(
        checkpoint("llama", seed=3), tmp_path / "ct", bits=4, group_size=32, ignore=ignore
    )
    with pytest.raises(UnsupportedCheckpoint, match="qkv_proj mix quantized and float tensors"):
        LLM(path, num_blocks=64, block_size=8)


def test_activation_order_weight_is_read_as_stored(llama_256, tmp_path) -> None:
    """llm-compressor's GPTQ default (``actorder: static``, alias ``weight``) changes only the calibration: the
    tensors are those of a checkpoint without one; greedy output equals transformers'."""
    from batchgen.models.quant.compressed_tensors import IntScheme, quantization_scheme

    path = write_compressed_tensors(llama_256, tmp_path / "static", bits=4, group_size=64, actorder="static")
    assert quantization_scheme(path) == IntScheme(4, 64)
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    assert isinstance(llm.engine.model.model.layers[0].self_attn.qkv_proj, IntQuantLinear)
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(transformers_model(path)) and len({t for row in got for t in row}) > 6
    weight = _variant(path, tmp_path / "weight", {"actorder": "weight"})
    assert quantization_scheme(weight) == IntScheme(4, 64)


def _dequantized_with_g_idx(path: str, out: Path, bits: int) -> str:
    """A float32 copy of a symmetric pack-quantized checkpoint with ``weight_g_idx``, each weight
    ``(q - 2^(bits-1)) * scale[row, g_idx[input]]`` computed in float64 from the specification."""
    import numpy as np

    def weight(state: dict, prefix: str) -> torch.Tensor:
        words = state[f"{prefix}.weight_packed"].numpy().view(np.uint32).astype(np.int64)
        q = np.stack([(words >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)], -1)
        q = q.reshape(words.shape[0], -1) - (1 << (bits - 1))
        g_idx = state[f"{prefix}.weight_g_idx"].numpy().astype(np.int64)
        return torch.from_numpy(q * state[f"{prefix}.weight_scale"].double().numpy()[:, g_idx])

    return dequantized_copy(
        path, out, "weight_packed", weight, (".weight_scale", ".weight_shape", ".weight_g_idx")
    )


def test_activation_order_group_is_repacked_with_its_g_idx(llama_256, tmp_path) -> None:
    """Older checkpoints with ``actorder: group`` scatter each group over the inputs (``weight_g_idx``; the
    compressed-tensors installed here no longer loads them): repacked with the inputs in group order, the
    dequantized weights equal the specification's, greedy output transformers' on those weights."""
    from batchgen.models.quant.group_linear import GroupQuantLinear

    path = write_compressed_tensors(llama_256, tmp_path / "g", bits=4, group_size=32, actorder="group")
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    dense = _dequantized_with_g_idx(path, tmp_path / "dense", bits=4)
    model = llm.engine.model
    quantized = [m for m in model.modules() if isinstance(m, GroupQuantLinear)]
    assert len(quantized) == 4 * model.config.num_layers and all(m.perm0 is not None for m in quantized)
    from safetensors.torch import load_file

    ref = load_file(str(Path(dense) / "model.safetensors"))
    down = model.model.layers[1].mlp.down_proj
    assert torch.equal(down.dense_weight(), ref["model.layers.1.mlp.down_proj.weight"])
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(dense) and len({t for row in got for t in row}) > 6


MOE_CKPT = dict(seed=5, hidden_size=256, intermediate_size=128, head_dim=64)
ROUTERS = ("lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$")


@pytest.mark.parametrize(
    "arch, overrides, bits, group",
    [
        # llm-compressor's W4A16 of a Qwen-MoE (routers and the shared expert's gate ignored, the shared expert
        # quantized): each expert's gate_proj / up_proj / down_proj.weight_packed
        ("qwen2_moe", dict(moe_intermediate_size=128, shared_expert_intermediate_size=128), 4, 128),
        ("mixtral", {}, 8, None),  # W8A16 per channel, Mixtral's block_sparse_moe.experts.N.w1 / w3 / w2
    ],
)
def test_quantized_moe_experts_equal_transformers(tmp_path, arch, overrides, bits, group) -> None:
    """A compressed-tensors checkpoint whose MoE experts are quantized (one projection per expert in the file)
    runs with them packed (PackedExperts of IntQuantLinear), greedy output equal to transformers' loading; it
    failed on an unexpected tensor ``experts.0.down_proj.weight_packed``."""
    import model_zoo

    from batchgen.models.moe import PackedExperts

    base = model_zoo.checkpoint(arch, **MOE_CKPT, **overrides)
    path = write_compressed_tensors(base, tmp_path / "q", bits=bits, group_size=group, ignore=ROUTERS)
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert isinstance(experts, PackedExperts) and isinstance(experts.down[0], IntQuantLinear)
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(path) and len({t for row in got for t in row}) > 6


def test_fp8_moe_experts_equal_the_dequantized_model(tmp_path) -> None:
    """fp8 experts (``float-quantized``, every projection of the layers, the router included) run packed, greedy
    output equal to transformers' float32 run of the checkpoint dequantized as compressed-tensors specifies
    (``fp8 * weight_scale``); they were refused (quantized MoE experts not supported)."""
    import model_zoo
    from safetensors.torch import load_file, save_file

    from batchgen.models.moe import PackedExperts
    from batchgen.models.quant.writers import write_compressed_fp8

    path = write_compressed_fp8(model_zoo.checkpoint("qwen3_moe", **MOE_CKPT, moe_intermediate_size=128),
                                tmp_path / "fp8", dtype=torch.float32)  # fmt: skip
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    assert isinstance(llm.engine.model.model.layers[0].mlp.experts, PackedExperts)
    dense = Path(
        dequantized_copy(path, tmp_path / "dense", "weight_scale", lambda st, p: st[f"{p}.weight"], ())
    )
    state = load_file(f"{path}/model.safetensors")
    save_file({k: (t.float() * state[f"{k}_scale"].float() if f"{k}_scale" in state else t.float())
               for k, t in state.items() if not k.endswith("_scale")}, str(dense / "model.safetensors"))  # fmt: skip
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(str(dense)) and len({t for row in got for t in row}) > 6


def test_the_package_w4a16_writer_writes_what_compressed_tensors_packs(llama_256, tmp_path) -> None:
    """`writers.write_compressed_w4a16` (the benchmarks' W4A16 file, no compressed-tensors needed) holds the
    tensors the test writer packs with compressed-tensors' own ``pack_to_int32``, and its config's scheme."""
    from safetensors.torch import load_file

    from batchgen.models.quant.writers import write_compressed_w4a16

    ours = write_compressed_w4a16(llama_256, tmp_path / "ours", dtype=torch.bfloat16)
    theirs = write_compressed_tensors(
        llama_256, tmp_path / "theirs", bits=4, group_size=128, dtype=torch.bfloat16
    )
    a, b = load_file(f"{ours}/model.safetensors"), load_file(f"{theirs}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    scheme = [json.loads(Path(p, "config.json").read_text())["quantization_config"] for p in (ours, theirs)]
    weights = [q["config_groups"]["group_0"]["weights"] for q in scheme]
    assert {**weights[0], "block_structure": None} == {**weights[1], "block_structure": None}
    assert scheme[0]["format"] == scheme[1]["format"] == "pack-quantized"
