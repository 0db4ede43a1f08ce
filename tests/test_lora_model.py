"""LoRA in the native model: PEFT adapter reading and validation, one packed forward mixing two adapters and
the base model against PEFT's logits, and tensor-parallel shards summing to the whole layer."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from lora_helpers import make_adapter, peft_logits, two_adapters

from batchgen.attention import AttentionMetadata, ForwardContext, PagedAttention
from batchgen.kernels.lora import LoRAPlan, LoRAWeights, add_lora_torch
from batchgen.models import load_model
from batchgen.models.lora import attach_lora
from batchgen.models.lora_adapter import LoRAAdapterError, load_adapter, shard_part
from batchgen.models.parallel import shard_config


@pytest.fixture(scope="module")
def adapters(llama_ckpt):
    return two_adapters(llama_ckpt)


@pytest.fixture(scope="module")
def cfg(llama_ckpt):
    return load_model(llama_ckpt, dtype="float32").config


def packed_forward(model, prompts: list[list[int]], token_slots: list[int] | None) -> list[torch.Tensor]:
    """One prefill forward of all prompts packed together; logits per prompt."""
    mc, bs = model.config, 8
    tables, start = [], 0
    for p in prompts:
        nb = -(-len(p) // bs)
        tables.append((list(range(start, start + nb)), 0, len(p)))
        start += nb
    kv = torch.zeros(mc.num_layers, 2, start, bs, mc.num_kv_heads, mc.head_dim)
    meta = AttentionMetadata.for_sequences(tables, 0, bs)
    plan = None if token_slots is None else LoRAPlan.build(np.array(token_slots), torch.device("cpu"))
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    with torch.inference_mode():
        hidden = model(ids, pos, ForwardContext(PagedAttention("torch"), meta, kv, lora=plan))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


def test_mixed_batch_matches_peft_logits(llama_ckpt, adapters):
    a, b = adapters
    model = load_model(llama_ckpt, dtype="float32")
    slots = attach_lora(model, max_loras=3, max_rank=16)
    cfg = model.config
    slots.load(2, load_adapter("a", a, cfg, 16))
    slots.load(0, load_adapter("b", b, cfg, 16))
    prompts = [[5, 9, 33, 7, 100, 3], [5, 9, 33, 7, 100, 3, 41], [17, 2, 250, 11, 12], [5, 9, 33]]
    which = [a, None, b, b]
    slot_of = {a: 2, None: -1, b: 0}
    token_slots = [slot_of[w] for p, w in zip(prompts, which) for _ in p]
    ours = packed_forward(model, prompts, token_slots)
    for p, w, got in zip(prompts, which, ours):
        ref = peft_logits(llama_ckpt, w, p)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the adapters change the model (else the comparison proves nothing)
    base = peft_logits(llama_ckpt, None, prompts[0])
    assert (peft_logits(llama_ckpt, a, prompts[0]) - base).abs().max() > 1e-2
    # no plan = the base model, bit for bit the same as without LoRA layers
    plain = load_model(llama_ckpt, dtype="float32")
    assert all(
        torch.equal(x, y)
        for x, y in zip(packed_forward(model, prompts, None), packed_forward(plain, prompts, None))
    )
    # a cleared slot adds nothing
    slots.clear(2)
    cleared = packed_forward(model, prompts[:1], [2] * len(prompts[0]))[0]
    assert torch.equal(cleared, packed_forward(plain, prompts[:1], None)[0])


def test_adapter_scaling_and_parts(adapters, cfg):
    a, b = adapters
    ad = load_adapter("a", a, cfg, 16)
    assert sorted({(k[0].split(".")[-1], k[1]) for k in ad.parts}) == [("qkv_proj", 0), ("qkv_proj", 2)]
    assert {p.scale for p in ad.parts.values()} == {8 / 4}
    bd = load_adapter("b", b, cfg, 16)
    assert len(bd.parts) == 7 * cfg.num_layers and {p.scale for p in bd.parts.values()} == {
        32 / 4.0
    }  # rsLoRA


def _edit_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_bad_adapters_are_clear_errors(llama_ckpt, adapters, cfg, tmp_path, ckpt_factory):
    a, b = adapters
    with pytest.raises(LoRAAdapterError, match=r"rank 16 > max_lora_rank=8; raise max_lora_rank"):
        load_adapter("b", b, cfg, 8)
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        load_adapter("x", tmp_path / "missing", cfg, 16)
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        load_adapter("d", _edit_config(a, tmp_path / "dora", use_dora=True), cfg, 16)
    with pytest.raises(LoRAAdapterError, match="modules_to_save"):
        load_adapter("m", _edit_config(a, tmp_path / "mts", modules_to_save=["lm_head"]), cfg, 16)
    pickle_only = tmp_path / "bin"
    shutil.copytree(a, pickle_only)
    (pickle_only / "adapter_model.safetensors").rename(pickle_only / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match="pickle"):
        load_adapter("p", pickle_only, cfg, 16)
    truncated = tmp_path / "trunc"
    shutil.copytree(a, truncated)
    f = truncated / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(LoRAAdapterError, match="cannot read adapter_model.safetensors"):
        load_adapter("t", truncated, cfg, 16)
    other = ckpt_factory("llama", hidden_size=32, intermediate_size=64, seed=7)
    other_adapter = make_adapter(other, tmp_path / "other", r=4, targets=["q_proj"], seed=3)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        load_adapter("o", other_adapter, cfg, 16)
    emb = make_adapter(llama_ckpt, tmp_path / "emb", r=4, targets=["embed_tokens"], seed=4)
    with pytest.raises(LoRAAdapterError, match="embeddings"):
        load_adapter("e", emb, cfg, 16)


@pytest.mark.parametrize(
    "layer", ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
)
def test_tensor_parallel_shards_sum_to_whole_layer(adapters, cfg, layer):
    """Column-parallel shards concatenate to the whole delta; row-parallel shards' partial deltas sum to it."""
    _, b = adapters
    ad = load_adapter("b", b, cfg, 16)
    path = f"model.layers.1.{layer}"
    parts = sorted(i for (p, i) in ad.parts if p == path)
    in_features = ad.parts[(path, 0)].a.shape[1]
    sizes = [ad.parts[(path, i)].b.shape[0] for i in parts]
    x = torch.randn(5, in_features)
    slots = [0, -1, 0, 0, -1]
    plan = LoRAPlan.build(slots, torch.device("cpu"))

    def delta(config, x_in):
        ws = [shard_part(ad.parts[(path, i)], layer, i, config) for i in parts]
        w = LoRAWeights.empty(
            1, ws[0][0].shape[1], [bb.shape[0] for _, bb in ws], 16, torch.float32, x.device
        )
        for i, (aa, bb) in enumerate(ws):
            w.set_slot(0, i, aa, bb, ad.parts[(path, i)].scale)
        return add_lora_torch(torch.zeros(5, sum(w.sizes)), x_in, plan, w), w.sizes

    whole, _ = delta(cfg, x)
    shards = [shard_config(cfg, r, 2) for r in range(2)]
    if layer in ("self_attn.o_proj", "mlp.down_proj"):
        n = in_features // 2
        total = sum(delta(c, x[:, r * n : (r + 1) * n].contiguous())[0] for r, c in enumerate(shards))
        torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)
        return
    outs = [delta(c, x) for c in shards]
    # reassemble each part from the ranks' columns: [part0 r0 | part1 r0 ...] per rank
    rebuilt = []
    for i in range(len(parts)):
        for y, sz in outs:
            off = sum(sz[:i])
            rebuilt.append((i, y[:, off : off + sz[i]]))
    got = torch.cat([t for _, t in sorted(rebuilt, key=lambda e: e[0])], dim=1)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    assert sizes == [sum(sz[i] for _, sz in outs) for i in range(len(parts))]
