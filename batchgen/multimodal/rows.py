"""Images in a job's rows: ``data.image_column`` (one image or a list per row: Hugging Face ``datasets``'
Image struct ``{bytes, path}``, a binary column, or string paths/URLs) and image parts of chat messages
(``data.messages_column``), turned into each row's expanded token ids and :class:`ImageItem` list.

Runs where the window's prompts are built (the window read-ahead thread), images of a window prepared in worker
threads; a row whose images cannot be used becomes an error row naming the image and the reason. The pixel
tensors of a window's distinct images are held until its rows are in the engine: ``data.window_rows`` bounds
that memory.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from batchgen.multimodal.inputs import ImagePrompts, as_image_list

_SIDES: dict[tuple[str, Any], ImagePrompts] = {}
_LOCK = threading.Lock()


def image_token_id(checkpoint: str) -> int | None:
    """The checkpoint's image placeholder token id when batchgen runs its images (an image-text
    architecture), else None."""
    from batchgen.models.config import IMAGE_TEXT_ARCHITECTURES

    try:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not set(cfg.get("architectures") or []) & set(IMAGE_TEXT_ARCHITECTURES):
        return None
    token = cfg.get("image_token_index", cfg.get("image_token_id"))
    return int(token) if token is not None else None


def checkpoint_config(checkpoint: str) -> dict[str, Any]:
    """The checkpoint's config.json ({} when unreadable)."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _architecture(checkpoint: str) -> str | None:
    archs = checkpoint_config(checkpoint).get("architectures") or []
    return str(archs[0]) if isinstance(archs, list) and archs else None


def image_side(
    checkpoint: str,
    max_images: int | None,
    storage_options: dict[str, Any] | None,
    processor_kwargs: dict[str, Any] | None = None,
    base: str | None = None,
) -> ImagePrompts:
    """The checkpoint's :class:`ImagePrompts` (one per process and settings; ``base``: where relative image
    paths are looked up first)."""
    key = (
        checkpoint,
        max_images,
        json.dumps(storage_options or {}, sort_keys=True, default=str),
        json.dumps(processor_kwargs or {}, sort_keys=True, default=str),
        base,
    )
    with _LOCK:
        side = _SIDES.get(key)
        if side is None:
            from batchgen.multimodal.images import ImageLoader

            token = image_token_id(checkpoint)
            if token is None:
                raise ValueError(f"{checkpoint} is not an image-text checkpoint batchgen runs")
            side = ImagePrompts(checkpoint, token, max_images=max_images, processor_kwargs=processor_kwargs)
            side.loader = ImageLoader(storage_options, base=base)
            _SIDES[key] = side
        return side


def column_images(value: Any) -> list[Any]:
    """A row's image column value as a list of image sources (one value, or a list of them)."""
    return as_image_list(value)


def chat_has_images(messages: Any) -> bool:
    from batchgen.multimodal.chat import has_images

    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except ValueError:
            return False
    return has_images(messages)


def render_image_chat(row: Any, messages: Any, tokenizer: Any, spec: Any) -> str | None:
    """A chat row with image parts rendered by the processor's chat template; its images recorded on the row
    (an error row, returning None, when a message is malformed or the template fails)."""
    from batchgen.multimodal.chat import render, split_images

    if isinstance(messages, str):
        messages = json.loads(messages)
    try:
        msgs, images = split_images(messages)
        side = image_side(
            spec.image_checkpoint,
            spec.max_images,
            spec.storage_options,
            spec.processor_kwargs,
            spec.image_base,
        )
        text = render(side.processor, tokenizer, msgs)
    except ValueError as e:
        row.fail(str(e))
        return None
    except Exception as e:  # noqa: BLE001 - jinja2 errors, template-raised exceptions: this row fails
        row.fail(f"chat template failed: {type(e).__name__}: {e}", retryable=True)
        return None
    row.images = images
    return text


def prepare_images(rows: list[Any], spec: Any) -> None:
    """Every valid row with images: expanded token ids and its :class:`ImageItem` list, or an error row
    (the images of the rows prepared in worker threads)."""
    from batchgen.multimodal.prepare import prepare

    side = image_side(
        spec.image_checkpoint, spec.max_images, spec.storage_options, spec.processor_kwargs, spec.image_base
    )
    column = f"image column {spec.image_column!r}" if spec.image_column else None
    for r in rows:  # placeholders without images: a data error, not text to run
        if r.error is None and not r.images and side.image_token_id in (r.token_ids or ()):
            r.fail(
                f"the prompt has image placeholder(s) ({side.image_token!r}) but the row has no image"
                + (f" ({column} is null or empty)" if column else "")
            )
    todo = [r for r in rows if r.error is None and r.images]
    sources = [s for s in (column, spec.messages_column and f"messages column {spec.messages_column!r}") if s]
    where = " and ".join(sources) or "the row's images"
    for r, ready in zip(todo, prepare(side, [(r.token_ids, r.images) for r in todo])):
        if isinstance(ready, str):
            r.fail(f"{where}: {ready}")  # the column the images came from, then which image and why
            continue
        n = r.num_prompt_tokens = len(ready.token_ids)
        if n >= spec.max_model_len:
            r.fail(
                f"prompt has {n} tokens with its images expanded but engine.max_model_len is "
                f"{spec.max_model_len}: it must leave room for at least one generated token",
                retryable=True,
            )
            continue
        r.token_ids, r.images = ready.token_ids, ready.images
    for r in rows:
        if r.error is not None:
            r.images = None


def image_options(
    image_column: str | None,
    model_path: str,
    limit_mm_per_prompt: dict[str, int] | None,
    storage_options: dict[str, Any] | None,
    processor_kwargs: dict[str, Any] | None = None,
    base: str | None = None,
) -> dict[str, Any]:
    """The :class:`~batchgen.data.prompts.PromptSpec` image fields of a job (``data.image_column``, the
    checkpoint, ``limit_mm_per_prompt``, ``data.storage_options``, ``engine.mm_processor_kwargs``, the input's
    root for relative image paths); ConfigError when ``data.image_column`` is set for a model that takes no
    images, or when the checkpoint's processor does not take one of ``processor_kwargs``."""
    from batchgen.errors import ConfigError

    token = image_token_id(model_path)
    if token is None:
        if image_column:
            from batchgen.models.config import IMAGE_FAMILIES, is_image_text_name, no_images_reason

            arch = _architecture(model_path)
            if arch is not None and is_image_text_name(arch):
                raise ConfigError(
                    f"data.image_column={image_column!r}: {no_images_reason(arch, checkpoint_config(model_path))}"
                )
            raise ConfigError(
                f"data.image_column={image_column!r} but the model ({model_path}{', ' + arch if arch else ''}) "
                f"is not an image-text checkpoint batchgen runs ({IMAGE_FAMILIES}); unset data.image_column or "
                "choose such a model"
            )
        return {}
    if processor_kwargs:  # refused at the job's start, not at its first image
        try:
            image_side(
                model_path, (limit_mm_per_prompt or {}).get("image"), storage_options, processor_kwargs
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return {
        "image_column": image_column,
        "image_checkpoint": model_path,
        "max_images": (limit_mm_per_prompt or {}).get("image"),
        "storage_options": dict(storage_options or {}),
        "processor_kwargs": dict(processor_kwargs or {}),
        "image_base": base or None,
    }
