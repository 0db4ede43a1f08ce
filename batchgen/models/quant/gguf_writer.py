"""Write a tiny Hugging Face llama checkpoint (`batchgen.models.tiny.build_checkpoint`) as a GGUF file with the
`gguf` package's writer, as llama.cpp's converter lays it out (q/k rows permuted, a byte-level BPE tokenizer in
the metadata): the test and benchmark fixtures of the GGUF loader. Needs the gguf extra.

Projections are quantized with gguf-py's quantizer where it has one (Q4_0, Q8_0), Q6_K by :func:`quantize_q6_k`
(absmax scales per 16 values, ggml's block layout); for Q4_K, Q2_K, Q3_K and Q5_K (gguf-py only dequantizes
them) the blocks are random valid ones (finite scales, weights centred), so a file's weights are whatever its blocks say, which is all a
loader may assume. The LM head (``output.weight``) is float32 unless ``output_type`` names its format;
:func:`llama_cpp_output_type` is llama.cpp's own choice for a file type.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from batchgen.kernels.cpu_quant_linear import FORMATS

SCALE_OFFSETS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
                 14: (208,), 20: (0,), 23: (0,)}  # fmt: skip
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


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[rows, in]`` float32 (``in`` a multiple of 256) as Q6_K blocks, ``[rows, in / 256 * 210]`` uint8: per
    16 values an int8 scale of the block's fp16 ``d`` (absmax / 32 rounded up to a multiple of it), codes
    ``round(x / (d sc)) + 32`` in 0..63 (within one step of x), laid out as ggml's block_q6_K (ql, qh, scales, d) so that ggml's dequantization reads them back."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(rows, cols // 256, 16, 16)  # [rows, blocks, sub-block, value]
    sub_scale = np.abs(x).max(-1) / 32.0
    d = (sub_scale.max(-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[..., None] > 0, np.ceil(sub_scale / d32[..., None]), 0).clip(0, 127)
        step = d32[..., None] * sc
        q = (
            np.where(step[..., None] > 0, np.round(x / step[..., None]), 0).clip(-32, 31).astype(np.int32)
            + 32
        )
    q = q.reshape(rows, cols // 256, 2, 128)  # two halves of 128 values
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate([lo[..., 0:32] | (lo[..., 64:96] << 4), lo[..., 32:64] | (lo[..., 96:128] << 4)], -1)
    qh = hi[..., 0:32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:128] << 6)
    blocks = np.concatenate(
        [
            ql.reshape(rows, cols // 256, 128).astype(np.uint8),
            qh.reshape(rows, cols // 256, 64).astype(np.uint8),
            sc.astype(np.int8).view(np.uint8).reshape(rows, cols // 256, 16),
            d.view(np.uint8).reshape(rows, cols // 256, 2),
        ],
        -1,
    )
    return blocks.reshape(rows, cols // 256 * 210)


def llama_cpp_output_type(file_type: int, in_features: int) -> int:
    """The LM head's format llama.cpp's quantizer picks for a file of `file_type` (its default, no
    ``--output-tensor-type``): Q8_0 in a Q8_0 file or when rows are not whole 256-value blocks, else Q6_K."""
    return 8 if file_type == 8 or in_features % 256 else 14


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k projections (transformers reverses it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def sentencepiece_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of `size` tokens as llama.cpp's converter writes a Llama-2 / Mistral one
    (``tokenizer.ggml.model = "llama"``): ``<unk>`` (type 2), ``<s>`` and ``</s>`` (3, control), the 256 byte
    tokens ``<0x00>`` .. ``<0xFF>`` (6), then pieces (1) with ``▁`` for a space, merged pieces first, scored
    ``-rank`` (the merge order), the single characters after them; no piece holds a newline or tab (those fall
    back to bytes). Trained (``tokenizers``' SentencePiece BPE, a fraction of a second) on CPython's reference manual;
    `size` need not be a multiple of anything."""
    from pydoc_data.topics import topics

    from tokenizers import SentencePieceBPETokenizer

    special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(list(topics.values()), vocab_size=size, min_frequency=2, show_progress=False)
    model = json.loads(trainer.to_str())["model"]
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    chars = [t for t in model["vocab"] if len(t) == 1 and t.isprintable()]
    merged = [t for t in dict.fromkeys(merged) if t.isprintable() and t not in chars]
    pieces = merged[: max(0, size - len(special) - len(chars))] + chars  # each merge's parts are in it
    if len(special) + len(pieces) < size:
        raise ValueError(f"the corpus gives {len(special) + len(pieces)} SentencePiece tokens, not {size}")
    tokens = special + pieces
    scores = [0.0] * len(special) + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
"""Mistral-Instruct's chat template: it writes the BOS itself (so a rendered chat is encoded without adding
another)."""


def write_gguf(
    ckpt: str,
    out_path,
    types: dict[str, int] | int = 8,
    seed: int = 0,
    output_type: int | None = None,
    *,
    tokenizer: str = "gpt2",
    embed_type: int = 0,
    norm_type: int = 0,
    name: str | None = None,
    release: bool = False,
) -> str:
    """Write the llama, mistral, mixtral, qwen2, qwen3, qwen2_moe, qwen3_moe, phi3, gemma2 or gemma3 checkpoint
    `ckpt` (a tiny one: batchgen.models.tiny.build_checkpoint) as a GGUF file of llama.cpp's architecture for it
    (mistral and mixtral: llama): every projection quantized to `types` (one ggml type id, F32, F16 and BF16 included, or one per GGUF tensor-name suffix such as
    ``attn_v``, default Q8_0), the LM head in `output_type` (float32 when None; no ``output.weight`` for tied
    embeddings, as llama.cpp writes them), the token embedding in `embed_type` and norms in `norm_type` (ggml
    type ids, F32 by default; llama.cpp's Q4_K_M files hold a Q4_K or Q6_K embedding, F16 files F16 norms),
    biases and an MoE router float32; each layer's experts stacked (``ffn_{gate,up,down}_exps``, quantized
    per expert row by the same rules). The quantized blocks come from gguf-py's quantizer where it has one (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0), from :func:`quantize_q6_k` for Q6_K, and are random valid blocks for the other K-quants
    (gguf-py only dequantizes them), so the file's weights are what its blocks say.

    `tokenizer`: ``"gpt2"`` writes the checkpoint's byte-level BPE (vocabulary, merges, llama.cpp's pre-tokenizer
    name for the architecture); ``"llama"`` a SentencePiece vocabulary of the model's size
    (:func:`sentencepiece_vocab`: scores and token types, no merges, bos 1, eos 2, unknown 0) as Llama-2,
    Mistral, Phi-3 and Gemma files hold one. `name`: ``general.name`` (transformers reads a llama file named
    ``mistral`` as a Mistral model). `release`: also what llama.cpp's converter and quantizer write beside the
    tensors: ``general.file_type`` and ``quantization_version``, the chat template (the checkpoint's, or
    :data:`MISTRAL_CHAT_TEMPLATE` for a SentencePiece vocabulary), ``add_bos_token`` (true for SentencePiece)
    and ``add_eos_token``, the padding id, and for a llama checkpoint with llama3 RoPE scaling the
    ``rope_freqs.weight`` tensor of Llama 3.1/3.2 files (per-frequency divisors)."""
    from pathlib import Path

    import gguf
    from safetensors.torch import load_file

    from batchgen.models.quant.gguf_checkpoint import GEMMA_NORM_ARCHS

    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    state = load_file(str(ckpt / "model.safetensors"))
    n_layers, n_head, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = {
        "gemma3_text": "gemma3",
        "mistral": "llama",
        "mixtral": "llama",
        "qwen2_moe": "qwen2moe",
        "qwen3_moe": "qwen3moe",
    }.get(cfg["model_type"], cfg["model_type"])
    w = gguf.GGUFWriter(str(out_path), arch)
    if name is not None:
        w.add_name(name)
    rope, head_dim = _write_hparams(w, cfg, arch)
    template = _write_tokenizer(w, cfg, ckpt, tokenizer, arch)
    if release:
        w.add_file_type(types if isinstance(types, int) else 15)  # 15: llama.cpp's MOSTLY_Q4_K_M
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_add_bos_token(tokenizer == "llama")
        w.add_add_eos_token(False)
        pad = cfg.get("pad_token_id")
        w.add_pad_token_id(pad if isinstance(pad, int) and tokenizer == "gpt2" else 0)
        if template:
            w.add_chat_template(template)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, n_layers)
    tensors = _stack_experts(state)
    if release and arch == "llama" and rope.get("rope_type") == "llama3":
        tensors.insert(0, ("rope_freqs.weight", _llama3_rope_freqs(rope, head_dim)))
    rng = 0
    for hf_name, tensor in tensors:
        arr = tensor.float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        gname = hf_name if hf_name == "rope_freqs.weight" else f"{name_map.get_name(base)}.{suffix}"
        short = gname.split(".")[-2]
        if arch in GEMMA_NORM_ARCHS and gname.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's converter stores Gemma's (1 + w) norm weights whole
        if arch == "llama" and short == "attn_q":
            arr = _llama_cpp_permute(arr, n_head)
        elif arch == "llama" and short == "attn_k":
            arr = _llama_cpp_permute(arr, n_kv)
        if gname == "token_embd.weight":
            type_id = embed_type
        elif gname == "output.weight":
            type_id = output_type or 0
        elif arr.ndim >= 2 and short != "ffn_gate_inp":  # llama.cpp's quantizer keeps the router float
            type_id = types if isinstance(types, int) else types.get(short, 8)
        else:
            type_id = norm_type if gname.endswith("norm.weight") else 0
        if type_id:
            rng += type_id not in _QUANTIZED_BY_GGUF_PY and type_id != Q6_K
            w.add_tensor(
                gname, _blocks(arr, type_id, seed + rng), raw_dtype=gguf.GGMLQuantizationType(type_id)
            )
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out_path)


Q6_K = 14
_QUANTIZED_BY_GGUF_PY = (1, 2, 3, 6, 7, 8, 30)  # F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16


def _blocks(arr: np.ndarray, type_id: int, seed: int) -> np.ndarray:
    """``arr``'s rows as blocks of ggml type ``type_id``: gguf-py's quantizer where it has one, :func:`quantize_q6_k`
    for Q6_K, random valid blocks (seeded) for the other K-quants."""
    import gguf

    if type_id in _QUANTIZED_BY_GGUF_PY:
        return gguf.quants.quantize(
            np.ascontiguousarray(arr, dtype=np.float32), gguf.GGMLQuantizationType(type_id)
        )
    if type_id == Q6_K:
        return quantize_q6_k(arr.reshape(-1, arr.shape[-1])).reshape(*arr.shape[:-1], -1)
    rows = int(np.prod(arr.shape[:-1]))
    return (
        random_blocks(rows, arr.shape[-1], type_id, seed=seed, scale=0.01)
        .numpy()
        .reshape(*arr.shape[:-1], -1)
    )


def _write_hparams(w, cfg: dict, arch: str) -> tuple[dict, int]:
    """The architecture's hyperparameters as llama.cpp's converter writes them; returns the RoPE parameters and
    the head size."""
    from batchgen.models.quant.gguf_checkpoint import GEMMA_NORM_ARCHS

    n_head = cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w.add_rope_dimension_count(head_dim)
    if cfg.get("head_dim"):  # as llama.cpp's converter writes it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in GEMMA_NORM_ARCHS and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts:  # mixtral (a llama file), qwen2_moe / qwen3_moe: llama.cpp's qwen2moe / qwen3moe
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    return rope, head_dim


def _write_tokenizer(w, cfg: dict, ckpt, tokenizer: str, arch: str) -> str | None:
    """The vocabulary (``write_gguf``'s `tokenizer`: the checkpoint's byte-level BPE, or a SentencePiece one);
    returns the chat template that goes with it."""
    if tokenizer == "llama":
        tokens, scores, token_types = sentencepiece_vocab(cfg["vocab_size"])
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        return MISTRAL_CHAT_TEMPLATE
    if tokenizer != "gpt2":
        raise ValueError(f"tokenizer must be 'gpt2' or 'llama', not {tokenizer!r}")
    tok = json.loads((ckpt / "tokenizer.json").read_text())
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
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    merges = tok["model"].get("merges", [])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for key, setter in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if isinstance(cfg.get(key), int):
            setter(cfg[key])
    tok_cfg, jinja = ckpt / "tokenizer_config.json", ckpt / "chat_template.jinja"
    template = json.loads(tok_cfg.read_text()).get("chat_template") if tok_cfg.is_file() else None
    return jinja.read_text() if jinja.is_file() else template


def _stack_experts(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's per-expert projections (``mlp.experts.N.gate_proj.weight``,
    Mixtral's ``block_sparse_moe.experts.N.w1.weight``) stacked into one ``[experts, out, in]`` tensor
    (``mlp.experts.gate_proj.weight``: llama.cpp's ``ffn_gate_exps``) in place of its expert 0; a shared-expert gate ``[1, hidden]`` stored as ``[hidden]``."""
    import re

    stacked: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in state.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m is None:
            out.append((name, t.reshape(-1) if name.endswith("shared_expert_gate.weight") else t))
            continue
        key = f"{m[1]}.{m[3]}.weight"
        if key not in stacked:
            stacked[key] = []
            out.append((key, None))
        stacked[key].append((int(m[2]), t))
    return [(n, torch.stack([t for _, t in sorted(stacked[n])]) if t is None else t) for n, t in out]


def _llama3_rope_freqs(rope: dict, head_dim: int) -> torch.Tensor:
    """Llama 3.1's ``rope_freqs.weight`` as llama.cpp's converter computes it: per rotary frequency the factor
    its wavelength is divided by (1 for high frequencies, ``factor`` for low ones, interpolated between)."""
    import math

    base = float(rope.get("rope_theta", 5e5))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)
