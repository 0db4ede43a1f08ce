"""Incremental detokenization of generated tokens, and stop-string search.

``IncrementalDetokenizer`` turns a growing list of token ids into text at a cost per token that does not
grow with the output length: each ``append`` decodes only a short window of recent tokens (the
prefix-offset approach of vLLM and transformers' ``TextStreamer``):

* ``prefix_offset .. read_offset`` are tokens whose text was already emitted (context for the decoder);
* ``read_offset .. len(ids)`` are tokens whose text is pending;
* the new text is ``decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])``.

Decoding a window that starts at a token boundary gives the same characters as the full decode as long as
the window starts at a character boundary, which holds because text is only finalised when it does not end
in U+FFFD (the replacement character a decoder emits for the incomplete UTF-8 sequence of a multi-byte
character split over several byte-level tokens). So ``"".join(appended) + flush()`` equals
``tokenizer.decode(ids, skip_special_tokens=...)`` (for tokenizers that apply no ``clean_up_tokenization``
post-processing, i.e. every BPE tokenizer in transformers 5: cleanup is a whole-text rewrite; with it on,
the windows are cleaned separately, which can differ from cleaning the whole text at a window boundary).

One known difference: SentencePiece ``ByteFallback`` decoders (``<0xNN>`` tokens, Llama-2/Mistral-v1
style) turn a whole run of byte tokens that is not valid UTF-8 into one U+FFFD per byte, including bytes of
characters that were complete. Incrementally, the complete characters of such a run are emitted as they
complete and only the invalid bytes become U+FFFD (e.g. an output cut by max_tokens inside a character
spelled in bytes). Valid runs, i.e. real model output, decode identically.

The output is decoded on its own, without prompt context, so that the text is exactly what
``tokenizer.decode(output_token_ids)`` gives (e.g. SentencePiece tokenizers drop the leading space of the
first output token, as in transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tokenizers

REPLACEMENT_CHAR = "\ufffd"

MAX_PENDING_TOKENS = 16
"""If this many tokens are pending (their text still ends in U+FFFD), the text is finalised up to 4 tokens
before the end when adding those 4 tokens left it unchanged. A real incomplete character spans at most 3
non-empty byte tokens after its first byte, so this only triggers on outputs that really contain U+FFFD
characters (degenerate models) and keeps the window, hence the cost per token, bounded."""


def _decode_fn(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The cheapest call that decodes like ``tokenizer.decode(ids, skip_special_tokens=...)``.

    For transformers fast tokenizers without text cleanup, that is the Rust ``tokenizers`` decode it calls
    underneath (skipping the Python layers); a raw ``tokenizers.Tokenizer`` is used directly.
    """
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        if cleanup and type(backend.model).__name__ == "BPE":
            # transformers 5 skips the cleanup for BPE tokenizers unless forced by this flag.
            cleanup = bool(
                getattr(
                    tokenizer,
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                    False,
                )
            )
        if not cleanup:
            return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of one generated sequence, built token by token.

    Invariants: ``text`` is the concatenation of every string returned by ``append`` (and ``flush``); it is
    always a prefix of the eventual full decode; after ``flush()``, ``text == tokenizer.decode(token_ids,
    skip_special_tokens=skip_special_tokens)``. ``append`` holds back text that ends in an incomplete
    multi-byte character, so ``text`` never contains a replacement character that a later token would
    complete.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        # The output is decoded on its own (not after the prompt), so text == tokenizer.decode(output ids).
        self.skip_special_tokens = skip_special_tokens
        self._decode = _decode_fn(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = []
        self._text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])

    @property
    def text(self) -> str:
        """The finalised output text so far (everything ``append`` returned)."""
        return self._text

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose text is held back (an incomplete multi-byte character at the end)."""
        return len(self.token_ids) - self._read_offset

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it finalises ('' while a character is incomplete)."""
        self.token_ids.append(token_id)
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        if not window_text.endswith(REPLACEMENT_CHAR):
            return self._finalise(len(self.token_ids), window_text)
        if self.num_pending_tokens >= MAX_PENDING_TOKENS:
            cut = len(self.token_ids) - 4
            cut_text = self._decode(self.token_ids[self._prefix_offset : cut])
            if window_text.startswith(cut_text):
                return self._finalise(cut, cut_text)
        return ""

    def flush(self) -> str:
        """Finalise the pending tokens as the full decode would (an incomplete character becomes U+FFFD)."""
        if self.num_pending_tokens == 0:
            return ""
        return self._finalise(len(self.token_ids), self._decode(self.token_ids[self._prefix_offset :]))

    def _finalise(self, end: int, window_text: str) -> str:
        """Emit ``window_text`` (the decode of ``token_ids[prefix_offset:end]``) past the prefix text."""
        new_text = window_text[len(self._prefix_text) :]
        if self._read_offset < end:
            # The newly finalised tokens become the next window's context. Their text is decoded on its own:
            # it can differ from new_text (e.g. SentencePiece decoders drop the first space of a decode).
            context = self._decode(self.token_ids[self._read_offset : end])
            if context:
                self._prefix_offset, self._prefix_text = self._read_offset, context
            else:
                # Tokens without text (skipped special tokens, a lone space piece stripped as the first
                # token) would let that first-space rule hit the next real token: keep the older context.
                self._prefix_text = window_text
            self._read_offset = end
        self._text += new_text
        return new_text


def find_stop(
    text: str, new_text_len: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Look for a stop string that ends inside the last ``new_text_len`` characters of ``text``.

    Only the tail that can hold such a match is searched (a match ending earlier would have been found by an
    earlier call), so the cost does not grow with the text. If several stop strings match, the one that
    starts first wins (ties: the earlier in ``stop``). Returns ``(text cut before the stop string, or just
    after it when include_stop_str_in_output, index of the stop string in stop)`` or None.
    """
    if not stop or new_text_len <= 0:
        return None
    old_len = len(text) - new_text_len
    best: tuple[int, int] | None = None  # (start position, index in stop)
    for i, s in enumerate(stop):
        # Earliest start of a match that ends after old_len; also search at most the tail.
        pos = text.find(s, max(0, old_len - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, i)
    if best is None:
        return None
    pos, i = best
    end = pos + len(stop[i]) if include_stop_str_in_output else pos
    return text[:end], i
