"""Write a tiny Hugging Face llama checkpoint (`batchgen.models.tiny.build_checkpoint`) as a GGUF file with the
`gguf` package's writer, as llama.cpp's converter lays it out (q/k rows permuted, a byte-level BPE tokenizer in
the metadata): the test and benchmark fixtures of the GGUF loader. Needs the gguf extra.

Projections are quantized with gguf-py's quantizer where it has one (Q4_0, Q8_0); for Q4_K and Q6_K (gguf-py only
dequantizes them) the blocks are random valid ones (finite scales, weights centred), so a file's weights are
whatever its blocks say, which is all a loader may assume.
"""

from __future__ import annotations

import numpy as np
import torch

from batchgen.kernels.cpu_quant_linear import FORMATS

SCALE_OFFSETS = {2: (0,), 8: (0,), 12: (0, 2), 14: (208,)}
"""Byte offsets of each block's fp16 scale fields, by ggml type id (the rest of a block is any bits)."""


def random_blocks(
    rows: int, in_features: int, type_id: int, seed: int = 0, scale: float = 0.02
) -> torch.Tensor:
    """``[rows, row_bytes]`` uint8: random quantized values with finite random fp16 scales."""
    fmt = FORMATS[type_id]
    rng = np.random.default_rng(seed)
    nblocks = in_features // fmt.block_values
    data = rng.integers(0, 256, size=(rows, nblocks, fmt.block_bytes), dtype=np.uint8)
    d = (rng.random((rows, nblocks)) * scale + scale / 10).astype(np.float32)
    for i, off in enumerate(SCALE_OFFSETS[type_id]):
        # Q4_K's second scale (dmin) centres its weights: (d sc) q - (dmin m) with q ~ 7.5 on average
        field = (d * 7.5 if i else d).astype(np.float16)
        data[:, :, off : off + 2] = field.view(np.uint8).reshape(rows, nblocks, 2)
    return torch.from_numpy(data.reshape(rows, nblocks * fmt.block_bytes))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k projections (transformers reverses it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt: str, out_path, types: dict[str, int] | int = 8, seed: int = 0) -> str:
    """Write the llama checkpoint `ckpt` (a tiny one: batchgen.models.tiny.build_checkpoint) as a GGUF file with
    its tokenizer (byte-level BPE: vocabulary and merges): every 2-D projection quantized to `types` (one ggml
    type id, or one per GGUF tensor-name suffix such as ``attn_v``, default Q8_0), embeddings and norms float32.
    The quantized blocks come from gguf-py's quantizer where it has one (Q4_0, Q8_0) and are random valid blocks
    otherwise (Q4_K, Q6_K: gguf-py only dequantizes them), so the file's weights are what its blocks say."""
    import json
    from pathlib import Path

    import gguf
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    state = load_file(str(ckpt / "model.safetensors"))
    n_layers, n_head, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out_path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(
        float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4)))
    )
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    w.add_vocab_size(cfg["vocab_size"])
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    added = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    tokens += [None] * (cfg["vocab_size"] - len(tokens))
    for i, t in added.items():
        tokens[i] = t
    tokens = [t if t is not None else f"<unused{i}>" for i, t in enumerate(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    merges = tok["model"].get("merges", [])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for key, setter in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if isinstance(cfg.get(key), int):
            setter(cfg[key])
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    rng = 0
    for name, tensor in state.items():
        arr = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        short = gname.split(".")[-2]
        if short == "attn_q":
            arr = _llama_cpp_permute(arr, n_head)
        elif short == "attn_k":
            arr = _llama_cpp_permute(arr, n_kv)
        if arr.ndim == 2 and gname not in ("token_embd.weight", "output.weight"):
            type_id = types if isinstance(types, int) else types.get(short, 8)
            qtype = gguf.GGMLQuantizationType(type_id)
            if qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0):
                data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
            else:
                rng += 1
                data = random_blocks(arr.shape[0], arr.shape[1], type_id, seed=seed + rng, scale=0.01).numpy()
            w.add_tensor(gname, data, raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out_path)
