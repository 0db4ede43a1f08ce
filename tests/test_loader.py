"""Checkpoint tooling and loading: tiny checkpoints, tokenizer, safetensors streaming, error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchgen.models.tiny import CHAT_TEMPLATE, EOS_TOKEN, IM_END, build_tokenizer, tiny_default_checkpoint

TEXTS = [
    "Hello world! The quick brown fox's   jumps\n\n over 12345 dogs.",
    "  leading spaces\ttabs\r\nCRLF é ü 你好 🤗 e\u0301",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_auto_tokenizer_matches_built_tokenizer(arch, request):
    path = request.getfixturevalue(f"{arch}_ckpt")
    built = PreTrainedTokenizerFast.from_pretrained(path)
    auto = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert auto.encode(text) == built.encode(text), (arch, text)
    assert auto.eos_token == EOS_TOKEN
    assert auto.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>assistant\n"
    )
    gen = json.loads((Path(path) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [auto.convert_tokens_to_ids(EOS_TOKEN), auto.convert_tokens_to_ids(IM_END)]


def test_tokenizer_deterministic_and_cached(tmp_path):
    a = build_tokenizer(tmp_path / "a", vocab_size=1024)
    b = build_tokenizer(tmp_path / "b", vocab_size=1024)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert len(a) == len(b) == 1024
    mtime = (tmp_path / "a" / "tokenizer.json").stat().st_mtime_ns
    build_tokenizer(tmp_path / "a", vocab_size=1024)
    assert (tmp_path / "a" / "tokenizer.json").stat().st_mtime_ns == mtime


def test_tiny_default_checkpoint_built_once(tmp_path):
    p1 = tiny_default_checkpoint(tmp_path)
    mtime = (Path(p1) / "model.safetensors").stat().st_mtime_ns
    p2 = tiny_default_checkpoint(tmp_path)
    assert p1 == p2
    assert (Path(p2) / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [Path(p1).name]  # no temp dirs left behind
