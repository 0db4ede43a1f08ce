"""Preparing image prompts for an engine, ahead of it and in worker threads: decoding, hashing and the
processor's pixel work release the GIL (Pillow, torch), so images are prepared on other cores while the engine
runs. Used by the Python API (:func:`prepare_ahead` and :class:`PreparedInOrder`: the engine starts on the first
prepared prompts and later ones are admitted as they become ready) and the job (:func:`prepare`, in the
window read-ahead thread) alike; a prompt whose images cannot be used gets its error message instead of an
:class:`~batchgen.multimodal.inputs.ImagePrompt`, never an exception."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from batchgen.driver import EngineRequest
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

        return no_images_reason(model.config.architecture)
    from batchgen.multimodal.images import ImageLoader

    limit = (engine.config.limit_mm_per_prompt or {}).get("image")
    side = ImagePrompts(engine.model_path, model.image_token_id, max_images=limit)
    if storage_options:
        side.loader = ImageLoader(storage_options)
    engine._image_prompts = side
    return side


def prepare_one(
    side: ImagePrompts | str, token_ids: Sequence[int], images: Sequence[Any]
) -> ImagePrompt | str:
    """One prompt's :class:`ImagePrompt`, or the error message (one line)."""
    if isinstance(side, str):
        return side
    try:
        return side.build(token_ids, images)
    except ImageError as e:
        return str(e)


def prepare(
    side: ImagePrompts | str, items: Sequence[tuple[Sequence[int], Sequence[Any]]]
) -> list[ImagePrompt | str]:
    """``(token ids, images)`` per prompt -> its :class:`ImagePrompt`, or the error message (one line)."""

    def one(item: tuple[Sequence[int], Sequence[Any]]) -> ImagePrompt | str:
        return prepare_one(side, item[0], item[1])

    if len(items) <= 1:
        return [one(i) for i in items]
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="batchgen-images") as pool:
        return list(pool.map(one, items))


T = TypeVar("T")


def prepare_ahead(make: Callable[..., T], args: Sequence[tuple[Any, ...]]) -> list[Future[T]]:
    """``make(*a)`` for each ``a`` of ``args`` in worker threads, started now in order; their futures. The
    threads end once the last one is done (nothing waits for them here)."""
    pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="batchgen-images")
    try:
        return [pool.submit(make, *a) for a in args]
    finally:
        pool.shutdown(wait=False)


class PreparedInOrder:
    """A driver task (:class:`batchgen.driver.Task`) over requests known up front, some still being prepared
    (a future of the request, or of the error output of a prompt whose images cannot be used): supplied in
    the given order as each becomes ready. The next one is waited for only when ``engine_busy()`` says the
    engine has nothing to run, so preparation overlaps the engine's steps. An error output is handed to
    ``on_finished`` when its turn comes, and never reaches the engine."""

    def __init__(
        self,
        entries: Sequence[EngineRequest | Future],
        on_finished: Callable[[list[RequestOutput]], None],
        engine_busy: Callable[[], bool],
    ) -> None:
        self.queue: deque[EngineRequest | Future] = deque(entries)
        self.on_finished = on_finished
        self.engine_busy = engine_busy

    def next_request(self) -> EngineRequest | None:
        while self.queue:
            head = self.queue[0]
            if isinstance(head, Future):
                if not head.done() and self.engine_busy():
                    return None  # the engine steps meanwhile
                head = head.result()
            self.queue.popleft()
            if isinstance(head, RequestOutput):
                self.on_finished([head])
                continue
            return head
        return None

    def finish(self, outputs: list[RequestOutput]) -> None:
        self.on_finished(outputs)

    def cancel(self) -> None:
        """Cancel the preparations not started yet (the generate call is being left)."""
        for entry in self.queue:
            if isinstance(entry, Future):
                entry.cancel()


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
