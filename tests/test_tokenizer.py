"""`batchgen.models.tokenizer.FastTokenizer` gives exactly the ids and text of transformers' `AutoTokenizer`, and
`load_tokenizer` falls back to transformers wherever that is not guaranteed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import link_shared_kernels
from transformers import AutoTokenizer

from batchgen.models.loader import load_tokenizer
from batchgen.models.tiny import TINY_LM_DIR
from batchgen.models.tokenizer import FastTokenizer, as_transformers

TEXTS = [
    "Q: What does pathlib.Path.read_text() do? A:",
    "",
    " leading space and  double  spaces\n\nnew lines\ttabs",
    "unicode: héllo wörld — ☃ 日本語 🙂 \u00a0nbsp",
    "<|bos|>special<|endoftext|> tokens <|im_start|>user\nhi<|im_end|>",
    "x" * 300,
]


def _compare(path: str) -> None:
    fast = load_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert isinstance(fast, FastTokenizer)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(fast, attr) == getattr(ref, attr), attr
    assert len(fast) == len(ref)
    for special in (True, False):
        for text in TEXTS:
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        batch = fast(TEXTS, add_special_tokens=special, return_attention_mask=False)["input_ids"]
        assert batch == ref(TEXTS, add_special_tokens=special, return_attention_mask=False)["input_ids"]
    assert fast.decode(5) == ref.decode(5)
    assert fast.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]) == ref.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_end|>"]
    )
    # Everything else is transformers' own.
    assert fast.eos_token == ref.eos_token and fast.chat_template == ref.chat_template
    assert type(as_transformers(fast)) is type(ref)


def test_shipped_model_tokenizer_matches_auto_tokenizer():
    _compare(str(TINY_LM_DIR))


def test_test_checkpoint_tokenizer_matches_auto_tokenizer(llama_ckpt):
    _compare(llama_ckpt)


def test_specialised_transformers_class_is_kept(qwen2_ckpt):
    # transformers 5 loads Qwen2 checkpoints with Qwen2Tokenizer even where tokenizer_config.json names the
    # generic class: the verdict (cached) says so, and that tokenizer is used, on every load.
    for _ in range(2):
        tok = load_tokenizer(qwen2_ckpt)
        ref = AutoTokenizer.from_pretrained(qwen2_ckpt, local_files_only=True)
        if type(ref).__name__ not in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            assert type(tok) is type(ref)


def test_chat_template_is_transformers(llama_ckpt):
    fast, ref = load_tokenizer(llama_ckpt), AutoTokenizer.from_pretrained(llama_ckpt, local_files_only=True)
    messages = [{"role": "user", "content": "hi"}]
    kwargs = dict(tokenize=False, add_generation_prompt=True)
    assert fast.apply_chat_template(messages, **kwargs) == ref.apply_chat_template(messages, **kwargs)


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer_class": "LlamaTokenizer"},
        {"add_bos_token": True},
        {"clean_up_tokenization_spaces": True},
        {"eos_token": "<|not-in-vocab|>"},
        {"extra_special_tokens": ["<|im_start|>", "<|new|>"]},
    ],
)
def test_falls_back_to_transformers(tmp_path, change):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(TINY_LM_DIR / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, **change}))
    assert not isinstance(load_tokenizer(tmp_path), FastTokenizer)


def test_special_tokens_map_falls_back(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_LM_DIR / name, tmp_path / name)
    (tmp_path / "special_tokens_map.json").write_text("{}")
    assert not isinstance(load_tokenizer(tmp_path), FastTokenizer)


def test_cached_verdict_skips_transformers(tmp_path):
    # First load decides (with transformers) and caches the verdict; a fresh process then loads the shipped
    # model's tokenizer, config and weights without importing transformers (nor torch._dynamo).
    link_shared_kernels(tmp_path)  # a fresh verdict cache; the run's compiled kernels (not what is tested)
    env = {**os.environ, "BATCHGEN_CACHE": str(tmp_path)}
    code = (
        "import sys\n"
        "from batchgen.models.loader import load_model, load_tokenizer\n"
        "from batchgen.models.tiny import TINY_LM_DIR\n"
        "tok = load_tokenizer(TINY_LM_DIR); load_model(TINY_LM_DIR)\n"
        "print(type(tok).__name__, 'transformers' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True) for _ in "ab"
    ]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[0].stdout.split()[:2] == ["FastTokenizer", "True"]
    assert runs[1].stdout.split() == ["FastTokenizer", "False", "False"]
