"""A disk cache of parsed `ModelConfig`s, so a run does not import transformers just to read config.json.

Parsing a native checkpoint's config goes through transformers' configuration classes and RoPE functions
(`batchgen.models.config`), which costs the import of transformers: about 1.5 s of every run's start-up on a
2-core VM, for a result that only depends on the two JSON files. The result is stored as JSON in
`batchgen.runtime.disk_cache` (``$BATCHGEN_CACHE/model-config/``, default ``~/.cache/batchgen``) and reused.

Invariants:
- The key is the SHA-256 of the parsed ``config.json`` and ``generation_config.json`` contents, the installed
  transformers, tokenizers and torch versions and the source of `batchgen/models/config.py` itself, so any change to an
  input of the parse misses the cache. Only successful parses are stored (errors are raised afresh each run).
- An entry is written only if it decodes back to an equal `ModelConfig`; an unreadable, corrupt or
  mismatching entry is ignored (and rewritten). Every failure to read or write the cache is silent: the
  cache can only save time, never change a result or fail a run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch

from batchgen.models import config as config_module
from batchgen.runtime import disk_cache

KIND = "model-config"
_DATACLASSES = {
    c.__name__: c for c in (config_module.ModelConfig, config_module.RopeSpec, config_module.MoESpec)
}


def cache_key(config: dict[str, Any], generation: dict[str, Any] | None) -> str:
    return disk_cache.make_key(config, generation, disk_cache.source_key(config_module.__file__))


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__dataclass__": type(value).__name__, "fields": fields}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("non-string dict key")
        return {"__dict__": {k: _encode(v) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot cache a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dataclass__" in value:
        cls = _DATACLASSES[value["__dataclass__"]]
        return cls(**{k: _decode(v) for k, v in value["fields"].items()})
    if "__dtype__" in value:
        dtype = getattr(torch, value["__dtype__"])
        if not isinstance(dtype, torch.dtype):
            raise TypeError(value["__dtype__"])
        return dtype
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    return {k: _decode(v) for k, v in value["__dict__"].items()}


def cached_parse(config: dict[str, Any], generation: dict[str, Any] | None, parse: Callable[[], Any]) -> Any:
    """The `ModelConfig` for these config files: from the cache when present, else ``parse()`` (stored)."""
    try:
        key = cache_key(config, generation)
    except (OSError, TypeError, ValueError):
        return parse()
    entry = disk_cache.read(KIND, key)
    if entry is not None:
        try:
            return _decode(entry)
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
    result = parse()
    try:
        encoded = _encode(result)
        if _decode(json.loads(json.dumps(encoded))) == result:
            disk_cache.write(KIND, key, encoded)
    except (TypeError, ValueError, KeyError, AttributeError):
        pass
    return result
