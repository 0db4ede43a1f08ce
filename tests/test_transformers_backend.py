"""The transformers backend: choosing the implementation, refusing what cannot run (before any work, with the
reason), and finding each layer's attention options even when a model encodes them only in its mask."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import model_zoo
import pytest
import torch
import transformers
from paged_reference import ReferencePagedAttention
from safetensors.torch import load_file, save_file

from batchgen import LLM
from batchgen.attention import AttentionMetadata, ForwardContext
from batchgen.models import NativeUnsupportedError, load_model
from batchgen.models.transformers_backend import (
    ATTN_IMPLEMENTATION,
    UnsupportedModelError,
    batchgen_paged_attention,
)


def _config_only(tmp_path: Path, config) -> Path:
    """A checkpoint directory with config.json only: refusals must come before any weight is needed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(tmp_path / "config.json"))
    return tmp_path


def _tiny(model_type: str, tmp_path: Path, **kwargs) -> Path:
    cfg = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        **kwargs,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    return tmp_path


# ------------------------------------------------------------------------------------------ choosing
def test_auto_prefers_native_and_falls_back_to_transformers():
    assert load_model(model_zoo.checkpoint("llama"), implementation="auto").config.implementation == "native"
    generic = load_model(model_zoo.checkpoint("olmo2"))
    assert (
        generic.config.implementation == "transformers" and generic.config.architecture == "Olmo2ForCausalLM"
    )
    forced = load_model(model_zoo.checkpoint("llama"), implementation="transformers")
    assert forced.config.implementation == "transformers"
    assert (forced.config.num_layers, forced.config.num_kv_heads, forced.config.head_dim) == (2, 2, 16)
    assert load_model(model_zoo.checkpoint("gpt2")).config.max_model_len == 256  # n_positions


def test_native_only_says_how_to_run_it():
    with pytest.raises(NativeUnsupportedError, match=r"Olmo2ForCausalLM.*model\.implementation=transformers"):
        load_model(model_zoo.checkpoint("olmo2"), implementation="native")
    with pytest.raises(ValueError, match="unknown model implementation 'vllm'"):
        load_model(model_zoo.checkpoint("llama"), implementation="vllm")


def test_llm_model_impl_option():
    llm = LLM(model_zoo.checkpoint("qwen3"), model_impl="transformers", num_blocks=8, block_size=8)
    assert llm.engine.model.config.implementation == "transformers"


def test_attention_function_outside_a_batchgen_forward():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match=f"{ATTN_IMPLEMENTATION}.*outside a batchgen forward"):
        batchgen_paged_attention(torch.nn.Module(), q, q, q, None)


# ------------------------------------------------------------------------------------------ refusals
def test_encoder_decoder_refused_from_config_alone(tmp_path):
    path = _config_only(tmp_path, transformers.T5Config(d_model=32, num_layers=1, num_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        load_model(path)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        LLM(str(path))  # before the tokenizer or anything else is touched


def test_remote_code_refused(tmp_path):
    cfg = {
        "model_type": "my_secret_lm",
        "architectures": ["MySecretForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_secret.MySecretForCausalLM"},
    }
    tmp_path.joinpath("config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="remote code"):
        load_model(tmp_path)


def test_no_causal_lm_head_refused(tmp_path):
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    bert.architectures = ["BertForMaskedLM"]
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM.*not a causal language model"):
        load_model(_config_only(tmp_path / "bert", bert))
    vit = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(UnsupportedModelError, match="no causal-LM class for model_type 'vit'"):
        load_model(_config_only(tmp_path / "vit", vit))


def test_hybrid_recurrent_layers_refused(tmp_path):
    jamba = transformers.JambaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    with pytest.raises(UnsupportedModelError, match="layers of type .*KV cache holds attention layers only"):
        load_model(_config_only(tmp_path, jamba))


def test_alibi_model_refused(tmp_path):
    path = _tiny("bloom", tmp_path, n_layer=2, n_head=4)
    with pytest.raises(UnsupportedModelError, match="does not call transformers' attention interface"):
        load_model(path)


def test_missing_weights_refused_not_randomly_initialised(tmp_path):
    ckpt = Path(shutil.copytree(model_zoo.checkpoint("olmo2"), tmp_path / "c"))
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing or misshapen tensor\(s\) model\.layers\.1\.mlp\.up_proj"):
        load_model(ckpt)


def test_pickle_only_checkpoint_refused(tmp_path):
    ckpt = Path(shutil.copytree(model_zoo.checkpoint("olmo2"), tmp_path / "c"))
    (ckpt / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are never loaded"):
        load_model(ckpt)


# ------------------------------------------------------------------------------ options found in masks
@torch.inference_mode()
def test_window_found_in_the_mask_only(tmp_path):
    """PhiMoE applies its window through transformers' mask (it passes no `sliding_window` to attention): the
    load-time probe reads it from the mask, and the packed forward matches transformers beyond the window."""
    path = _tiny("phimoe", tmp_path, num_local_experts=2, num_experts_per_tok=2, sliding_window=6)
    model = load_model(path)
    assert model.config.implementation == "transformers" and model.config.layer_windows == (6, 6)
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    c = model.config
    kv = torch.zeros(c.num_layers, 2, 8, 4, c.num_kv_heads, c.head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(20),
        num_decode_seqs=0,
        seq_lens=torch.tensor([20], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 20], dtype=torch.int32),
        block_tables=torch.arange(5, dtype=torch.int32)[None],
        max_seq_len=20,
        max_query_len=20,
    )
    logits = model.compute_logits(
        model(ids, torch.arange(20), ForwardContext(ReferencePagedAttention(), meta, kv))
    )
    torch.testing.assert_close(logits, ref(ids[None]).logits[0].float(), atol=1e-4, rtol=0)
