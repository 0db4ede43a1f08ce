"""How a processor joins an image's expansion to the prompt text around it, redone on token ids.

Most processors replace the image placeholder by the image's expansion and tokenize the result: the tokens
around an image are the prompt's own. Some also edit the text at the seams; :func:`joins_for` returns the
rules of the checkpoint's processor, so a prompt expanded by :class:`~batchgen.multimodal.inputs.ImagePrompts`
has exactly the processor's token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Joins:
    """Plain concatenation: the expansion and the text after an image are kept as they are."""

    def expansion(self, before: Sequence[int], expansion: tuple[int, ...]) -> tuple[int, ...]:
        """The image's expansion placed right after the ids ``before`` it."""
        return expansion

    def text_after(self, ids: list[int]) -> list[int]:
        """The prompt's ids that follow an image (up to the next image)."""
        return ids


class Idefics2Joins(Joins):
    """``Idefics2Processor``: the ``<fake_token_around_image>`` where two images meet is written once, and a
    word written right after an image (a first character that is neither whitespace nor ``<``) is preceded by
    a space. The text after an image is tokenized up to the next added token, as the tokenizer does."""

    def __init__(self, tokenizer: Any, fake_token: str) -> None:
        self.tokenizer = tokenizer
        self.fake_token = fake_token
        self.fake = int(tokenizer.convert_tokens_to_ids(fake_token))
        self.added = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)

    def expansion(self, before: Sequence[int], expansion: tuple[int, ...]) -> tuple[int, ...]:
        if before and before[-1] == self.fake and expansion[:1] == (self.fake,):
            return expansion[1:]
        return expansion

    def text_after(self, ids: list[int]) -> list[int]:
        if ids[:1] == [self.fake]:
            return ids[1:]
        n = next((i for i, t in enumerate(ids) if t in self.added), len(ids))
        if n == 0:
            return ids
        text = self.tokenizer.decode(ids[:n], clean_up_tokenization_spaces=False)
        if not text or text[0].isspace() or text[0] == "<":
            return ids
        # tokenized in context, right after the fake token, as the processor's string is
        spaced = list(self.tokenizer.encode(self.fake_token + " " + text, add_special_tokens=False))
        return spaced[spaced.index(self.fake) + 1 :] + ids[n:]


def joins_for(processor: Any) -> Joins:
    """The joining rules of ``processor`` (plain concatenation for every processor not named here)."""
    if type(processor).__name__ == "Idefics2Processor":
        return Idefics2Joins(processor.tokenizer, processor.fake_image_token)
    return Joins()
