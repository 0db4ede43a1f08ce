"""Incremental detokenization (equals the full decode, bounded window) and stop-string search."""

from __future__ import annotations

import json
import random

import pytest

from batchgen.engine.sched.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer, find_stop

MULTILINGUAL = "Grüße, naïve café — 日本語のテキスト 🙂👍🏽 Ελληνικά, русский, עברית, emoji 🧪 end.\n"


# ---------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """The project's tiny byte-level BPE tokenizer (Qwen2-style, special tokens 0..4)."""
    from batchgen.models.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def sp_raw_tokenizer():
    """A Llama-2-style tokenizer: Metaspace pieces, <0xNN> byte fallback, decoder stripping the first space."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(["\n".join(pydoc_data.topics.topics.values())[:60_000]], trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def sp_tokenizer(sp_raw_tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=sp_raw_tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def _byte_token_ids(tokenizer) -> list[int]:
    """Ids of tokens that are a single byte (likely to split multi-byte characters)."""
    vocab = tokenizer.get_vocab()
    return [i for t, i in vocab.items() if (t.startswith("<0x") and len(t) == 6) or len(t) == 1]


def _stream(tokenizer, ids: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    texts = []
    for i in ids:
        piece = detok.append(i)
        assert detok.text.endswith(piece)
        texts.append(detok.text)
    detok.flush()
    assert detok.num_pending_tokens == 0
    return texts, detok.text


def _decode(tokenizer, ids, skip):
    return tokenizer.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------- equality with the full decode


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_equal_full_decode_byte_level(bpe_tokenizer, skip):
    """Byte-level BPE: any token sequence, including lone bytes of multi-byte characters."""
    vocab_size = len(bpe_tokenizer.get_vocab())
    byte_ids = _byte_token_ids(bpe_tokenizer)
    rng = random.Random(f"bpe-{skip}")
    for _ in range(150):
        n = rng.randint(1, 40)
        # Half the draws are single-byte tokens so that multi-byte characters get split and completed.
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(vocab_size) for _ in range(n)]
        texts, final = _stream(bpe_tokenizer, ids, skip)
        assert final == _decode(bpe_tokenizer, ids, skip), ids
        for t in texts:  # finalised text only grows and never changes
            assert final.startswith(t)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("which", ["sp_tokenizer", "sp_raw_tokenizer"])
def test_random_sequences_equal_full_decode_byte_fallback(request, which, skip):
    """SentencePiece-style byte fallback: random pieces mixed with characters spelled as <0xNN> tokens.

    Runs of byte tokens are valid UTF-8 here: the ByteFallback decoder turns a whole run that is not valid
    UTF-8 into one U+FFFD per byte (even bytes of characters that were complete), which no incremental
    decoder can reproduce without holding back entire runs (see the module docstring).
    """
    tokenizer = request.getfixturevalue(which)
    vocab = tokenizer.get_vocab()
    piece_ids = [i for t, i in vocab.items() if not t.startswith("<0x")]
    chars = "aZ é€日本🙂\n"
    rng = random.Random(f"{which}-{skip}")
    for _ in range(150):
        ids: list[int] = []
        for _ in range(rng.randint(1, 25)):
            if rng.random() < 0.6:
                ids.append(rng.choice(piece_ids))
            else:
                ids += [vocab[f"<0x{b:02X}>"] for b in rng.choice(chars).encode()]
        texts, final = _stream(tokenizer, ids, skip)
        assert final == _decode(tokenizer, ids, skip), ids
        for t in texts:
            assert final.startswith(t)


@pytest.mark.parametrize("which", ["bpe_tokenizer", "sp_tokenizer"])
def test_multibyte_text_streams_without_replacement_chars(request, which):
    tokenizer = request.getfixturevalue(which)
    ids = tokenizer.encode(MULTILINGUAL * 3, add_special_tokens=False)
    texts, final = _stream(tokenizer, ids, True)
    assert final == _decode(tokenizer, ids, True)
    assert final.strip() == (MULTILINGUAL * 3).strip()
    assert all("\ufffd" not in t for t in texts)
    # Characters are held back only while incomplete: the text catches up as soon as they are.
    assert texts[-1] == final


def test_sentencepiece_first_token_has_no_leading_space_like_decode(sp_tokenizer):
    ids = sp_tokenizer.encode("Hello world", add_special_tokens=False)
    assert _stream(sp_tokenizer, ids, True)[1] == "Hello world" == sp_tokenizer.decode(ids)
    # Later tokens keep their leading space although each window is decoded on its own.
    ids = sp_tokenizer.encode("a b c d e f g", add_special_tokens=False)
    assert _stream(sp_tokenizer, ids, True)[1] == "a b c d e f g"


def test_special_tokens_skipped_or_kept(bpe_tokenizer):
    body = bpe_tokenizer.encode(" hi there", add_special_tokens=False)
    ids = [3, *body, 4, 2, *body, 2, 2]  # <|im_start|> ... <|im_end|> <|endoftext|> ...
    assert _stream(bpe_tokenizer, ids, True)[1] == " hi there hi there"
    kept = _stream(bpe_tokenizer, ids, False)[1]
    assert kept == bpe_tokenizer.decode(ids) and "<|im_end|>" in kept


# ---------------------------------------------------------------- cost per token


class _SpyTokenizer:
    """Only ``decode``: forces the generic path and records the size of every decoded window."""

    def __init__(self, inner):
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("which", ["bpe_tokenizer", "sp_tokenizer"])
def test_window_stays_small_on_long_outputs(request, which):
    import pydoc_data.topics

    tokenizer = request.getfixturevalue(which)
    text = pydoc_data.topics.topics["assignment"][:3000] + MULTILINGUAL * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 800
    spy = _SpyTokenizer(tokenizer)
    detok = IncrementalDetokenizer(spy)
    for i in ids:
        detok.append(i)
    assert detok.text == tokenizer.decode(ids)
    assert max(spy.window_sizes) <= 24  # a few tokens of context + an incomplete character
    assert len(spy.window_sizes) <= 2 * len(ids)  # at most two small decodes per token


def test_genuine_replacement_characters_are_finalised(bpe_tokenizer):
    """A model that keeps emitting U+FFFD itself must not make the pending window grow forever."""
    ids = bpe_tokenizer.encode("\ufffd" * 200 + "x", add_special_tokens=False)
    spy = _SpyTokenizer(bpe_tokenizer)
    detok = IncrementalDetokenizer(spy)
    for i in ids:
        detok.append(i)
        assert detok.num_pending_tokens <= MAX_PENDING_TOKENS
    assert detok.text == "\ufffd" * 200 + "x" == bpe_tokenizer.decode(ids)
    assert max(spy.window_sizes) <= 2 * MAX_PENDING_TOKENS + 4


def test_flush_emits_an_incomplete_character_like_decode(bpe_tokenizer):
    ids = bpe_tokenizer.encode("ab€", add_special_tokens=False)
    # Drop the last byte token(s) until the output ends inside the euro sign.
    while not bpe_tokenizer.decode(ids).endswith("\ufffd"):
        ids = ids[:-1]
    detok = IncrementalDetokenizer(bpe_tokenizer)
    streamed = "".join(detok.append(i) for i in ids)
    assert "\ufffd" not in streamed and detok.num_pending_tokens > 0
    assert detok.flush().endswith("\ufffd")
    assert detok.text == bpe_tokenizer.decode(ids)
    assert detok.flush() == ""


# ---------------------------------------------------------------- stop strings


def test_find_stop_basics():
    assert find_stop("hello world", 5, ["wor"], False) == ("hello ", 0)
    assert find_stop("hello world", 5, ["wor"], True) == ("hello wor", 0)
    assert find_stop("hello world", 5, ["xyz"], False) is None
    assert find_stop("hello world", 0, ["world"], False) is None
    assert find_stop("hello world", 5, [], False) is None
    # The stop string straddles old and new text.
    assert find_stop("hello world", 5, ["o w"], False) == ("hell", 0)
    # Entirely inside the old text: already handled by an earlier call, not reported again.
    assert find_stop("hello world", 3, ["hell"], False) is None
    # Earliest start wins; on a tie, the first listed.
    assert find_stop("abcdef", 6, ["def", "bc", "cd"], False) == ("a", 1)
    assert find_stop("abcdef", 6, ["bcd", "bc"], True) == ("abcd", 0)
    # Stop string longer than the text, and the whole text being the stop string.
    assert find_stop("ab", 2, ["abc"], False) is None
    assert find_stop("###", 1, ["###"], False) == ("", 0)


def test_find_stop_streaming_matches_a_full_search():
    rng = random.Random(0)
    alphabet = "ab c\nd€"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        include = rng.random() < 0.5
        # Stream in random chunks; the first hit must equal a search of the whole text seen so far.
        pos, got = 0, None
        while pos < len(text) and got is None:
            step = rng.randint(1, 5)
            pos = min(len(text), pos + step)
            got = find_stop(text[:pos], min(step, pos), stop, include)
            full = find_stop(text[:pos], pos, stop, include)
            assert got == full, (text[:pos], stop)
        if got is None:
            assert all(s not in text for s in stop)
        else:
            # Earliest start among the matches complete when the hit was found.
            cut, i = got
            seen = text[:pos]
            start = min(seen.find(s) for s in stop if s in seen)
            assert seen.find(stop[i]) == start
            assert cut == seen[: start + (len(stop[i]) if include else 0)]
