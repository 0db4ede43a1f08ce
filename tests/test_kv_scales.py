"""fp8 KV-cache scales (vLLM's k_scale / v_scale, compressed-tensors' kv_cache_scheme): the cache holds
``k / k_scale`` rounded to fp8, attention equals the float64 reference over ``k_scale * cached`` (per-tensor and
per-head scales, prefill, decode and mixed steps), a checkpoint's scales reach the layers, and caches other than
fp8 ignore them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.attention import AttentionMetadata, AttentionOptions, KVScales, PagedAttention
from batchgen.kernels import kv_cache_dtype as kvd

HQ, HKV, D, BS = 4, 2, 16, 4


def _reference(q, k_cache, v_cache, scales, seqs) -> torch.Tensor:
    """float64 attention of each new token over its sequence's cached tokens, read as ``scale * cached``."""
    kf = k_cache.double().reshape(-1, HKV, D) * scales.k.double()[:, None]
    vf = v_cache.double().reshape(-1, HKV, D) * scales.v.double()[:, None]
    out, row = [], 0
    for table, start, n in seqs:
        slots = [table[p // BS] * BS + p % BS for p in range(start + n)]
        keys, values = kf[slots], vf[slots]
        for i in range(n):
            visible = start + i + 1
            for h in range(HQ):
                kh = h // (HQ // HKV)
                logits = keys[:visible, kh] @ q[row + i, h].double() / math.sqrt(D)
                out.append(torch.softmax(logits, 0) @ values[:visible, kh])
        row += n
    return torch.stack(out).reshape(-1, HQ, D)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_attention_over_a_scaled_fp8_cache_matches_float64(per_head, dtype) -> None:
    g = torch.Generator().manual_seed(7)
    k_scale = torch.tensor([3.0, 0.01]) if per_head else torch.tensor(2.0)
    v_scale = torch.tensor([0.5, 40.0]) if per_head else torch.tensor(0.25)
    scales = KVScales.of(k_scale, v_scale, HKV)
    big = torch.tensor([400.0, 1.0])[:, None] if per_head else 1.0  # head 0's keys overflow an unscaled e4m3
    attn, options = PagedAttention("torch"), AttentionOptions(1 / math.sqrt(D))
    k_cache = torch.zeros(8, BS, HKV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = {0: [0, 1, 2], 1: [3, 4], 2: [5, 6]}
    lengths = {0: 0, 1: 0, 2: 0}
    steps = [[(0, 5), (1, 3)], [(0, 1), (1, 1)], [(1, 1), (2, 6)]]  # prefill, decode, decode + prefill
    for step in steps:
        seqs = [(tables[s], lengths[s], n) for s, n in step]
        meta = AttentionMetadata.for_sequences(seqs, sum(1 for _, n in step if n == 1), BS)
        t = sum(n for _, n in step)
        q = torch.randn(t, HQ, D, generator=g)
        k = torch.randn(t, HKV, D, generator=g) * big
        v = torch.randn(t, HKV, D, generator=g) * 20
        out = attn.forward(q, k, v, k_cache, v_cache, meta, options, scales)
        stored = kvd.narrow(k / scales.k[:, None], dtype)
        assert torch.equal(
            k_cache.view(-1, HKV, D)[meta.slot_mapping].view(torch.uint8), stored.view(torch.uint8)
        )
        torch.testing.assert_close(
            out.double(), _reference(q, k_cache, v_cache, scales, seqs), atol=3e-5, rtol=3e-5
        )
        for s, n in step:
            lengths[s] += n


def test_scales_must_be_one_or_one_per_head() -> None:
    with pytest.raises(ValueError, match="k_scale must be one positive scale or one per KV head"):
        KVScales.of(torch.ones(3), torch.ones(1), 2)
    with pytest.raises(ValueError, match="v_scale must be one positive scale"):
        KVScales.of(torch.ones(2), torch.zeros(1), 2)


def _with_scales(ckpt: str, out: Path, names: tuple[str, str], per_head: bool, scheme: bool) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    heads = cfg["num_key_value_heads"]
    for i in range(cfg["num_hidden_layers"]):
        for j, name in enumerate(names):
            value = torch.full((heads, 1, 1) if per_head else (1,), 0.05 * (i + 1) * (j + 1))
            state[f"model.layers.{i}.self_attn.{name}"] = value
    save_file(state, str(out / "model.safetensors"))
    if scheme:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
            "config_groups": {}, "ignore": [],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                "strategy": "attn_head" if per_head else "tensor", "dynamic": False},
        }  # fmt: skip
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.parametrize(
    "names, per_head, scheme",
    [(("k_scale", "v_scale"), True, True), (("k_proj.output_scale", "v_proj.output_scale"), False, False)],
)
def test_checkpoint_scales_reach_the_layers(llama_ckpt, tmp_path, names, per_head, scheme) -> None:
    path = _with_scales(llama_ckpt, tmp_path / "s", names, per_head, scheme)
    prompts = [[1, 17, 33, 90, 5, 6, 7, 8, 9], [1, 64]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(p, kv):
        llm = LLM(p, num_blocks=64, block_size=8, kv_cache_dtype=kv)
        return llm, [
            o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": x} for x in prompts], params)
        ]

    llm, scaled = run(path, "fp8")
    layers = llm.engine.model.model.layers
    assert torch.equal(layers[1].self_attn.kv_scales.v, torch.full((layers[1].self_attn.num_kv_heads,), 0.2))
    assert torch.equal(layers[0].self_attn.kv_scales.k, torch.full((layers[0].self_attn.num_kv_heads,), 0.05))
    assert len(scaled) == 2 and all(len(t) == 8 for t in scaled)
    assert run(path, "auto")[1] == run(llama_ckpt, "auto")[1]  # a float32 cache ignores the scales
