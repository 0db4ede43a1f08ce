"""Chat messages with OpenAI image parts, rendered by the checkpoint's own processor chat template.

A message's ``content`` is a string or a list of parts, as vLLM takes them: ``{"type": "text", "text": ...}``
(or ``"input_text"``), ``{"type": "image_url", "image_url": {"url": ...}}`` (or ``"image_url": "..."``; any URL
or path :class:`~batchgen.multimodal.images.ImageLoader` reads, ``data:`` included), ``{"type": "input_image",
"image_url": ...}`` (the Responses API's), ``{"type": "image_pil", "image_pil": <PIL image>}`` and ``{"type":
"image", "image": ...}`` (a PIL image, bytes, a path or a URL) or, as transformers' chat templates take it,
``{"type": "image", "url" | "path" | "base64": ...}``; a part without ``type`` is typed by its one key
(``{"image_url": "..."}``). :func:`split_images` turns image parts into the ``{"type":
"image"}`` parts Hugging Face chat templates expect and returns the images in prompt order; the template puts
the model's image placeholder where each one was.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_IMAGE_TYPES = ("image_url", "image", "input_image", "image_pil")
_TEXT_TYPES = ("text", "input_text")
_IMAGE_KEY = {"input_image": "image_url"}
"""The key holding a part's image when it is not the part's type."""


def part_type(part: Mapping[str, Any]) -> str:
    """A part's type: its ``type``, else the image key it has (vLLM's untyped ``{"image_url": ...}``), else
    text."""
    kind = part.get("type")
    if kind is not None:
        return str(kind)
    return next((k for k in _IMAGE_TYPES if part.get(k) is not None), "text")


def _parts(content: Any) -> list[Any] | None:
    if hasattr(content, "tolist") and not isinstance(content, (str, Mapping)):
        content = content.tolist()
    if isinstance(content, str) or not isinstance(content, Sequence):
        return None
    out = []
    for part in content:
        if isinstance(part, str) and part.lstrip().startswith("{"):
            part = json.loads(part)
        out.append(part)
    return out


def has_images(messages: Any) -> bool:
    """Whether any message of the conversation has an image part."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return False
    for m in messages:
        parts = _parts(m.get("content")) if isinstance(m, Mapping) else None
        if parts and any(isinstance(p, Mapping) and part_type(p) in _IMAGE_TYPES for p in parts):
            return True
    return False


def split_images(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(messages with image parts as {"type": "image"}, the images in order)``; ValueError naming the message
    and part when a part is malformed."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        msg = {k: v for k, v in m.items() if v is not None}
        parts = _parts(m.get("content"))
        if parts is not None:
            content = []
            for j, part in enumerate(parts):
                if isinstance(part, str):
                    part = {"type": "text", "text": part}
                if not isinstance(part, Mapping):
                    raise ValueError(f"messages[{i}].content[{j}] must be a {{type, ...}} object")
                kind = part_type(part)
                if kind in _TEXT_TYPES:
                    content.append({"type": "text", "text": part.get("text")})
                elif kind in _IMAGE_TYPES:
                    images.append(_image_of(part, kind, i, j))
                    content.append({"type": "image"})
                else:
                    raise ValueError(
                        f"messages[{i}].content[{j}] has type {kind!r}; text and image parts are supported"
                    )
            msg["content"] = content
        out.append(msg)
    return out, images


_HF_IMAGE_KEYS = ("url", "path", "base64")
"""Where transformers' chat format puts a ``{"type": "image"}`` part's image (``base64``: the payload alone)."""


def _image_of(part: Mapping[str, Any], kind: str, i: int, j: int) -> Any:
    value = part.get(_IMAGE_KEY.get(kind, kind))
    if kind in ("image_url", "input_image") and isinstance(value, Mapping):
        value = value.get("url")
    if kind == "image" and value is None:
        key = next((k for k in _HF_IMAGE_KEYS if part.get(k) is not None), None)
        value = part.get(key) if key else None
        if key == "base64" and isinstance(value, str) and not value.startswith("data:"):
            value = "data:image;base64," + value
    if value is None or (isinstance(value, str) and not value):
        raise ValueError(f"messages[{i}].content[{j}] ({kind}) has no image")
    return value


def render(
    processor: Any,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The conversation (image parts already split) rendered by the processor's chat template, else the
    tokenizer's."""
    own = hasattr(processor, "apply_chat_template")  # an image processor alone has no template
    owner = processor if own and (getattr(processor, "chat_template", None) or chat_template) else tokenizer
    return owner.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **dict(chat_template_kwargs or {}),
    )
