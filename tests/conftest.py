"""Shared fixtures: tiny random-weight Hugging Face checkpoints built offline, once per session.

- `llama_ckpt`, `mistral_ckpt`, `qwen2_ckpt`, `qwen3_ckpt`: paths (str) of default tiny checkpoints
  (hidden 64, 2 layers, 4 query heads, 2 kv heads, vocab 4096, float32, untied; Qwen2 has QKV bias,
  Qwen3 QK-norm; seeds 0..3 in that order). Built with `batchgen.models.tiny.build_checkpoint`.
- `ckpt_factory(arch="llama", **kwargs) -> str`: any other variant (same keywords as
  `build_checkpoint`); identical arguments return the same directory (memoised for the session).
- `tiny_ckpt`: the embedded default model (`tiny_default_checkpoint`) built in the session tmp dir.
- `BATCHGEN_CACHE` points at a session tmp dir so tests never touch ~/.cache/batchgen.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchgen.models.tiny import build_checkpoint, tiny_default_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _isolated_batchgen_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("batchgen_cache")
    old = os.environ.get("BATCHGEN_CACHE")
    os.environ["BATCHGEN_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("BATCHGEN_CACHE", None)
    else:
        os.environ["BATCHGEN_CACHE"] = old


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    root = tmp_path_factory.mktemp("ckpts")
    built: dict[str, str] = {}

    def make(arch: str = "llama", **kwargs) -> str:
        key = json.dumps({"arch": arch, **kwargs}, sort_keys=True, default=str)
        if key not in built:
            built[key] = build_checkpoint(root / f"{arch}-{len(built)}", arch, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("llama")


@pytest.fixture(scope="session")
def mistral_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("mistral", seed=1)


@pytest.fixture(scope="session")
def qwen2_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("qwen2", seed=2)


@pytest.fixture(scope="session")
def qwen3_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("qwen3", seed=3)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_default_checkpoint(tmp_path_factory.mktemp("tiny_default"))
