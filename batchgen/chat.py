"""Chat messages: OpenAI content parts, and rendering conversations with the tokenizer's chat template.

A message's ``content`` is a string, or (the OpenAI form) a list of parts ``{"type": "text", "text": ...}``;
text parts are joined with newlines (vLLM's "string" content format) before the chat template sees them. Other
part types (images, audio) are not supported by a text-only engine and are rejected with a clear message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string as is, or the newline-joined ``text`` of its OpenAI
    ``{type: text, text: ...}`` parts. Raises ValueError (with the reason) for anything else."""
    if isinstance(content, str):
        return content
    if hasattr(content, "tolist") and not isinstance(content, Mapping):  # numpy arrays from Parquet lists
        content = content.tolist()
    if isinstance(content, Mapping) or not isinstance(content, Sequence) or isinstance(content, bytes):
        # (a list of {type: text, text} parts is the other accepted form)
        raise ValueError(f"content must be a string, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            part = json.loads(part) if part.lstrip().startswith("{") else {"type": "text", "text": part}
        if not isinstance(part, Mapping):
            raise ValueError(f"content[{j}] must be a {{type, text}} object, got {type(part).__name__}")
        kind = part.get("type", "text")
        if kind != "text":
            raise ValueError(f"content[{j}] has type {kind!r}; only 'text' parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content[{j}].text must be a string, got {type(text).__name__}")
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with every ``content`` a string (parts joined) and null keys dropped; ValueError if invalid."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(
                f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}"
            )
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        try:
            text = content_text(m.get("content"))
        except ValueError as e:
            raise ValueError(f"messages[{i}].{e}") from None
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = text
        out.append(msg)
    return out


def render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The conversation rendered as prompt text by the tokenizer's chat template (or ``chat_template``)."""
    return tokenizer.apply_chat_template(
        normalize_messages(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **dict(chat_template_kwargs or {}),
    )
