"""Turn a window of input rows into engine requests: prompt text, token ids, sampling params — or an error.

A row becomes an *error row* (never an exception, never dropped) when:
- its input could not be read (a corrupt page: the reader names the file and row group);
- a value the job reads cannot be converted to Python (a string that is not valid UTF-8: ``prompt is not
  valid UTF-8 at byte N``; a timestamp out of range, ...);
- the prompt is null, not a string, or empty / whitespace only;
- ``messages`` is null, not a list (or a JSON string of a list), empty, or an element is not a
  ``{role: str, content: str | [{type: text, text: str}, ...]}`` object, or the chat template rejects it;
- the prompt has no tokens, or ``num_prompt_tokens >= max_model_len`` (at least one generated token must
  fit: generation stops with ``finish_reason="length"`` when the sequence reaches max_model_len);
- its per-row sampling overrides are invalid (unknown field, bad value, or ``n``);
- ``data.id_column`` is set and the row's id is null;
- ``data.lora_column`` is set and the row's adapter name is not a string or not a key of ``model.lora_modules``
  (null: the base model).

Tokenization is one batched call of the fast tokenizer per window. Plain prompts are tokenized like the
engine tokenizes a string prompt (``tokenizer.encode(text)``, special tokens added as the tokenizer
defines); chat prompts are rendered with ``apply_chat_template(..., add_generation_prompt=True)`` and
tokenized without adding special tokens (the template already holds them).

Each error says whether it may be *retried* (``PromptRow.retryable``, kept by ``data.retry_errors``): errors
caused by the run's resources or settings (too long for ``engine.max_model_len``, a chat template or the
tokenizer failing, unreadable input) are; errors in the data itself (null, empty, wrong type, not UTF-8,
malformed messages or overrides) are not.

Every valid row's seed is derived from ``(sampling.seed, row id)`` (see :func:`row_seed`) unless its
overrides set ``seed``, so its samples do not depend on the batch, the grouping or a resume.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import pyarrow as pa

from batchgen.chat import normalize_messages
from batchgen.data.json_limits import JsonLimitError, loads_bounded
from batchgen.data.values import safe_pylist
from batchgen.lora_request import LoRARequest
from batchgen.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.init)
ROW_OVERRIDE_FIELDS = SAMPLING_FIELDS - {"n"}
CONSTRAINT_FIELDS = frozenset({"json_schema", "regex", "choice", "grammar"})


@dataclass
class PromptSpec:
    """How rows map to prompts (from ``data.*`` and ``sampling.*``)."""

    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    id_column: str | None = None
    sampling_column: str | None = None  # effective: None when absent from the input
    base_sampling: SamplingParams = field(default_factory=SamplingParams)  # the job's sampling.*
    max_model_len: int = 1 << 30
    lora_column: str | None = None
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)  # adapter name -> request
    image_column: str | None = None
    image_checkpoint: str | None = None
    """An image-text checkpoint: rows' images (``image_column``, chat image parts) go through its processor."""
    max_images: int | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    image_base: str | None = None
    """Where the rows' relative image paths are looked up first (the input's root directory or URL)."""
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """``engine.mm_processor_kwargs``: options of every call of the checkpoint's processor."""


@dataclass
class PromptRow:
    """One input row of a window: either `token_ids` and `params` are set (valid) or `error` is."""

    position: int
    """Index of the row within its window (input order)."""
    row_index: int
    """Global row index in the input."""
    id: Any
    token_ids: list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None
    num_prompt_tokens: int | None = None
    """Prompt length in tokens once tokenized (also set for rows rejected as too long)."""
    retryable: bool = False
    """The error comes from the run's resources or settings, not from the row's data (see the module doc)."""
    lora: LoRARequest | None = None
    """The row's LoRA adapter (None: the base model)."""
    lora_name: str | None = None
    """The adapter name the row gives (also when unknown: the report counts rows by it)."""
    images: list[Any] | None = None
    """Image rows: sources while the prompt is built, then :class:`batchgen.multimodal.inputs.ImageItem` s."""

    @property
    def image_hashes(self) -> tuple[str, ...]:
        return tuple(getattr(i, "hash", "") for i in self.images or ())

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, error: str, retryable: bool = False) -> None:
        """Mark the row as an error row, unless it already is one (the first error is the one reported)."""
        if self.error is None:
            self.error, self.retryable = error, retryable


def row_seed(seed: int, row_id: Any) -> int:
    """A stable 63-bit seed for a row: blake2b of the job seed and the row id's type and repr."""
    key = f"{int(seed)}\0{type(row_id).__name__}\0{row_id!r}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _type_name(v: Any) -> str:
    return type(v).__name__


def check_messages(value: Any) -> list[dict[str, str]] | str:
    """Validate a chat ``messages`` value; returns the cleaned message list or an error string."""
    if value is None:
        return "messages is null"
    if isinstance(value, str):
        try:
            value = loads_bounded(value)
        except JsonLimitError as e:
            return f"messages is a JSON string {e}"
        except ValueError as e:
            return f"messages is a string but not valid JSON: {e}"
    if isinstance(value, Mapping) or not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return f"messages must be a list of {{role, content}} objects, got {_type_name(value)}"
    if len(value) == 0:
        return "messages is empty"
    out: list[dict[str, str]] = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            return f"messages[{i}] must be an object with 'role' and 'content', got {_type_name(m)}"
        try:  # content: a string, or OpenAI {type: text, text} parts (joined by batchgen.chat)
            out.extend(normalize_messages([m]))
        except ValueError as e:
            return str(e).replace("messages[0]", f"messages[{i}]", 1)
    if all(not m["content"].strip() for m in out):
        return "messages has no content (every message is empty)"
    return out


def check_prompt(value: Any) -> str | None:
    """Error string for an invalid plain prompt, or None."""
    if value is None:
        return "prompt is null"
    if not isinstance(value, str):
        return f"prompt must be a string, got {_type_name(value)}"
    if not value.strip():
        return "prompt is empty" if not value else "prompt is only whitespace"
    return None


def parse_overrides(value: Any) -> dict[str, Any] | str:
    """Per-row sampling overrides from a struct / map / JSON-string value; null fields are dropped."""
    if value is None:
        return {}
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = loads_bounded(value)
        except JsonLimitError as e:
            return f"sampling overrides: the JSON string is {e}"
        except ValueError as e:
            return f"sampling overrides are not valid JSON: {e}"
    if isinstance(value, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        value = dict(value)  # a Parquet map column
    if not isinstance(value, Mapping):
        return f"sampling overrides must be an object, got {_type_name(value)}"
    out = {k: v for k, v in value.items() if v is not None}
    if "n" in out:
        return "sampling override 'n' is not allowed per row (use sampling.n for the whole job)"
    unknown = sorted(set(out) - ROW_OVERRIDE_FIELDS)
    if unknown:
        return f"unknown sampling override(s) {unknown}; valid: {sorted(ROW_OVERRIDE_FIELDS)}"
    return out


def struct_override_problems(t: pa.DataType) -> str | None:
    """Job-level check of a sampling column type: a struct with unknown fields can never be valid."""
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        bad = sorted(set(names) - ROW_OVERRIDE_FIELDS)
        if bad:
            return f"has field(s) {bad} that are not per-row sampling options {sorted(ROW_OVERRIDE_FIELDS)}"
        return None
    if pa.types.is_map(t) or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t):
        return None
    return f"has type {t}; expected a struct (or a JSON string) of sampling options"


def _column(table: pa.Table, name: str | None, rows: list[PromptRow], what: str) -> list[Any] | None:
    """Column `name` as Python values; a value that cannot be converted makes its row an error row
    (``<what> is not valid UTF-8 at byte N``)."""
    if name is None:
        return None
    values, errors = safe_pylist(table.column(name))
    for r, err in zip(rows, errors):
        if err is not None:
            r.fail(f"{what} is {err}")
    return values


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _new_rows(
    table: pa.Table, row_start: int, spec: PromptSpec, unreadable: list[tuple[int, int, str]]
) -> list[PromptRow]:
    """One PromptRow per input row, with its id (an error when the id column is null or undecodable), and
    the rows the reader could not decode marked as (retryable) errors."""
    rows = [PromptRow(i, row_start + i, row_start + i) for i in range(table.num_rows)]
    for start, end, msg in unreadable:
        for r in rows[start:end]:
            r.fail(msg, retryable=True)
    ids = _column(table, spec.id_column, rows, f"id column {spec.id_column!r} value")
    if ids is not None:
        for r in rows:
            r.id = ids[r.position]
            if r.id is None:
                r.fail(f"id column {spec.id_column!r} is null")
    return rows


def _chat_texts(
    rows: list[PromptRow], values: list[Any], tokenizer: Any, spec: PromptSpec | None = None
) -> list[str | None]:
    """Each row's messages rendered with the chat template (None for rows in error)."""
    texts: list[str | None] = [None] * len(rows)
    for r, v in zip(rows, values):
        if r.error:
            continue
        if spec is not None and spec.image_checkpoint is not None:
            from batchgen.multimodal import rows as image_rows

            if image_rows.chat_has_images(v):
                texts[r.position] = image_rows.render_image_chat(r, v, tokenizer, spec)
                continue
        msgs = check_messages(v)
        if isinstance(msgs, str):
            r.fail(msgs)
            continue
        try:
            texts[r.position] = render_chat(tokenizer, msgs)
        except Exception as e:  # noqa: BLE001 - jinja2 errors, template-raised exceptions: this row fails
            r.fail(f"chat template failed: {type(e).__name__}: {e}", retryable=True)
    return texts


def _has_images(value: Any) -> bool:
    """Whether an image column value names at least one image."""
    return value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0)


def _plain_texts(rows: list[PromptRow], values: list[Any], images: list[Any] | None) -> list[str | None]:
    """Each row's prompt text (None for rows in error). A row with images (``images``: the image column's
    values) may have an empty prompt, for a model that places the image itself (captioning)."""
    texts: list[str | None] = [None] * len(rows)
    for r, v in zip(rows, values):
        if r.error:
            continue
        if v == "" and images is not None and _has_images(images[r.position]):
            texts[r.position] = v
            continue
        err = check_prompt(v)
        if err:
            r.fail(err)
        else:
            texts[r.position] = v
    return texts


def _row_params(rows: list[PromptRow], overrides: list[Any] | None, base: SamplingParams) -> None:
    """Set each valid row's SamplingParams: the job's, its own overrides, and its seed (see row_seed)."""
    for r in rows:
        if r.error:
            continue
        ov = parse_overrides(overrides[r.position]) if overrides is not None else {}
        if isinstance(ov, str):
            r.fail(ov)
            continue
        if CONSTRAINT_FIELDS & ov.keys():  # a row's own constraint replaces the job's (at most one is set)
            ov = {**{k: None for k in CONSTRAINT_FIELDS}, **ov}
        if "seed" not in ov and base.seed is not None:
            if not ov:  # the job's validated params with a derived seed (always valid): no re-validation
                r.params = copy.copy(base)
                r.params.seed = row_seed(base.seed, r.id)
                continue
            ov["seed"] = row_seed(base.seed, r.id)
        try:
            r.params = replace(base, **ov)
        except (TypeError, ValueError) as e:
            r.fail(f"invalid sampling override: {e}")


def _row_adapters(rows: list[PromptRow], names: list[Any] | None, spec: PromptSpec) -> None:
    """Each valid row's adapter from its name in the LoRA column (null: the base model)."""
    assert names is not None
    known = spec.lora_requests
    for r in rows:
        name = names[r.position]
        if name is None:
            continue
        if r.error:
            r.lora_name = name if isinstance(name, str) else None
            continue
        if isinstance(name, str):
            r.lora_name = name
        r.lora, error = row_adapter(name, spec.lora_column, known)
        if error is not None:
            r.fail(error)


def row_adapter(
    name: Any, column: str | None, known: dict[str, LoRARequest]
) -> tuple[LoRARequest | None, str | None]:
    """``(adapter, None)`` for a row whose LoRA column holds ``name`` (None: the base model), or ``(None,
    error)`` when it names no adapter of ``model.lora_modules``."""
    if name is None:
        return None, None
    if not isinstance(name, str):
        return None, f"LoRA column {column!r} holds a {_type_name(name)}; expected an adapter name"
    if name not in known:
        return None, (
            f"unknown LoRA adapter {name!r} in column {column!r}: model.lora_modules has "
            f"{', '.join(sorted(known)) or 'none'}"
        )
    return known[name], None


def _tokenize(
    rows: list[PromptRow], texts: list[str | None], tokenizer: Any, chat: bool, max_len: int
) -> None:
    """Tokenize every valid row in one batched call; too long or empty prompts become errors."""
    todo = [r for r in rows if r.error is None]
    if not todo:
        return
    batch = [texts[r.position] for r in todo]
    try:
        enc = tokenizer(batch, add_special_tokens=not chat, return_attention_mask=False)["input_ids"]
    except Exception:  # noqa: BLE001 - one row broke the batch: tokenize row by row to find it
        enc = []
        for r, text in zip(todo, batch):
            try:
                enc.append(
                    tokenizer([text], add_special_tokens=not chat, return_attention_mask=False)["input_ids"][
                        0
                    ]
                )
            except Exception as e:  # noqa: BLE001
                r.fail(f"tokenizer failed: {type(e).__name__}: {e}", retryable=True)
                enc.append(None)
    for r, ids in zip(todo, enc):
        if ids is None:
            continue
        ntok = r.num_prompt_tokens = len(ids)
        if ntok == 0 and not r.images:
            r.fail("prompt has no tokens")
        elif ntok >= max_len:
            r.fail(
                f"prompt has {ntok} tokens but engine.max_model_len is {max_len}: it must leave "
                "room for at least one generated token",
                retryable=True,
            )
        else:
            r.token_ids = list(ids)


def build_prompts(
    table: pa.Table,
    row_start: int,
    spec: PromptSpec,
    tokenizer: Any,
    unreadable: list[tuple[int, int, str]] | None = None,
) -> list[PromptRow]:
    """Validate, render and tokenize the rows of one window (`table`, first global row `row_start`);
    `unreadable` lists ranges of positions the reader could not decode (see
    :class:`batchgen.data.reader.Window`)."""
    rows = _new_rows(table, row_start, spec, unreadable or [])
    images = None
    if spec.image_column is not None:
        images = _column(table, spec.image_column, rows, f"image column {spec.image_column!r} value")
    chat = spec.messages_column is not None
    if chat:
        values = _column(table, spec.messages_column, rows, "messages")
        texts = _chat_texts(rows, values, tokenizer, spec)  # type: ignore[arg-type]
    else:
        texts = _plain_texts(rows, _column(table, spec.prompt_column, rows, "prompt"), images)  # type: ignore[arg-type]
    overrides = _column(table, spec.sampling_column, rows, f"sampling column {spec.sampling_column!r} value")
    _row_params(rows, overrides, spec.base_sampling)
    if spec.lora_column is not None:
        _row_adapters(
            rows, _column(table, spec.lora_column, rows, f"LoRA column {spec.lora_column!r} value"), spec
        )
    if images is not None:
        for r in rows:
            if not r.error and images[r.position] is not None:  # type: ignore[index]
                from batchgen.multimodal.rows import column_images

                r.images = (r.images or []) + column_images(images[r.position])  # type: ignore[index]
    _tokenize(rows, texts, tokenizer, chat, spec.max_model_len)
    if spec.image_checkpoint is not None:
        from batchgen.multimodal.rows import prepare_images

        prepare_images(rows, spec)
    for r in rows:
        if r.error is not None:
            r.params = None
            r.token_ids = None
    return rows
