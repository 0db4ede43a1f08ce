"""What the :class:`~batchgen.LLM` methods take as a prompt, in vLLM's forms.

A prompt is a string, a list of token ids, a :class:`TextPrompt` (``{"prompt": text}``) or a
:class:`TokensPrompt` (``{"prompt_token_ids": ids}``, optionally with the ``"prompt"`` text they came from,
which is then reported as the output's ``prompt``). A call takes one prompt or a sequence of them, mixed freely.
:func:`parse_prompts` turns either into one :class:`ParsedPrompt` per prompt, in order, and rejects anything
else with a ``ValueError`` that names the prompt's index and what to pass instead. An empty prompt is not
rejected here: the engine fails it alone (its output's ``error``), as any prompt that cannot run.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text (tokenised with the model's tokenizer, special tokens added). ``multi_modal_data``:
    ``{"image": image_or_list}`` for an image-text model (an image is a PIL image, bytes, a path or a URL; the
    text holds the model's image placeholder once per image); ``mm_processor_kwargs``: the image processor's
    options for this prompt's images, over the engine's."""

    prompt: str
    multi_modal_data: NotRequired[dict]
    mm_processor_kwargs: NotRequired[dict]


class TokensPrompt(TypedDict):
    """A prompt as token ids, used as given; ``prompt``: the text they stand for (reported, never tokenised)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict]
    mm_processor_kwargs: NotRequired[dict]


Prompt = str | Sequence[int] | TextPrompt | TokensPrompt

_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


@dataclass(frozen=True)
class ParsedPrompt:
    """``token_ids`` is None for a text prompt (tokenised by the caller); ``text`` is None for token ids given
    without their text."""

    text: str | None
    token_ids: list[int] | None
    images: list | None = None
    """The prompt's images (``multi_modal_data["image"]``), None for a text-only prompt."""
    mm_processor_kwargs: dict | None = None
    """The image processor's options for this prompt's images (over the engine's ``mm_processor_kwargs``)."""

    @property
    def engine_prompt(self) -> str | list[int]:
        """What :meth:`LLMEngine.add_request` takes: the token ids when given, else the text."""
        return self.token_ids if self.token_ids is not None else self.text  # type: ignore[return-value]


def is_single_prompt(prompts: object) -> bool:
    """Whether ``prompts`` is one prompt rather than a sequence of prompts."""
    if isinstance(prompts, (str, Mapping)):
        return True
    if hasattr(prompts, "ndim") and not isinstance(prompts, Sequence):  # a numpy array or tensor of ids
        return prompts.ndim == 1  # type: ignore[union-attr]
    if isinstance(prompts, Sequence) and len(prompts) > 0:
        return isinstance(prompts[0], numbers.Integral)
    return False


def parse_prompts(prompts: Prompt | Sequence[Prompt]) -> list[ParsedPrompt]:
    """One :class:`ParsedPrompt` per prompt (a single prompt gives a list of one)."""
    items = [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[arg-type]
    return [_parse(i, p) for i, p in enumerate(items)]


def _parse(index: int, prompt: object) -> ParsedPrompt:
    if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
        data = prompt["multi_modal_data"]
        if not isinstance(data, Mapping) or any(k != "image" for k in data):
            raise ValueError(
                f"prompt {index}: 'multi_modal_data' must be {{'image': image_or_list}} (images are the only "
                "modality batchgen takes)"
            )
        from batchgen.multimodal.inputs import as_image_list

        options = prompt.get("mm_processor_kwargs")
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(
                f"prompt {index}: 'mm_processor_kwargs' must be a dict of the image processor's options, "
                f"got {type(options).__name__}"
            )
        rest = {k: v for k, v in prompt.items() if k not in ("multi_modal_data", "mm_processor_kwargs")}
        base = _parse(index, rest)
        images = as_image_list(data.get("image"))
        return ParsedPrompt(base.text, base.token_ids, images or None, dict(options) if options else None)
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, Mapping):
        unknown = sorted(str(k) for k in prompt if k not in _KEYS)
        if "mm_processor_kwargs" in prompt and "multi_modal_data" not in prompt:
            unknown = ["mm_processor_kwargs (only beside 'multi_modal_data')"]
        if unknown:
            raise ValueError(
                f"prompt {index}: unsupported key(s) {unknown}; a prompt dict takes 'prompt' (text) or "
                "'prompt_token_ids' (with an optional 'prompt' text)"
            )
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"prompt {index}: 'prompt' must be a string, got {type(text).__name__}")
            return ParsedPrompt(text, _token_ids(index, prompt["prompt_token_ids"], "'prompt_token_ids'"))
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"prompt {index}: 'prompt' must be a string, got {type(text).__name__}")
            return ParsedPrompt(text, None)
        raise ValueError(f"prompt {index}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    return ParsedPrompt(None, _token_ids(index, prompt, "a prompt"))


def _token_ids(index: int, ids: object, what: str) -> list[int]:
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence) and not hasattr(ids, "tolist"):
        raise ValueError(
            f"prompt {index}: {what} must be a string, a list of token ids or a prompt dict, "
            f"got {type(ids).__name__}"
        )
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # numpy arrays and tensors too
    if set(map(type, values)) <= {int}:  # the common case, checked at C speed
        return values
    bad = next((v for v in values if not isinstance(v, numbers.Integral) or isinstance(v, bool)), None)
    if bad is not None:
        raise ValueError(f"prompt {index}: token ids must be integers, got {bad!r} ({type(bad).__name__})")
    return [int(v) for v in values]
