"""Structured outputs: JSON schema, regex, choice and EBNF constraints through xgrammar token bitmasks.

A request whose :class:`~batchgen.sampling_params.SamplingParams` sets one of ``json_schema``, ``regex``,
``choice`` or ``grammar`` is *constrained*. :class:`StructuredOutputs` (one per engine) does all the work:

* **compile** (at ``add_request``): the constraint is compiled by xgrammar against the engine's tokenizer; the
  compiled grammar is cached by ``(kind, canonical constraint)`` (LRU, ``cache_size`` entries), so a job
  whose rows share a schema compiles it once (``hits`` / ``misses`` count). A schema or regex xgrammar
  rejects becomes the request's error (``RequestOutput.error``, ``finish_reason="error"``); it never raises
  out of the engine.
* **mask** (every step, :meth:`mask`, applied by the runner: :class:`LogitsMask`): each constrained row of the step has a matcher (one per sequence,
  held in a weak map keyed by the :class:`~batchgen.engine.sched.sequence.Sequence`, so it goes away with it);
  the matcher catches up with the tokens the sequence gained since the last step (so forks, preemption and
  recompute need no hook), the rows' bitmasks are filled in one batched, multi-threaded call, and
  ``apply_token_bitmask_inplace`` sets every disallowed logit (including padding ids beyond the tokenizer's
  vocabulary) to ``-inf``. Unconstrained rows are untouched and cost nothing.
* **end**: the grammar's stop tokens are the model's eos ids. When the grammar is complete the mask
  allows eos (only eos, for a grammar that cannot continue), so the normal stop rules end the sequence with
  ``finish_reason="stop"``. JSON is compact (no whitespace between tokens), so a random model cannot wander
  in whitespace forever.
* **satisfied** (:meth:`satisfied`, at output time): True when the sequence's tokens complete the
  grammar and their bytes are valid UTF-8 (every finished ``stop`` output), False when ``max_tokens`` /
  ``max_model_len`` or a stop string cut it first, or when its bytes do not decode (its text is then not a
  valid instance: never trust it), None for unconstrained requests.
* **UTF-8**: xgrammar (0.2.x) lets byte-level vocabularies spell invalid UTF-8 (UTF-16 surrogates such as
  ``ED BB 86``, overlong forms) wherever its character classes are negated or built in, so JSON schema
  strings are compiled as patterns over explicit code point ranges (:func:`_strings_as_patterns`), which it
  matches byte-exactly; what other constraints (a user's regex ``.``, an EBNF grammar) let through is caught
  by the UTF-8 check of :meth:`satisfied`.

Because the mask is applied to the logits before the sampler, the logprobs of constrained rows are those
of the masked distribution (disallowed tokens have ``-inf``).
"""

from __future__ import annotations

import json
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from batchgen.engine.sched.request_group import AddOn
from batchgen.models.tokenizer import as_transformers

if TYPE_CHECKING:
    from batchgen.engine.sched.sequence import Sequence
    from batchgen.sampling_params import SamplingParams

CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")
"""The SamplingParams fields that constrain the output (at most one may be set)."""


class GrammarAddOn(AddOn):
    """A constrained request's add-on: its next step's mask needs this step's token, so its steps are never
    planned before the previous step's output is applied."""

    def overlappable(self) -> bool:
        return False


GRAMMAR = GrammarAddOn()
"""The one (stateless) add-on every constrained request carries."""


@dataclass
class LogitsMask:
    """A step's grammar masks as plain data: the packed token ``bitmask`` of the constrained ``rows``;
    ``terminated`` rows (a grammar that allows nothing more) sample ``eos`` alone."""

    bitmask: Tensor
    rows: list[int]
    terminated: list[int]
    eos: int
    vocab_size: int

    def apply(self, logits: Tensor) -> None:
        """Mask, in place, the logits ``[N, V]`` of the rows (disallowed tokens, padding ids too: ``-inf``)."""
        import xgrammar as xgr

        bitmask = self.bitmask
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=bitmask.is_pinned())
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)
        for i in self.terminated:
            logits[i].fill_(-float("inf"))
            logits[i, self.eos] = 0.0


def is_available() -> bool:
    """True when the grammar engine (xgrammar, the ``structured`` extra) is installed."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def constraint_key(params: SamplingParams) -> tuple[str, str] | None:
    """``(kind, canonical text)`` of the request's constraint, or None when it has none (the cache key)."""
    if params.json_schema is not None:
        return "json_schema", json.dumps(params.json_schema, separators=(",", ":"))  # property order matters
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(list(params.choice))
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


@dataclass(eq=False)
class _State:
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int = 0  # output tokens of the sequence fed to the matcher
    rejected: bool = False  # a token the grammar did not allow (a stop string / forced token): not valid


class StructuredOutputs:
    """Grammar compilation (cached), per-sequence matchers, and the batched bitmask (see the module doc)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Seq[int],
        cache_size: int = 256,
        max_threads: int | None = None,
    ) -> None:
        import xgrammar as xgr

        max_threads = max_threads or min(
            8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        )

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._info = xgr.TokenizerInfo.from_huggingface(
            as_transformers(tokenizer), vocab_size=vocab_size, stop_token_ids=self.eos_token_ids or None
        )
        # Our own LRU of compiled grammars (xgrammar's cache is off: one cache, with counters we can test).
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._states: weakref.WeakKeyDictionary[Sequence, _State] = weakref.WeakKeyDictionary()
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._token_bytes: list[bytes] | None = None  # each token's bytes (b"" for special tokens)

    # -------------------------------------------------------------------------------- compilation
    def compile(self, params: SamplingParams, count: bool = True) -> Any:
        """The compiled grammar of ``params``' constraint (cached). Raises ValueError when it is invalid.

        ``hits`` / ``misses`` count the requests (``count``), not the matchers built for their samples."""
        key = constraint_key(params)
        if key is None:
            raise ValueError("the request has no constraint")
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.hits += count
            return compiled
        kind, text = key
        try:
            if kind == "json_schema":
                schema = _strings_as_patterns(json.loads(text))
                compiled = self._compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
                )
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(_choice_ebnf(params.choice or []))
            else:
                compiled = self._compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / its own errors with the parser's message
            msg = str(e).strip()
            raise ValueError(f"invalid {kind} constraint: {_strip_location(msg)}") from None
        self.misses += 1
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def validate(self, params: SamplingParams) -> str | None:
        """The error of a constrained request that cannot be served (bad constraint, no eos), or None."""
        if not params.constrained:
            return None
        if not self.eos_token_ids:
            return "structured outputs need an eos token to end the output, and the model has none"
        try:
            self.compile(params)
        except ValueError as e:
            return str(e)
        return None

    # ------------------------------------------------------------------------------------ matching
    def _state(self, seq: Sequence) -> _State:
        state = self._states.get(seq)
        if state is None:
            state = _State(self._xgr.GrammarMatcher(self.compile(seq.params, count=False)))
            self._states[seq] = state
        out = seq.token_ids
        start = seq.num_prompt_tokens + state.consumed
        if start < len(out):
            for token in out[start:]:
                if not state.rejected and not state.matcher.accept_token(token):
                    state.rejected = True
            state.consumed = len(out) - seq.num_prompt_tokens
        return state

    def mask(self, seqs: Seq[Sequence]) -> LogitsMask | None:
        """The grammar mask of a step's sampled rows ``seqs`` (None when none is constrained): the matchers
        catch up with the sequences' tokens and fill the constrained rows' bitmasks (valid until the next
        step's mask: steps with constrained rows are never planned ahead)."""
        rows = [i for i, s in enumerate(seqs) if s.params.constrained]
        if not rows:
            return None
        matchers = [self._state(seqs[i]).matcher for i in rows]
        n = len(seqs)
        if self._bitmask.shape[0] < n:
            self._bitmask = self._xgr.allocate_token_bitmask(
                max(n, 2 * self._bitmask.shape[0]), self.vocab_size
            )
        bitmask = self._bitmask[:n]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        terminated = [i for i, m in zip(rows, matchers) if m.is_terminated()]
        return LogitsMask(bitmask, rows, terminated, self.eos_token_ids[0], self.vocab_size)

    def satisfied(self, seq: Sequence) -> bool | None:
        """Whether ``seq``'s output completes its grammar (None when unconstrained); see the module doc."""
        if not seq.params.constrained:
            return None
        state = self._state(seq)
        if state.rejected or isinstance(seq.stop_reason, str):  # a stop string cut the text
            return False
        if not (state.matcher.is_terminated() or state.matcher.is_completed()):
            return False
        return self._valid_utf8(seq.token_ids[seq.num_prompt_tokens :])

    def _valid_utf8(self, token_ids: Seq[int]) -> bool:
        """Whether the bytes the tokens spell (eos and other special tokens spell none) are valid UTF-8."""
        if self._token_bytes is None:  # built once, on the first finished constrained output
            special = set(self.eos_token_ids) | set(self._info.special_token_ids)
            self._token_bytes = [b"" if i in special else b for i, b in enumerate(self._info.decoded_vocab)]
        vocab = self._token_bytes
        data = b"".join(vocab[t] for t in token_ids if t < len(vocab))
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    @property
    def num_tracked(self) -> int:
        """Sequences with a live matcher (they go away with their sequences)."""
        return len(self._states)


def _choice_ebnf(choices: Seq[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choice strings (JSON string literals escape them)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_JSON_CHAR = "[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]"
"""A character JSON may hold unescaped in a string: any scalar value but control characters, quote and
backslash. Written as literal code point ranges (not a negated class): xgrammar then accepts exactly their
UTF-8 encodings (no surrogates, no overlong forms)."""
_JSON_ESCAPE = '\\\\["\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4}'


def _strings_as_patterns(node: Any) -> Any:
    """Work around xgrammar (0.2.9), whose JSON strings accept invalid UTF-8 (see the module doc) and, with
    ``minLength`` / ``maxLength``, raw control characters (``\\x00-\\x1f``): each string schema without its
    own pattern/format/enum/const becomes the equivalent ``pattern`` over :data:`_JSON_CHAR`. A bounded string
    holds no escapes (lengths count characters exactly); an unbounded one may also hold JSON escapes."""
    if isinstance(node, list):
        return [_strings_as_patterns(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strings_as_patterns(v) for k, v in node.items()}
    if out.get("type") != "string" or {"pattern", "format", "enum", "const"} & out.keys():
        return out
    if "minLength" in out or "maxLength" in out:
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        upper = "" if hi is None else str(int(hi))
        out["pattern"] = f"^{_JSON_CHAR}{{{lo},{upper}}}$"
    else:
        out["pattern"] = f"^(?:{_JSON_CHAR}|{_JSON_ESCAPE})*$"
    return out


def _strip_location(msg: str) -> str:
    """xgrammar's messages start with ``[time] /path/file.cc:line: ``; keep what follows."""
    if msg.startswith("[") and ": " in msg:
        head, _, rest = msg.partition("] ")
        if rest and ".cc:" in rest.split(" ", 1)[0]:
            return rest.split(": ", 1)[-1]
    return msg
