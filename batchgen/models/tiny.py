"""Tiny Hugging Face checkpoints offline: a byte-level BPE tokenizer, random-weight decoders, and the
embedded default model.

- `build_checkpoint` / `cached_checkpoint`: random-weight checkpoints for the tests and benchmarks (one per
  architecture), built locally, so nothing is ever downloaded; `build_random_checkpoint` the same for any
  transformers architecture from its config class.
- `tiny_default_checkpoint`: the embedded default model (`model=tiny`), a small Llama trained on English text
  that ships with CPython and shipped as package data in `tiny_lm/` (weights and tokenizer);
  `python -m batchgen.models.tiny_training` reproduces it.

Invariants:
- Deterministic: the same arguments give byte-identical tokenizer files and weights in the same
  environment (the tokenizer is trained on text shipped with this CPython, so a different Python
  version gives a different, still deterministic, tokenizer; hence the default model ships its own).
- The tokenizer uses the Qwen2 pre-tokenization pipeline (NFC normaliser, Qwen2 split regex,
  ByteLevel without regex) for every architecture. `AutoTokenizer` rebuilds that exact pipeline from
  vocab + merges for `model_type` qwen2/qwen3 (it forces `Qwen2Tokenizer`), so ids agree with
  `tokenizer.json` whatever the architecture.
- No post-processor: encoding never adds BOS/EOS by itself (same behaviour under `Qwen2Tokenizer`).
"""

from __future__ import annotations

import json
import os
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchgen.runtime.atomic import build_dir_once
from batchgen.runtime.disk_cache import cache_root

SPECIAL_TOKENS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END = SPECIAL_TOKENS
DEFAULT_VOCAB_SIZE = 4096

# ChatML: "<|im_start|>role\ncontent<|im_end|>\n" per message, then the assistant header on request.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Same regex as transformers' Qwen2Tokenizer (see the module docstring).
_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# The embedded default model ("model=tiny"): trained weights and tokenizer shipped with the package.
TINY_LM_DIR = Path(__file__).resolve().parent / "tiny_lm"

_tokenizer_json_cache: dict[int, str] = {}
_tokenizer_lock = threading.Lock()
_seeded_init_lock = threading.Lock()  # the seeded init uses torch's global RNG: one build at a time


def _training_corpus() -> list[str]:
    """English text shipped with CPython: the reference manual, the licence, stdlib sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for p in (stdlib / "pydoc_data" / "topics.py", stdlib / "LICENSE.txt"):
        if p.is_file():
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
    texts += [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
    if not texts:
        raise RuntimeError(f"no training text found under {stdlib}")
    return texts


def train_tokenizer_json(vocab_size: int, texts: list[str] | None = None) -> str:
    """Train the byte-level BPE tokenizer and return its tokenizer.json text.

    `texts` defaults to `_training_corpus()` (memoised per process and vocab size); the embedded
    default model's training script passes its own corpus through the same pipeline.
    """
    if texts is None:
        with _tokenizer_lock:
            if vocab_size not in _tokenizer_json_cache:
                _tokenizer_json_cache[vocab_size] = _train_bpe(vocab_size, _training_corpus())
            return _tokenizer_json_cache[vocab_size]
    return _train_bpe(vocab_size, texts)


def _train_bpe(vocab_size: int, texts: list[str]) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


def wrap_tokenizer(tokenizer_json: str):
    """A `PreTrainedTokenizerFast` around `tokenizer_json` with our special tokens and ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train (or reuse) a byte-level BPE tokenizer and `save_pretrained` it into `out_dir`.

    Special tokens take ids 0..4: pad, bos, eos (`<|endoftext|>`), `<|im_start|>`, `<|im_end|>`.
    Reuses `out_dir` if it already holds a tokenizer of this vocab size. Returns the
    `PreTrainedTokenizerFast`. `len(tokenizer) <= vocab_size` (less only if the corpus runs out of merges).
    """
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    marker = out / "batchgen_tokenizer.json"
    if marker.is_file() and (out / "tokenizer.json").is_file():
        try:
            if json.loads(marker.read_text()).get("vocab_size") == vocab_size:
                return PreTrainedTokenizerFast.from_pretrained(str(out))
        except (OSError, ValueError):
            pass
    out.mkdir(parents=True, exist_ok=True)
    tok = wrap_tokenizer(train_tokenizer_json(vocab_size))
    tok.save_pretrained(str(out))
    marker.write_text(json.dumps({"vocab_size": vocab_size}))
    return tok


def make_config(
    arch: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None,
    intermediate_size: int | None,
    vocab_size: int,
    tie_word_embeddings: bool,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype,
    initializer_range: float,
    max_position_embeddings: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    extra: dict[str, Any],
):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(SUPPORTED_ARCHS)}")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **_rope_and_dtype_kwargs(
            rope_theta, rope_scaling, dtype, int(transformers.__version__.split(".")[0])
        ),
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None  # full attention unless asked (see ModelConfig.sliding_window)
    kwargs.update(extra)
    return classes[arch](**kwargs)


def _rope_and_dtype_kwargs(
    rope_theta: float, rope_scaling: dict[str, Any] | None, dtype: torch.dtype, transformers_major: int
) -> dict[str, Any]:
    """The config keywords for RoPE and the dtype, spelt as transformers ``transformers_major`` expects."""
    rope = {"rope_type": "default"}
    if rope_scaling:
        rope = dict(rope_scaling)
        rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = float(rope_theta)
    if transformers_major >= 5:
        return dict(rope_parameters=rope, dtype=dtype)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}  # 4.x spelling of the same settings
    return dict(
        rope_theta=rope["rope_theta"],
        rope_scaling=None if scaling["rope_type"] == "default" else scaling,
        torch_dtype=dtype,
    )


def _random_model(arch: str, cfg: Any, seed: int, initializer_range: float) -> torch.nn.Module:
    """``arch``'s transformers model of config ``cfg``, its weights drawn under ``torch.manual_seed(seed)``.

    transformers initialises norms to 1 and biases to 0: they are perturbed so that tests notice a model that
    forgets a bias or a norm weight."""
    import transformers

    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[arch]
    with _seeded_init_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, initializer_range)
                elif name.endswith("norm.weight"):
                    param.normal_(1.0, 0.1)
    return model


def build_checkpoint(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    initializer_range: float = 0.08,
    max_position_embeddings: int = 2048,
    max_shard_size: str | int | None = None,
    **extra: Any,
) -> str:
    """Build a random-weight `arch` checkpoint (config, safetensors, generation config, tokenizer).

    `arch` is one of llama, mistral, qwen2, qwen3. `rope_scaling` is a dict such as
    `{"rope_type": "linear", "factor": 2.0}` or a llama3 one; `extra` goes to the transformers config
    (e.g. `attention_bias=True`, `sliding_window=4096`). Weights come from transformers' own
    initialiser under `torch.manual_seed(seed)` (biases and norm weights perturbed), so they are
    deterministic. `max_shard_size` (e.g.
    `"200KB"`) writes a sharded checkpoint with `model.safetensors.index.json`. Returns `out_dir` as str.
    """
    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    if len(tok) > vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens > vocab_size {vocab_size}")
    ids = special_token_ids(tok)
    cfg = make_config(
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        dtype=dtype,
        initializer_range=initializer_range,
        max_position_embeddings=max_position_embeddings,
        bos_id=ids[BOS_TOKEN],
        eos_id=ids[EOS_TOKEN],
        pad_id=ids[PAD_TOKEN],
        extra=extra,
    )
    model = _random_model(arch, cfg, seed, initializer_range)
    save_model(model.to(dtype), out, ids, max_shard_size=max_shard_size)
    return str(out)


def special_token_ids(tokenizer) -> dict[str, int]:
    """Special token -> id in `tokenizer` (see SPECIAL_TOKENS)."""
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def save_model(
    model,
    out_dir: str | os.PathLike,
    ids: dict[str, int],
    max_shard_size: str | int | None = None,
    **generation: Any,
):
    """`save_pretrained` `model` (in its current dtype) as safetensors with our greedy generation config
    (plus `generation`, fields of ``transformers.GenerationConfig``).

    `ids` maps the special tokens to their ids (see `special_token_ids`); EOS is `<|endoftext|>` or
    `<|im_end|>`. Progress bars are silenced.
    """
    import transformers

    model = model.eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END]],
        pad_token_id=ids[PAD_TOKEN],
        **{"do_sample": False, **generation},
    )
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    hf_logging = transformers.utils.logging
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        try:
            model.save_pretrained(str(out_dir), **save_kwargs)
        except TypeError:  # transformers versions without safe_serialization (always safetensors)
            save_kwargs.pop("safe_serialization")
            model.save_pretrained(str(out_dir), **save_kwargs)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root()


def special_token_kwargs(ids: dict[str, int]) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for a config, from :func:`special_token_ids`."""
    return dict(bos_token_id=ids[BOS_TOKEN], eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN])


def build_random_checkpoint(
    out_dir: str | os.PathLike,
    make_config: Callable[[dict[str, int]], Any],
    model_class: str,
    *,
    vocab_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init: Callable[[torch.nn.Module], None] | None = None,
    **generation: Any,
) -> str:
    """A random-weight checkpoint of any transformers architecture in `out_dir`: our BPE tokenizer
    (`vocab_size`), the config ``make_config(ids)`` (`ids`: :func:`special_token_ids` of that tokenizer),
    weights of ``transformers.<model_class>`` drawn under `seed` (then ``init(model)``, no grad, where given),
    cast to `dtype`, saved by :func:`save_model` (plus `generation`). Returns the path."""
    import transformers

    out = Path(out_dir)
    ids = special_token_ids(build_tokenizer(out, vocab_size=vocab_size))
    cfg = make_config(ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(cfg)
        if init is not None:
            with torch.no_grad():
                init(model)
    save_model(model.to(dtype), out, ids, **generation)
    return str(out)


def cached_checkpoint(name: str, cache_dir: str | os.PathLike | None = None, **spec: Any) -> str:
    """Path of checkpoint ``name`` built with ``build_checkpoint(**spec)`` on first use and reused afterwards.

    Lives in `cache_dir`, else `$BATCHGEN_CACHE`, else `~/.cache/batchgen`. Built into a temporary
    directory beside the target and renamed into place, so concurrent first uses never see (or leave)
    a half-written checkpoint: the loser of the rename race discards its copy.
    """
    return build_dir_once(
        _cache_root(cache_dir) / name, "config.json", lambda tmp: build_checkpoint(tmp, **spec)
    )


def tiny_default_checkpoint() -> str:
    """Path of the embedded default model: the trained checkpoint shipped in `batchgen/models/tiny_lm/`.

    Nothing is built or copied at run time. Raises FileNotFoundError if the package was installed without its
    data files.
    """
    missing = [
        f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (TINY_LM_DIR / f).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"the embedded default model is incomplete: {', '.join(missing)} missing from {TINY_LM_DIR} "
            "(batchgen was installed without its package data; reinstall it, or rebuild the model with "
            "`python -m batchgen.models.tiny_training`)"
        )
    return str(TINY_LM_DIR)
