"""A prompt and its images -> the engine's inputs, with the checkpoint's own processor.

:class:`ImagePrompts` loads the checkpoint's processor once (``AutoProcessor``; without torchvision
transformers falls back to its PIL image processors, and a processor class that needs torchvision, as
Qwen2-VL's does, is replaced by its image processor and the tokenizer). For each prompt it

- reads every image (:class:`~batchgen.multimodal.images.ImageLoader`: any source) and hashes its bytes,
- decodes it and runs the processor's pixel work once per distinct image (cached by content hash, so an image
  shown by many rows is decoded and preprocessed once while it stays in the small LRU),
- finds the image placeholders in the prompt's token ids (one ``<image>`` token per image, as in vLLM; a run
  already expanded to the image's length counts as one, and so does an image's whole expansion where the
  processor writes text tokens among its feature tokens, as Idefics3's does) and expands each to the image's
  number of feature tokens, exactly as the processor does.

Every failure is an :class:`~batchgen.multimodal.images.ImageError` naming the image's index and the reason:
a bad image (one the processor refuses included: its size, its shape), more images than ``limit_mm_per_prompt``
allows, or a placeholder count that differs from the number of images. ``processor_kwargs``
(``engine.mm_processor_kwargs``) go to every processor call, as keyword arguments of transformers' processor
call; a key the image processor does not declare is a ValueError when :class:`ImagePrompts` is built.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only when an image is processed (the CLI decides threads before torch)
    from torch import Tensor

from batchgen.multimodal.images import EncodedImage, ImageError, ImageLoader, LoadedImage, is_pixel_array
from batchgen.multimodal.joins import joins_for


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt, ready for the engine: content hash, the processor's tensors for this image
    (``pixel_values`` ...), and where its ``num_tokens`` placeholder positions are in the token ids:
    ``start .. start + num_tokens - 1``, or ``start + o`` for each ``o`` of ``offsets`` when the processor
    interleaves them with text tokens (Idefics3's tile rows)."""

    hash: str
    pixels: dict[str, Tensor]
    start: int
    num_tokens: int
    offsets: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Processed:
    """One image through the processor: its tensors, and the token ids its placeholder becomes (``offsets``:
    where the image's feature tokens are among them; None when they are all feature tokens)."""

    pixels: dict[str, Tensor]
    expansion: tuple[int, ...]
    offsets: tuple[int, ...] | None


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's token ids with every image placeholder expanded, and its images in prompt order."""

    token_ids: list[int]
    images: list[ImageItem]


_CALL_OWNED = frozenset({"return_tensors", "device", "data_format", "input_data_format"})
"""Processor options batchgen sets itself (the tensors' type and layout), never taken from the user."""


def processor_kwargs_error(processor: Any, kwargs: dict[str, Any]) -> str | None:
    """Why ``kwargs`` cannot go to ``processor``'s image calls (an option its image processor does not declare,
    or one batchgen sets itself), or None. A processor that declares no options is not checked here: its first
    call refuses an unknown one."""
    image_processor = getattr(processor, "image_processor", processor)
    declared = set(getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", None) or ())
    owned = sorted(set(kwargs) & _CALL_OWNED)
    if owned:
        return f"engine.mm_processor_kwargs: batchgen sets {', '.join(map(repr, owned))} itself; remove it"
    unknown = sorted(set(kwargs) - declared) if declared else []
    if unknown:
        takes = ", ".join(sorted(declared - _CALL_OWNED))
        return (
            f"engine.mm_processor_kwargs: {type(image_processor).__name__} takes no option "
            f"{', '.join(map(repr, unknown))} (it takes: {takes})"
        )
    return None


def as_image_list(value: Any) -> list[Any]:
    """``multi_modal_data["image"]``: one image or a list/tuple of them (a datasets Image dict is one, and so is
    a numpy array of pixels)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if is_pixel_array(value):
        return [value]
    if hasattr(value, "tolist") and not hasattr(value, "convert"):  # a numpy array of values from Parquet
        return list(value.tolist())
    return [value]


class ImagePrompts:
    """The image side of one image-text checkpoint (thread-safe: prompts may be prepared in worker threads)."""

    def __init__(
        self,
        checkpoint: str,
        image_token_id: int,
        max_images: int | None = None,
        loader: ImageLoader | None = None,
        cache_items: int = 512,
        processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the torchvision fallback warning: PIL processors are intended here
        try:
            try:
                self.processor = AutoProcessor.from_pretrained(checkpoint)
            except ImportError:  # a processor class that needs torchvision (Qwen2-VL's): its image processor
                self.processor = AutoImageProcessor.from_pretrained(checkpoint)
        finally:
            hf_logging.set_verbosity(verbosity)
        image_processor = getattr(self.processor, "image_processor", self.processor)
        self.image_processor = image_processor
        self.converts_rgb = bool(getattr(image_processor, "do_convert_rgb", None))
        """The image processor converts images to RGB itself: it is given each image as opened (transformers'
        conversion, and a processor's own loading, Idefics2's, apply as they do); else the loader's RGB image."""
        self.processor_kwargs = dict(processor_kwargs or {})
        problem = processor_kwargs_error(self.processor, self.processor_kwargs)
        if problem is not None:
            raise ValueError(problem)
        self._options_key = (
            json.dumps(self.processor_kwargs, sort_keys=True, default=str).encode()
            if self.processor_kwargs
            else None
        )
        """Mixed into each item's key when options are set (:meth:`item_key`)."""
        # dynamic resolution (Qwen2-VL): an image's tokens are its grid of patches merged merge_size x merge_size
        dynamic = "image_grid_thw" in getattr(image_processor, "model_input_names", ())
        self.merge_size: int | None = int(image_processor.merge_size) if dynamic else None
        if not hasattr(self.processor, "tokenizer"):
            self.processor.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        tok = self.processor.tokenizer
        self.feature_token_id = image_token_id
        # the prompt's placeholder: the feature token, or the processor's own (Gemma 3: <start_of_image>), or
        # the one its chat template writes where the processor's image_token is the feature token (Qianfan-OCR)
        placeholder = getattr(self.processor, "image_placeholder_token", None)
        if not isinstance(placeholder, str):
            placeholder = getattr(self.processor, "image_token", None)
        placeholder_id = tok.convert_tokens_to_ids(placeholder) if isinstance(placeholder, str) else None
        if not isinstance(placeholder_id, int) or placeholder_id == tok.unk_token_id:
            placeholder_id = image_token_id
        self.image_token_id = placeholder_id
        self.image_token = tok.convert_ids_to_tokens(placeholder_id)
        self.max_images = max_images
        # full-scale decoding: the processor resizes from the original pixels, as transformers does
        self.loader = loader or ImageLoader()
        self._pixels: OrderedDict[str, _Processed] = OrderedDict()
        with_specials = list(tok(self.image_token, add_special_tokens=True)["input_ids"])
        at = with_specials.index(placeholder_id) if placeholder_id in with_specials else 0
        self._specials = (with_specials[:at], with_specials[at + 1 :])  # what the tokenizer adds around text
        self._cache_items = cache_items
        self._lock = threading.Lock()
        self._text_edges = False
        """The processor writes text around an image's tokens (Gemma 3's ``\\n\\n``): the tokenizer may merge
        it with the prompt's text next to it, so a prompt with images is tokenized again as a whole."""
        self.joins = joins_for(self.processor)
        self._busy: dict[str, threading.Event] = {}  # hash -> set when the thread processing it is done
        query = getattr(self.processor, "num_query_tokens", None)
        self.prefix_tokens: int | None = int(query) if isinstance(query, int) else None
        """The processor puts the image's tokens before the whole prompt, which names no place for it (BLIP-2's:
        one image, ``num_query_tokens`` tokens): a prompt without a placeholder gets one in front."""
        self.fixed_size = type(self.processor).__name__ == "LlavaProcessor" and bool(
            self.processor_kwargs.get("do_center_crop", getattr(image_processor, "do_center_crop", False))
        )
        """Every image becomes pixels of one shape and one run of placeholder tokens, each image processed on
        its own inside a processor call (LLaVA 1.5's processor: resize, center crop): :meth:`build_many` then
        processes many images in one call, which costs far less than one call each."""
        self._fixed_expansion: _Processed | None = None
        """With :attr:`fixed_size` and no processor options: the first image's result, whose expansion every
        image shares; later images go through the image processor alone (the processor's call would only
        tokenize and expand the same placeholder again)."""

    def load(self, images: Sequence[Any]) -> list[EncodedImage | LoadedImage]:
        """Read and hash each image (decoding waits for :meth:`pixels`, which skips it for an image processed
        already); ImageError naming the first bad one's index."""
        if self.max_images is not None and len(images) > self.max_images:
            raise ImageError(
                f"{len(images)} images but the model takes at most {self.max_images} per prompt "
                "(engine.limit_mm_per_prompt)"
            )
        out = []
        for i, src in enumerate(images):
            try:
                out.append(self.loader.read(src))
            except ImageError as e:
                raise ImageError(f"image {i}: {e}") from None
        return out

    def pixels(self, image: EncodedImage | LoadedImage) -> _Processed:
        """The processor's tensors for one image and what its placeholder expands to, cached by hash: an
        image processed already is neither decoded nor processed again, and threads asking for the same
        image at once wait for the first one's work. ImageError when the image cannot be decoded."""
        with self._lock:
            hit = self._pixels.get(image.hash)
            if hit is not None:
                self._pixels.move_to_end(image.hash)
                return hit
            busy = self._busy.get(image.hash)
            if busy is None:
                self._busy[image.hash] = threading.Event()
        if busy is not None:  # another thread is processing this image: its result, unless it failed
            busy.wait()
            with self._lock:
                hit = self._pixels.get(image.hash)
            return hit if hit is not None else self._process(image)
        try:
            done = self._process(image)
            with self._lock:
                self._pixels[image.hash] = done
                while len(self._pixels) > self._cache_items:
                    self._pixels.popitem(last=False)
            return done
        finally:
            with self._lock:
                self._busy.pop(image.hash).set()

    def _process(self, image: EncodedImage | LoadedImage) -> _Processed:
        if isinstance(image, EncodedImage):
            image = self.loader.decode(image.data, image.name, image.hash)
        try:
            return self._run_processor(image)
        except ImageError:
            raise
        except Exception as e:  # noqa: BLE001 - the processor's own refusal of this image (its size, its shape)
            raise processor_error(image, e) from None

    def _run_processor(self, image: LoadedImage) -> _Processed:
        if self.merge_size is not None:  # an image processor alone (dynamic resolution): merged patches
            enc = self.image_processor(
                images=[self._pil(image)], return_tensors="pt", **self.processor_kwargs
            )
            grid = enc["image_grid_thw"][0]
            n = int(grid.prod()) // self.merge_size**2
            pixels = {"pixel_values": enc["pixel_values"], "image_grid_thw": grid}
            return _Processed(pixels, (self.feature_token_id,) * n, None)
        if self.prefix_tokens is not None:  # the image processor's pixels; the tokens the processor prepends
            enc = self.image_processor(
                images=[self._pil(image)], return_tensors="pt", **self.processor_kwargs
            )
            pixels = {k: v[0] for k, v in enc.items()}
            return _Processed(pixels, (self.feature_token_id,) * self.prefix_tokens, None)
        enc = self.processor(
            text=[self.image_token], images=[self._pil(image)], return_tensors="pt", **self.processor_kwargs
        )
        return self._processed(enc, 0)

    def _pil(self, image: LoadedImage) -> Any:
        """The PIL image the processor is given (see :attr:`converts_rgb`)."""
        return image.opened if self.converts_rgb and image.opened is not None else image.image

    def _processed(self, enc: Any, row: int) -> _Processed:
        """Row ``row`` of the processor's output for ``[image_token] * n`` and n images."""
        ids = enc["input_ids"][row].tolist()
        head, tail = self._specials
        if head and ids[: len(head)] == head:
            ids = ids[len(head) :]
        if tail and ids[-len(tail) :] == tail:
            ids = ids[: -len(tail)]
        offsets = tuple(i for i, t in enumerate(ids) if t == self.feature_token_id)
        pure = len(offsets) == len(ids)
        added = self.processor.tokenizer.added_tokens_decoder  # never merged with text next to them
        if ids and (ids[0] not in added or ids[-1] not in added):
            self._text_edges = True
        rows = len(enc["input_ids"])
        # a processor that flattens an image's tiles into the batch axis (Aya Vision's): one image per call
        pixels = {
            k: v if rows == 1 and v.dim() and v.shape[0] != 1 else v[row]
            for k, v in enc.items()
            if k not in ("input_ids", "attention_mask")
        }
        return _Processed(pixels, tuple(ids), None if pure else offsets)

    def _process_together(self, images: list[EncodedImage | LoadedImage]) -> None:
        """Decode ``images`` and run them through one processor call (:attr:`fixed_size` processors), caching
        each one's result; an image that cannot be decoded is left out, and all are when the processor refuses
        the call (:meth:`pixels` names each one's error)."""
        decoded = []
        for image in images:
            try:
                decoded.append(
                    self.loader.decode(image.data, image.name, image.hash)
                    if isinstance(image, EncodedImage)
                    else image
                )
            except ImageError:
                pass
        if not decoded:
            return
        fixed = self._fixed_expansion
        try:
            if fixed is not None:  # the pixels alone: what the processor's call adds is the same expansion
                enc = self.image_processor(images=[self._pil(d) for d in decoded], return_tensors="pt")
            else:
                enc = self.processor(
                    text=[self.image_token] * len(decoded),
                    images=[self._pil(d) for d in decoded],
                    return_tensors="pt",
                    **self.processor_kwargs,
                )
        except Exception:  # noqa: BLE001 - an image the processor refuses: each one alone names its error
            return
        if fixed is not None:
            done = [
                _Processed({k: v[row] for k, v in enc.items()}, fixed.expansion, fixed.offsets)
                for row in range(len(decoded))
            ]
        else:
            done = [self._processed(enc, row) for row in range(len(decoded))]
            if not self.processor_kwargs:
                self._fixed_expansion = done[0]
        with self._lock:
            for image, result in zip(decoded, done):
                self._pixels[image.hash] = result
            while len(self._pixels) > self._cache_items:
                self._pixels.popitem(last=False)

    def build_many(self, items: Sequence[tuple[Sequence[int], Sequence[Any]]]) -> list[ImagePrompt | str]:
        """:meth:`build` for each ``(token ids, images)``, or its error message; with a :attr:`fixed_size`
        processor the images not processed yet are processed together first."""
        loaded: list[list[EncodedImage | LoadedImage] | str] = []
        for _, images in items:
            try:
                loaded.append(self.load(images))
            except ImageError as e:
                loaded.append(str(e))
        if self.fixed_size:
            todo: dict[str, EncodedImage | LoadedImage] = {}
            with self._lock:
                for images in loaded:
                    for image in images if isinstance(images, list) else ():
                        if image.hash not in self._pixels and image.hash not in self._busy:
                            todo.setdefault(image.hash, image)
                            self._busy[image.hash] = threading.Event()  # other threads wait for it
            try:
                self._process_together(list(todo.values()))
            finally:
                with self._lock:
                    for h in todo:
                        self._busy.pop(h).set()
        out: list[ImagePrompt | str] = []
        for (token_ids, _), images in zip(items, loaded):
            try:
                out.append(images if isinstance(images, str) else self._prompt(token_ids, images))
            except ImageError as e:
                out.append(str(e))
        return out

    def build(self, token_ids: Sequence[int], images: Sequence[Any]) -> ImagePrompt:
        """Expand ``token_ids``' placeholders for ``images``; ImageError when they do not fit together."""
        return self._prompt(token_ids, self.load(images))

    def _prompt(self, token_ids: Sequence[int], loaded: list[EncodedImage | LoadedImage]) -> ImagePrompt:
        if self.image_token_id != self.feature_token_id and self.feature_token_id in token_ids:
            return self._placed(list(token_ids), loaded)  # expanded already (the processor's own ids)
        if self.prefix_tokens is not None and loaded:
            if len(loaded) > 1:
                raise ImageError(f"{len(loaded)} images but the model takes one per prompt")
            if self.image_token_id not in token_ids:
                token_ids = [self.image_token_id, *token_ids]
        prompt = self._build(token_ids, loaded)
        if not (prompt.images and self._text_edges):
            return prompt
        # tokenized again as one text, as the processor tokenizes it
        tok = self.processor.tokenizer
        text = tok.decode(prompt.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._placed(list(tok(text, add_special_tokens=False)["input_ids"]), loaded)

    def _all_pixels(self, loaded: list[EncodedImage | LoadedImage]) -> list[_Processed]:
        """:meth:`pixels` of each image, in order: the first bad one is named by its index."""
        processed = []
        for i, image in enumerate(loaded):
            try:
                processed.append(self.pixels(image))
            except ImageError as e:
                raise ImageError(f"image {i}: {e}") from None
        return processed

    def item_key(self, content_hash: str) -> str:
        """An image's key for the engine (encoder cache, prefix-cache blocks): its content hash, with the
        processor options mixed in when there are any, so an image's features under two sets of options are
        never mixed."""
        if self._options_key is None:
            return content_hash
        return hashlib.sha256(content_hash.encode() + b"\0" + self._options_key).hexdigest()

    def _placed(self, ids: list[int], loaded: list[EncodedImage | LoadedImage]) -> ImagePrompt:
        """``ids`` whose images are expanded already: each image's feature tokens are the next runs of them
        whose lengths add up to its token count (one run, or one per crop or tile when the processor writes
        text between them: Gemma 3's pan and scan); ImageError when the runs do not match the images."""
        runs = _placeholder_runs(ids, self.feature_token_id)
        done = self._all_pixels(loaded)
        counts = [len(d.expansion) if d.offsets is None else len(d.offsets) for d in done]
        items, k = [], 0
        for image, d, count in zip(loaded, done, counts):
            first, taken = k, 0
            while k < len(runs) and taken < count:
                taken += runs[k][1]
                k += 1
            if taken != count:
                break
            start = runs[first][0]
            offsets = None
            if k - first > 1:
                offsets = tuple(p - start for at, n in runs[first:k] for p in range(at, at + n))
            items.append(ImageItem(self.item_key(image.hash), d.pixels, start, count, offsets))
        if len(items) != len(loaded) or k != len(runs):
            raise ImageError(
                f"the prompt's image tokens (runs of {[n for _, n in runs]}) do not match its {len(loaded)} "
                f"image(s) ({counts} tokens): put one {self.image_token!r} in the prompt where each image goes"
            )
        return ImagePrompt(ids, items)

    def _build(self, token_ids: Sequence[int], loaded: list[EncodedImage | LoadedImage]) -> ImagePrompt:
        """Each placeholder replaced by its image's expansion, images in order. An expansion the ids hold in
        full already (:func:`_given_expansion`: the processor's own ids) stands for its image's placeholder
        and is kept as it is. ImageError as soon as a placeholder has no image left, or when images are left
        over."""
        processed = self._all_pixels(loaded)
        ids = list(token_ids)
        out: list[int] = []
        items: list[ImageItem] = []
        pos = 0  # ids[:pos] are in out
        joined = False  # the processor's joins apply to the text after the last image (not after a given one)
        for start, length in _placeholder_runs(ids, self.image_token_id):
            at, run_end = start, start + length
            while at < run_end:  # runs inside an expansion given already are skipped (at < pos)
                if at < pos:
                    at = pos
                    continue
                if len(items) == len(loaded):
                    raise ImageError(
                        f"the prompt has more image placeholder(s) ({self.image_token!r}) than the "
                        f"{len(loaded)} image(s) given"
                    )
                image, done = loaded[len(items)], processed[len(items)]
                n = len(done.expansion) if done.offsets is None else len(done.offsets)
                later = [len(d.expansion) for d in processed[len(items) + 1 :]]
                given = _given_expansion(ids, pos, at, run_end, done, later)
                begin, end = given or (at, at + 1)
                text = ids[pos:begin]
                out.extend(self.joins.text_after(text) if joined else text)
                verbatim = given is not None and done.offsets is not None
                expansion = done.expansion if verbatim else self.joins.expansion(out, done.expansion)
                skip = len(done.expansion) - len(expansion)
                offsets = None if done.offsets is None else tuple(o - skip for o in done.offsets)
                items.append(ImageItem(self.item_key(image.hash), done.pixels, len(out), n, offsets))
                out.extend(expansion)
                joined = not verbatim
                pos = at = end
        if len(items) != len(loaded):
            raise ImageError(
                f"the prompt has {len(items)} image placeholder(s) ({self.image_token!r}) but {len(loaded)} "
                f"image(s) were given: put one {self.image_token!r} in the prompt where each image goes"
            )
        rest = ids[pos:]
        out.extend(self.joins.text_after(rest) if joined else rest)
        return ImagePrompt(out, items)


def _given_expansion(
    ids: list[int], pos: int, at: int, run_end: int, done: _Processed, later: list[int]
) -> tuple[int, int] | None:
    """``(begin, end)`` of ``done``'s whole expansion where ``ids`` hold it already around the placeholder at
    ``at`` (none of it before ``pos``), or None (``at`` is one placeholder). An expansion of feature tokens
    only is given when the rest of the run (to ``run_end``) is exactly that long, or exactly as long as it and
    the expansions of the next images (``later``: their lengths) together (adjacent images the processor
    expanded); one with text tokens among them (Idefics3's tile rows) when every token matches."""
    if done.offsets is None:
        n, total = len(done.expansion), len(done.expansion)
        for size in [0, *later]:
            total += size
            if total == run_end - at:
                return at, at + n
            if total > run_end - at:
                break
        return None
    begin = at - done.offsets[0]
    end = begin + len(done.expansion)
    if begin >= pos and ids[begin:end] == list(done.expansion):
        return begin, end
    return None


def processor_error(image: LoadedImage, e: Exception) -> ImageError:
    """The processor's refusal of ``image`` as one line naming its size."""
    w, h = image.size
    reason = " ".join(f"{type(e).__name__}: {e}".split())
    return ImageError(f"the image processor cannot take this {w}x{h} image ({reason[:300]})")


def _placeholder_runs(token_ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] == token:
            j = i
            while j < n and token_ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
