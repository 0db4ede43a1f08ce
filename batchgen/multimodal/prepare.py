"""Preparing image prompts for an engine, ahead of it and in worker threads: decoding, hashing and the
processor's pixel work release the GIL (Pillow, torch), so images are prepared on other cores while the engine
runs. Used by the Python API (:func:`prepare_ahead` and :class:`PreparedInOrder`: an accelerator's engine starts
on the first prepared prompts and later ones are admitted as they become ready; a CPU engine first waits for the
prompts it has room for, :func:`shares_cores`) and the job (:func:`prepare`, in the window read-ahead thread)
alike; a prompt whose images cannot be used gets its error message instead of an
:class:`~batchgen.multimodal.inputs.ImagePrompt`, never an exception."""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from batchgen.driver import EngineRequest, Requests
from batchgen.engine.core.outputs import CompletionOutput, RequestOutput
from batchgen.multimodal.inputs import ImagePrompt, ImagePrompts

_WORKERS = max(1, min(4, os.cpu_count() or 1))


def image_prompts_for(
    engine: Any, storage_options: dict[str, Any] | None = None, processor_kwargs: dict[str, Any] | None = None
) -> ImagePrompts | str:
    """The engine's image side for the engine's ``mm_processor_kwargs`` updated with ``processor_kwargs`` (one
    per set of options, cached on the engine), or why its model takes no images. ValueError when the
    processor does not take one of the options."""
    options = {**engine.config.mm_processor_kwargs, **(processor_kwargs or {})}
    key = json.dumps(options, sort_keys=True, default=str)
    sides = engine.__dict__.setdefault("_image_prompts", {})
    cached = sides.get(key)
    if cached is not None:
        return cached
    model = engine.model
    if getattr(model, "images", None) is None:
        from batchgen.models.config import no_images_reason
        from batchgen.multimodal.rows import checkpoint_config

        return no_images_reason(model.config.architecture, checkpoint_config(str(engine.model_path)))
    from batchgen.multimodal.images import ImageLoader

    limit = (engine.config.limit_mm_per_prompt or {}).get("image")
    side = ImagePrompts(
        engine.model_path,
        model.image_token_id,
        max_images=limit,
        processor_kwargs=options,
    )
    if storage_options:
        side.loader = ImageLoader(storage_options)
    sides[key] = side
    return side


CHUNK = 8
"""Prompts per worker task: their images not processed yet go through the processor together
(:meth:`ImagePrompts.build_many`)."""

FIRST_CHUNK = 2
"""Prompts of :func:`prepare_ahead`'s first task when the engine runs beside the preparation (``ramp``); each
next task takes twice as many, up to :data:`CHUNK`: the engine starts on the first prompts ready instead of
waiting for a whole chunk's images."""


def chunk_bounds(n: int, ramp: bool = True) -> list[tuple[int, int]]:
    """``[lo, hi)`` of :func:`prepare_ahead`'s tasks over ``n`` items. ``ramp``: :data:`FIRST_CHUNK` items,
    then twice as many each time, up to :data:`CHUNK`. Else tasks of equal size (within one) up to
    :data:`CHUNK`, as many as a multiple of the worker threads, so that the workers finish together."""
    if not ramp:
        tasks = -(-n // CHUNK)
        tasks = -(-tasks // _WORKERS) * _WORKERS
        return [
            (n * k // tasks, n * (k + 1) // tasks)
            for k in range(tasks)
            if n * k // tasks < n * (k + 1) // tasks
        ]
    out, lo, size = [], 0, min(FIRST_CHUNK, CHUNK)
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo, size = lo + size, min(CHUNK, size * 2)
    return out


def shares_cores(engine: Any) -> bool:
    """Whether ``engine`` computes on the cores the preparing threads run on (the CPU device): then the two
    teams of threads slow each other (the engine's parallel regions wait for a thread whose core a preparing
    thread holds), and the engine waits for the images of the requests it has room for instead of stepping
    beside their preparation (:func:`engine_busy`), which is split evenly over the workers."""
    return engine.device.type == "cpu"


def prepare_many(
    side: ImagePrompts | str, items: Sequence[tuple[Sequence[int], Sequence[Any]]]
) -> list[ImagePrompt | str]:
    """``(token ids, images)`` per prompt -> its :class:`ImagePrompt`, or the error message (one line), in
    the calling thread."""
    if isinstance(side, str):
        return [side] * len(items)
    return side.build_many(items)


def source_key(images: Sequence[Any]) -> tuple[str, ...]:
    """What identifies a prompt's images before they are read: a path or URL by its text, any other value (bytes,
    a ``PIL.Image``) by the object itself; a datasets Image value by its bytes, else its path, as the loader reads
    it. Prompts with equal keys show the same images."""
    keys = []
    for image in images:
        if isinstance(image, Mapping):
            image = image.get("bytes") if image.get("bytes") is not None else image.get("path")
        keys.append(image if isinstance(image, str) else f"\0{id(image)}")
    return tuple(keys)


def by_images(images: Sequence[Sequence[Any]]) -> list[int]:
    """Indices of the prompts with ``images``, stably ordered by :func:`source_key`: prompts showing the same
    images side by side, so that each worker's task holds whole sets of them (a worker never waits for an image
    another one is processing, and the workers' shares of distinct images are even)."""
    keys = [source_key(im) for im in images]
    return sorted(range(len(keys)), key=keys.__getitem__)


def prepare(
    side: ImagePrompts | str, items: Sequence[tuple[Sequence[int], Sequence[Any]]]
) -> list[ImagePrompt | str]:
    """:func:`prepare_many` in worker threads, in tasks of up to :data:`CHUNK` prompts, prompts showing the
    same images in the same task (:func:`by_images`); results in the order of ``items``."""
    order = by_images([images for _, images in items])
    bounds = chunk_bounds(len(items), ramp=False)
    if len(bounds) <= 1:
        return prepare_many(side, items)
    chunks = [[items[order[i]] for i in range(lo, hi)] for lo, hi in bounds]
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="batchgen-images") as pool:
        done = [r for part in pool.map(lambda c: prepare_many(side, c), chunks) for r in part]
    out: list[ImagePrompt | str] = [""] * len(items)
    for i, r in zip(order, done):
        out[i] = r
    return out


T = TypeVar("T")


def prepare_ahead(
    make_many: Callable[[list[Any]], list[T]],
    args: Sequence[Any],
    ramp: bool = True,
    order: Sequence[int] | None = None,
) -> list[Future[T]]:
    """``make_many(chunk)`` over the chunks of ``args`` (:func:`chunk_bounds` with ``ramp``) in worker threads,
    started now in order: one future per item, in order (cancelling one before its chunk starts skips the chunk
    once all of its items are cancelled). ``order``: a permutation of the items' indices to chunk them in
    instead (:func:`by_images`). The threads end once the last chunk is done (nothing waits for them here)."""
    futures: list[Future[T]] = [Future() for _ in args]
    order = list(range(len(args))) if order is None else list(order)

    def run(lo: int, hi: int) -> None:
        part = [futures[i] for i in order[lo:hi]]
        if not any([f.set_running_or_notify_cancel() for f in part]):  # each one: running now, or cancelled
            return
        try:
            results = make_many([args[i] for i in order[lo:hi]])
        except BaseException as e:
            for f in part:
                if not f.cancelled():
                    f.set_exception(e)
            return
        for f, r in zip(part, results):
            if not f.cancelled():
                f.set_result(r)

    pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="batchgen-images")
    try:
        for lo, hi in chunk_bounds(len(args), ramp):
            pool.submit(run, lo, hi)
    finally:
        pool.shutdown(wait=False)
    return futures


def engine_busy(engine: Any) -> Callable[[], bool]:
    """When :class:`PreparedInOrder` lets ``engine`` step instead of waiting for the next prompt's images:
    whenever it has work, so its steps overlap the preparing threads; when it :func:`shares_cores` with them,
    once it holds as many requests as it has room for (``max_num_seqs``)."""
    if not shares_cores(engine):
        return engine.has_unfinished
    room = engine.config.max_num_seqs
    return lambda: engine.num_unfinished() >= room


class PreparedInOrder(Requests):
    """A driver task (:class:`batchgen.driver.Requests`) over requests known up front, some still being prepared
    (a future of the request, or of the error output of a prompt whose images cannot be used): supplied in
    the given order as each becomes ready. The next one is waited for only when ``engine_busy()`` is false
    (:func:`engine_busy`), so preparation overlaps the engine's steps. An error output is handed to
    ``on_finished`` when its turn comes, and never reaches the engine."""

    def __init__(
        self,
        entries: Sequence[EngineRequest | Future],
        on_finished: Callable[[list[RequestOutput]], None],
        engine_busy: Callable[[], bool],
    ) -> None:
        super().__init__([], on_finished)
        self.queue: deque[EngineRequest | Future] = deque(entries)  # type: ignore[assignment]
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
