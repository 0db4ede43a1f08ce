"""GPTQ and AWQ checkpoints, written from the formats' specifications (`batchgen.models.quant.writers`): the
loaded weights equal an independent float64 dequantization of the checkpoint's tensors bit for bit, and greedy
output equals transformers' float32 run of those dequantized weights token for token (transformers' own GPTQ /
AWQ loading needs optimum + gptqmodel, which have no CPU wheel). Schemes not run are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_helpers import batchgen_greedy, dequantized_copy, transformers_greedy

from batchgen import LLM
from batchgen.models.quant import writers
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.group_linear import GroupQuantLinear

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@pytest.fixture(scope="module")
def llama_256(ckpt_factory) -> str:
    return ckpt_factory("llama", seed=33, hidden_size=256, intermediate_size=512)


def _values(words: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned values of uint32 words along `axis`, value j of a word at position order[j] of its run."""
    per = 32 // bits
    order = order or tuple(range(per))
    w = np.moveaxis(words.astype(np.uint64), axis, -1)
    out = np.zeros((*w.shape[:-1], w.shape[-1] * per), dtype=np.float64)
    for j in range(per):
        out[..., order[j] :: per] = (w >> (bits * j)) & ((1 << bits) - 1)
    return np.moveaxis(out, -1, axis)


def _reference(state: dict, prefix: str, method: str, bits: int, v1: bool) -> torch.Tensor:
    """float64 ``[N, K]`` weight of one quantized projection, from the specification."""
    qweight = state[f"{prefix}.qweight"].numpy().view(np.uint32)
    qzeros = state[f"{prefix}.qzeros"].numpy().view(np.uint32)
    scales = state[f"{prefix}.scales"].double().numpy()
    if method == "awq":
        q, z = _values(qweight, 4, 1, ORDER), _values(qzeros, 4, 1, ORDER)  # [K, N], [G, N]
        g_idx = np.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
    else:
        if v1:
            qzeros = (qzeros.astype(np.uint64) + sum(1 << s for s in range(0, 32, bits))) & 0xFFFFFFFF
        q, z = _values(qweight, bits, 0), _values(qzeros, bits, 1)
        g_idx = state[f"{prefix}.g_idx"].numpy().astype(np.int64)
    return torch.from_numpy(((q - z[g_idx]) * scales[g_idx]).T.copy())


def _dequantized_checkpoint(path: str, out: Path, method: str, bits: int, v1: bool) -> str:
    return dequantized_copy(path, out, "qweight", lambda state, prefix: _reference(state, prefix, method, bits, v1),
                            (".qzeros", ".scales", ".g_idx"))  # fmt: skip


CASES = {  # name: (writer kwargs, bits stored in memory)
    "gptq4-sym-g32": ({"bits": 4, "group_size": 32}, 4),
    "gptq4-asym-actorder-g32": ({"bits": 4, "group_size": 32, "desc_act": True, "sym": False}, 4),
    "gptq4-sym-actorder-g64-v2": ({"bits": 4, "group_size": 64, "desc_act": True, "checkpoint_format": "gptq_v2"}, 4),
    "gptq8-sym-channel": ({"bits": 8, "group_size": -1}, 8),
    "gptq8-asym-g64": ({"bits": 8, "group_size": 64, "sym": False}, 8),
    "awq4-g32": ({}, 4),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_transformers_on_the_dequantized_weights(llama_256, tmp_path, case) -> None:
    from safetensors.torch import load_file

    kwargs, stored_bits = CASES[case]
    method = case[:4].rstrip("48")
    if method == "awq":
        path = writers.write_awq(llama_256, tmp_path / "q", group_size=32)
    else:
        path = writers.write_gptq(llama_256, tmp_path / "q", seed=len(case), **kwargs)
    bits, v1 = kwargs.get("bits", 4), kwargs.get("checkpoint_format", "gptq") == "gptq"
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    model = llm.engine.model
    quantized = [m for m in model.modules() if isinstance(m, GroupQuantLinear)]
    assert len(quantized) == 4 * model.config.num_layers and {b for m in quantized for b in m.bits} == {
        stored_bits
    }
    state = load_file(str(Path(path) / "model.safetensors"))
    layer = model.model.layers[1]
    for ours, parts in ((layer.self_attn.qkv_proj, "qkv"), (layer.mlp.down_proj, None)):
        names = (
            [f"model.layers.1.self_attn.{p}_proj" for p in parts]
            if parts
            else ["model.layers.1.mlp.down_proj"]
        )
        want = torch.cat([_reference(state, n, method, bits, v1) for n in names])
        if kwargs.get("sym", True) and method == "gptq":
            assert torch.equal(ours.dense_weight().double(), want)  # exact in float32
        else:  # zero points: their share is added in float32
            assert (ours.dense_weight().double() - want).abs().max() <= 1e-6 * want.abs().max()
    if kwargs.get("desc_act"):
        assert all(m.perm0 is not None for m in quantized)
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(_dequantized_checkpoint(path, tmp_path / "dense", method, bits, v1))
    assert len({t for row in got for t in row}) > 6


def test_parts_with_their_own_activation_order(tmp_path) -> None:
    """q/k/v with different g_idx permutations (each part gathers its own input order) and a bias."""
    from batchgen.models.quant.gptq_awq import to_part

    g = torch.Generator().manual_seed(5)
    k, parts, dense = 64, [], []
    for n in (16, 8, 8):
        q, z = torch.randint(0, 16, (k, n), generator=g), torch.randint(0, 16, (4, n), generator=g)
        s = (torch.rand(4, n, generator=g) * 0.05).half()
        g_idx = torch.randperm(k, generator=g) // 16
        parts.append(to_part("p", q, z, s, 4, k, g_idx))
        dense.append(((q - z[g_idx]).double() * s.double()[g_idx]).t())
    bias = torch.randn(32, generator=g)
    layer = GroupQuantLinear(k, parts, bias)
    want = torch.cat(dense)
    assert (
        len(layer.packed) == 3
        and (layer.dense_weight().double() - want).abs().max() <= 1e-6 * want.abs().max()
    )
    x = torch.randn(5, k, generator=g)
    want = x.double() @ torch.cat(dense).t() + bias.double()
    assert torch.allclose(layer(x).double(), want, atol=1e-5)


REFUSED = {
    "gptq 3-bit": ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "GPTQ bits=3 not supported"),
    "gptq marlin": (
        {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
        "GPTQ checkpoint_format='marlin' not supported",
    ),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_schemes_not_run_are_refused_by_name(llama_256, tmp_path, case) -> None:
    path = writers.write_gptq(llama_256, tmp_path / "q")
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["quantization_config"], message = REFUSED[case]
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpoint, match=message):
        LLM(path, num_blocks=64, block_size=8)


def test_job_runs_an_awq_checkpoint_and_refuses_a_scheme_with_exit_2(llama_256, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config, read_parts

    from batchgen.job.run import EXIT_CONFIG, EXIT_OK, run_job

    path = writers.write_awq(llama_256, tmp_path / "awq")
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hello", "the quick brown fox", "a"]}), inp)
    res = run_job(job_config(path, inp, tmp_path / "out"), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK
    assert read_parts(tmp_path / "out").column("status").to_pylist() == ["ok"] * 3
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    res = run_job(job_config(path, inp, tmp_path / "out2"), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_CONFIG and "\n" not in res.message and "version='gemv'" in res.message


def test_the_transformers_implementation_is_refused_for_a_quantized_checkpoint(llama_256, tmp_path) -> None:
    from batchgen.models.loader import load_model

    path = writers.write_gptq(llama_256, tmp_path / "q")
    with pytest.raises(UnsupportedCheckpoint, match="runs on batchgen's native code"):
        load_model(path, implementation="transformers")


def test_qwen2_with_projection_biases(ckpt_factory, tmp_path) -> None:
    """q/k/v biases (float16 beside the packed weights) reach the fused projection."""
    base = ckpt_factory("qwen2", seed=3, hidden_size=256, intermediate_size=512)
    path = writers.write_gptq(base, tmp_path / "q", bits=4, group_size=64, desc_act=True)
    llm = LLM(path, num_blocks=64, block_size=8)
    assert llm.engine.model.model.layers[0].self_attn.qkv_proj.bias is not None
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(_dequantized_checkpoint(path, tmp_path / "dense", "gptq", 4, True))


@pytest.mark.parametrize("desc_act", [False, True])
def test_groups_that_do_not_divide_the_inputs(tmp_path, desc_act) -> None:
    """GPTQ stores ceil(K / group_size) groups, the last one short (down_proj: 96 inputs in groups of 64 and
    32; without a g_idx, the config's group size): greedy output equals transformers' run of the dequantized
    weights."""
    from model_zoo import checkpoint
    from safetensors.torch import load_file, save_file

    base = checkpoint("llama", seed=8, intermediate_size=96)
    path = writers.write_gptq(base, tmp_path / "q", bits=4, group_size=64, desc_act=desc_act, sym=desc_act)
    dense = _dequantized_checkpoint(path, tmp_path / "dense", "gptq", 4, True)
    if not desc_act:  # a checkpoint without g_idx: the groups follow the config's group_size
        state = load_file(str(Path(path) / "model.safetensors"))
        save_file(
            {k: v for k, v in state.items() if not k.endswith(".g_idx")},
            str(Path(path) / "model.safetensors"),
        )
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    down = llm.engine.model.model.layers[0].mlp.down_proj
    assert isinstance(down, GroupQuantLinear) and down.groups == [32]
    got = batchgen_greedy(llm)
    assert got == transformers_greedy(dense) and len({t for row in got for t in row}) > 6


def test_python_m_batchgen_refuses_a_scheme_with_exit_2_in_one_line(llama_256, tmp_path) -> None:
    """``python -m batchgen`` is the ``batchgen`` command: a GPTQ checkpoint of 3 bits is one line, exit 2."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import env_without_slurm

    path = writers.write_gptq(llama_256, tmp_path / "q")
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    pq.write_table(pa.table({"prompt": ["hello"]}), tmp_path / "in.parquet")
    args = [f"model.path={path}", f"data.input={tmp_path / 'in.parquet'}", f"data.output={tmp_path / 'out'}"]
    res = subprocess.run([sys.executable, "-m", "batchgen", *args], cwd=tmp_path, env=env_without_slurm(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "GPTQ bits=3 not supported" in lines[0], lines
