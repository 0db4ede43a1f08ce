"""`batchgen.models.config_cache`: a parsed ModelConfig survives the JSON round trip exactly, for every native
architecture, and the disk cache returns what a fresh parse returns (never a stale or corrupt entry)."""

from __future__ import annotations

import json

import pytest
from model_zoo import ARCHS, _config

from batchgen.models.config import NATIVE_ARCHITECTURES, NATIVE_TEXT_OF_MULTIMODAL, ModelConfig
from batchgen.models.config_cache import KIND, _decode, _encode
from batchgen.models.tiny import TINY_LM_DIR
from batchgen.runtime import disk_cache

NATIVE_ZOO = [a for a, (_, arch, _) in ARCHS.items() if arch in NATIVE_ARCHITECTURES]
IDS = {"<|bos|>": 1, "<|endoftext|>": 2, "<|pad|>": 0}


@pytest.mark.parametrize("arch", NATIVE_ZOO)
def test_round_trip_is_exact(arch):
    cfg = _config(arch, IDS, {}).to_dict()
    cfg["architectures"] = [ARCHS[arch][1]]
    parsed = ModelConfig.from_dict(cfg, {"eos_token_id": [2, 3]})
    assert _decode(json.loads(json.dumps(_encode(parsed)))) == parsed


@pytest.mark.parametrize("arch", [a for a in NATIVE_ZOO if ARCHS[a][1] not in NATIVE_TEXT_OF_MULTIMODAL])
def test_a_config_without_architectures_parses_as_its_causal_lm(arch):
    """No ``architectures`` key: the model_type's causal LM runs it (for gemma3_text, the text model, not the
    vision-language checkpoint that also names it; that layout always names its architecture)."""
    cfg = _config(arch, IDS, {}).to_dict()
    cfg.pop("architectures", None)
    named = {**cfg, "architectures": [ARCHS[arch][1]]}
    assert ModelConfig.from_dict(cfg) == ModelConfig.from_dict(named)


def _entries():
    return sorted((disk_cache.cache_root() / KIND).glob("*.json"))


def test_cache_hit_equals_parse(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "ckpt"
    src.mkdir()
    for name in ("config.json", "generation_config.json"):
        (src / name).write_text((TINY_LM_DIR / name).read_text())
    fresh = ModelConfig.from_dict(
        *(json.loads((src / n).read_text()) for n in ("config.json", "generation_config.json"))
    )
    first = ModelConfig.from_pretrained(src)
    assert first == fresh and len(_entries()) == 1
    assert ModelConfig.from_pretrained(src) == fresh  # from the cache

    _entries()[0].write_text("{not json")  # a corrupt entry is ignored and rewritten
    assert ModelConfig.from_pretrained(src) == fresh
    assert _decode(json.loads(_entries()[0].read_text())) == fresh

    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))  # a changed config misses
    changed = ModelConfig.from_pretrained(src)
    assert changed.rms_norm_eps == 1e-5 and len(_entries()) == 2


def test_unwritable_cache_is_silent(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("BATCHGEN_CACHE", str(blocker / "cache"))  # cannot be created
    assert ModelConfig.from_pretrained(TINY_LM_DIR).architecture == "LlamaForCausalLM"
