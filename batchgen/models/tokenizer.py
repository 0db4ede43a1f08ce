"""`FastTokenizer`: a checkpoint's tokenizer straight from ``tokenizer.json`` through the ``tokenizers`` library,
without importing transformers (about 1.5 s of start-up on a 2-core VM).

It implements what the engine and the job call on every run — ``encode(text, add_special_tokens=)``, the
batched ``tokenizer(texts, add_special_tokens=, return_attention_mask=False)``,
``decode(ids, skip_special_tokens=)``, the special token ids, ``convert_tokens_to_ids``, ``len()``,
``backend_tokenizer`` — and hands every other attribute (``apply_chat_template``, ``chat_template``,
``batch_decode``, ``eos_token``, ...) to the transformers tokenizer of the same directory, loaded on first such
use. So it behaves as the ``AutoTokenizer`` it stands for; ``as_transformers`` gives that tokenizer itself
(for libraries that check its type, e.g. xgrammar).

Invariant: ids and text equal ``AutoTokenizer``'s. That holds where transformers itself loads the file as it
is, so `load_checkpoint_tokenizer` uses a `FastTokenizer` only when (static checks) ``tokenizer_config.json``
names the generic class (``PreTrainedTokenizerFast`` / ``TokenizersBackend``), uses no key outside
`_PLAIN_KEYS`, asks for no text cleanup on decode, every special token it names is already a special added
token of ``tokenizer.json``, there is no ``special_tokens_map.json``, and (verdict) ``AutoTokenizer`` loaded
from the same files once gave that generic class around an identical pipeline (``to_str()``) with the same
special token ids and length. The verdict is kept in `batchgen.runtime.disk_cache` (``$BATCHGEN_CACHE/tokenizer/``)
keyed by the files' hashes and the library versions, so later runs skip transformers; without a cached
verdict the run loads ``AutoTokenizer`` and decides. Like transformers' encode (no truncation, no padding by
default), truncation and padding stored in ``tokenizer.json`` are switched off.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchgen.runtime import disk_cache

VERDICTS = "tokenizer"
_VERDICT_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json")

_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
_LIST_KEYS = ("extra_special_tokens", "additional_special_tokens")
# tokenizer_config.json keys that do not change what encode/decode of one text give.
_PLAIN_KEYS = frozenset(
    {
        *_SPECIAL_KEYS,
        *_LIST_KEYS,
        "backend",
        "tokenizer_class",
        "clean_up_tokenization_spaces",
        "model_max_length",
        "added_tokens_decoder",
        "chat_template",
        "model_input_names",
        "padding_side",
        "truncation_side",
    }
)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    raise ValueError(f"unrecognised special token {token!r}")


def _eligible_specials(cfg: dict[str, Any], added: dict[int, Any]) -> dict[str, str | None] | None:
    """The named special tokens (key -> content) when every one is a special added token already, else None."""
    special_contents = {t.content for t in added.values() if t.special}
    specials = {k: _content(cfg.get(k)) for k in _SPECIAL_KEYS}
    extra = [_content(t) for k in _LIST_KEYS for t in (cfg.get(k) or [])]
    if any(c is not None and c not in special_contents for c in (*specials.values(), *extra)):
        return None
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        token = added.get(int(key))
        if (
            token is None
            or token.content != entry.get("content")
            or token.special != entry.get("special", False)
        ):
            return None
    return specials


def load_checkpoint_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of checkpoint directory `path`: a `FastTokenizer` where it is known to match transformers
    (see the module docstring), else transformers' ``AutoTokenizer`` (local files only, no remote code)."""
    ckpt = Path(path)
    candidate = _candidate(ckpt)
    if candidate is not None:
        key = _verdict_key(ckpt)
        verdict = disk_cache.read(VERDICTS, key) if key else None
        if verdict is not None and verdict.get("fast") is True:
            return candidate
        if verdict is None:
            hf = _auto_tokenizer(ckpt)
            same = _same_as_transformers(candidate, hf)
            if key:
                disk_cache.write(VERDICTS, key, {"fast": same, "transformers_class": type(hf).__name__})
            if same:
                candidate._hf = hf
                return candidate
            return hf
    return _auto_tokenizer(ckpt)


def _auto_tokenizer(ckpt: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=False, local_files_only=True)


def _candidate(ckpt: Path) -> FastTokenizer | None:
    """A `FastTokenizer` for `ckpt` when its files pass the static checks, else None."""
    tokenizer_file, config_file = ckpt / "tokenizer.json", ckpt / "tokenizer_config.json"
    if (
        not tokenizer_file.is_file()
        or not config_file.is_file()
        or (ckpt / "special_tokens_map.json").exists()
    ):
        return None
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(cfg, dict)
        or cfg.get("tokenizer_class") not in _GENERIC_CLASSES
        or not set(cfg) <= _PLAIN_KEYS
        or cfg.get("clean_up_tokenization_spaces")
    ):
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(tokenizer_file))
        specials = _eligible_specials(cfg, backend.get_added_tokens_decoder())
    except Exception:  # noqa: BLE001 - whatever the library refuses, transformers decides
        return None
    if specials is None:
        return None
    backend.no_truncation()
    backend.no_padding()
    return FastTokenizer(ckpt, backend, specials)


def _verdict_key(ckpt: Path) -> str | None:
    """What transformers' choice of tokenizer depends on: the tokenizer files and config.json (model_type)."""
    try:
        files = {
            n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest()
            for n in _VERDICT_FILES
            if (ckpt / n).is_file()
        }
        return disk_cache.make_key(files, disk_cache.source_key(__file__))
    except OSError:
        return None


def _pipeline(backend: Any) -> dict[str, Any]:
    """A tokenizers pipeline as JSON, without truncation and padding (transformers' encode switches them off)."""
    data = json.loads(backend.to_str())
    data.pop("truncation", None)
    data.pop("padding", None)
    return data


def _same_as_transformers(fast: FastTokenizer, hf: Any) -> bool:
    """Whether transformers loaded the generic class around the very same pipeline and special tokens."""
    try:
        return (
            type(hf).__name__ in _GENERIC_CLASSES
            and _pipeline(hf.backend_tokenizer) == _pipeline(fast.backend_tokenizer)
            and not getattr(hf, "clean_up_tokenization_spaces", False)
            and all(getattr(hf, f"{k}_id") == getattr(fast, f"{k}_id") for k in _SPECIAL_KEYS)
            and len(hf) == len(fast)
        )
    except Exception:  # noqa: BLE001 - anything unexpected: use transformers
        return False


class FastTokenizer:
    """The transformers fast tokenizer of one checkpoint, its hot methods run by ``tokenizers`` directly.

    Build it with `load_fast_tokenizer`. Attributes not defined here come from the transformers tokenizer
    (`as_transformers`), loaded on first access.
    """

    is_fast = True
    clean_up_tokenization_spaces = False

    def __init__(self, path: Path, backend: Any, specials: dict[str, str | None]) -> None:
        self.name_or_path = str(path)
        self._backend = backend
        self._hf: Any = None
        for key, content in specials.items():
            setattr(self, f"{key}_id", None if content is None else backend.token_to_id(content))

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (as transformers' ``backend_tokenizer``)."""
        return self._backend

    def as_transformers(self) -> Any:
        """The transformers tokenizer this one stands for (loaded once, on first call)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(
                self.name_or_path, trust_remote_code=False, local_files_only=True
            )
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_backend", "_hf"):
            raise AttributeError(name)
        return getattr(self.as_transformers(), name)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: Any, *args: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of one string, as transformers' ``encode`` (other arguments go to transformers)."""
        if args or kwargs or not isinstance(text, str):
            return self.as_transformers().encode(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(
        self,
        text: Any,
        *args: Any,
        add_special_tokens: bool = True,
        return_attention_mask: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``tokenizer(texts, add_special_tokens=..., return_attention_mask=False)["input_ids"]`` (a batch of
        strings, ids only) runs here; any other call is transformers'."""
        if args or kwargs or return_attention_mask is not False or not _is_str_list(text):
            return self.as_transformers()(
                text,
                *args,
                add_special_tokens=add_special_tokens,
                return_attention_mask=return_attention_mask,
                **kwargs,
            )
        encodings = self._backend.encode_batch(text, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """Text of token ids (an int or a sequence of ints), as transformers' ``decode``."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif hasattr(token_ids, "tolist"):  # a tensor or an array
            token_ids = token_ids.tolist()
        if kwargs or not isinstance(token_ids, Sequence):
            return self.as_transformers().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return found if found is not None else self.as_transformers().convert_tokens_to_ids(tokens)
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"


def as_transformers(tokenizer: Any) -> Any:
    """`tokenizer` itself, or for a `FastTokenizer` the transformers tokenizer it stands for."""
    return tokenizer.as_transformers() if isinstance(tokenizer, FastTokenizer) else tokenizer


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
