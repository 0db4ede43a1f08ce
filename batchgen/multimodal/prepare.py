"""Preparing image prompts for an engine, ahead of it and in worker threads: decoding, hashing and the
processor's pixel work release the GIL (Pillow, torch), so a batch of images is prepared on several cores while
nothing else waits. Used by the Python API and the job alike; a prompt whose images cannot be used gets its
error message instead of an :class:`~batchgen.multimodal.inputs.ImagePrompt`, never an exception."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
from batchgen.multimodal.images import ImageError
from batchgen.multimodal.inputs import ImagePrompt, ImagePrompts

_WORKERS = max(1, min(4, os.cpu_count() or 1))


def image_prompts_for(engine: Any, storage_options: dict[str, Any] | None = None) -> ImagePrompts | str:
    """The engine's image side (cached on the engine), or why its model takes no images."""
    cached = getattr(engine, "_image_prompts", None)
    if cached is not None:
        return cached
    model = engine.model
    if getattr(model, "images", None) is None:
        from batchgen.models.config import no_images_reason
        from batchgen.multimodal.rows import checkpoint_config

        return no_images_reason(model.config.architecture, checkpoint_config(str(engine.model_path)))
    from batchgen.multimodal.images import ImageLoader

    limit = (engine.config.limit_mm_per_prompt or {}).get("image")
    side = ImagePrompts(engine.model_path, model.image_token_id, max_images=limit)
    if storage_options:
        side.loader = ImageLoader(storage_options)
    engine._image_prompts = side
    return side


def prepare(
    side: ImagePrompts | str, items: Sequence[tuple[Sequence[int], Sequence[Any]]]
) -> list[ImagePrompt | str]:
    """``(token ids, images)`` per prompt -> its :class:`ImagePrompt`, or the error message (one line)."""
    if isinstance(side, str):
        return [side] * len(items)

    def one(item: tuple[Sequence[int], Sequence[Any]]) -> ImagePrompt | str:
        try:
            return side.build(item[0], item[1])
        except ImageError as e:
            return str(e)

    if len(items) <= 1:
        return [one(i) for i in items]
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="batchgen-images") as pool:
        return list(pool.map(one, items))


def error_output(
    request_id: str | int, token_ids: list[int], n: int, error: str, prompt: str | None
) -> RequestOutput:
    """The output of a prompt whose images cannot be used (it never reaches the engine)."""
    outs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error") for i in range(n)]
    return RequestOutput(request_id, list(token_ids), outs, 0, error, prompt)


def tokenize(tokenizer: Any) -> Callable[[str], list[int]]:
    return lambda text: list(tokenizer.encode(text))


def chat_prompts(
    engine: Any,
    conversations: Sequence[Sequence[Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[dict[str, Any]]:
    """Each conversation rendered by the processor's chat template as a prompt dict (token ids, text and
    its images); ValueError when the model takes no images or a message is malformed."""
    from batchgen.chat import render as render_text
    from batchgen.multimodal.chat import has_images, render, split_images

    side = image_prompts_for(engine)
    if isinstance(side, str):
        raise ValueError(side)
    prompts = []
    for conversation in conversations:
        if has_images(conversation):
            messages, images = split_images(conversation)
            text = render(
                side.processor,
                engine.tokenizer,
                messages,
                add_generation_prompt,
                chat_template,
                chat_template_kwargs,
            )
        else:
            images = []
            text = render_text(
                engine.tokenizer, conversation, add_generation_prompt, chat_template, chat_template_kwargs
            )
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False))  # the template wrote them
        prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        prompts.append(prompt)
    return prompts
