"""Per-request sampling options: ``batchgen.SamplingParams``, also the ``sampling.*`` group of the job config.

The one class serves the Python API and the job: its fields are typed with types OmegaConf can store (int,
float, bool, ``X | None``, ``list[str]``, ``list[int]``), so Hydra's ConfigStore holds it as is
(:mod:`batchgen.job.hydra_setup`) and ``sampling.<field>`` keys are exactly these fields. Each field's docstring
is both its API documentation and its ``batchgen --help`` text.

Semantics follow vLLM / the OpenAI API where they exist, so a config written for one works with the other:

* ``temperature < 1e-5`` (normally ``0``) means greedy decoding: argmax of the (penalised) logits. The
  random filters (top-k/top-p/min-p) and the seed are then irrelevant.
* ``top_k`` of ``0`` or ``-1`` disables top-k; ``top_p == 1`` disables top-p; ``min_p == 0`` disables min-p.
* The repetition penalty follows transformers (over prompt + generated tokens); presence and frequency
  penalties follow OpenAI / vLLM (over generated tokens only).
* ``beam_width > 1`` turns on beam search with the semantics of transformers'
  ``generate(num_beams=beam_width, num_return_sequences=n, length_penalty=..., early_stopping=...,
  do_sample=False)``: the ``n`` best finished beams are returned, best first. Beam search is deterministic:
  temperature, top-k/top-p/min-p and the seed are ignored; stop strings, logprobs and the penalties are not
  supported with it (a ValueError says so); eos, ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` and
  ``max_tokens`` apply to every beam.
* Structured outputs (``json_schema``, ``regex``, ``choice``, ``grammar``; at most one): every token is drawn
  from those the grammar allows (:mod:`batchgen.engine.features.structured`); not with beam search, ``ignore_eos``
  or ``min_tokens``.

Validation happens in ``__post_init__`` (also after ``dataclasses.replace``): a bad value raises a
``ValueError`` naming the field and its allowed range. Numeric values from configs or Parquet columns
(numpy scalars, integral floats) are coerced to plain Python ``int`` / ``float``.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

GREEDY_EPS = 1e-5
"""Temperatures below this are treated as greedy (argmax) decoding."""


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return value


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    # numpy.bool_ and 0/1 ints from Parquet/Hydra are accepted; anything else is a mistake.
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r}")


@dataclass
class SamplingParams:
    """How to generate the completion(s) of one prompt.

    Invariants after construction: every field has its documented type and range; ``stop`` is ``None`` or a
    non-empty list of non-empty strings; ``stop_token_ids`` is ``None`` or a list of non-negative ints;
    ``min_tokens <= max_tokens`` when ``max_tokens`` is set.
    """

    n: int = 1
    """Number of completions generated for the prompt (>= 1); they share the prompt's KV blocks. In a job's
    output each completion is one row (numbered by a sample_index column when n > 1)."""
    temperature: float = 1.0
    """Softmax temperature (>= 0). Below 1e-5 (e.g. 0) decoding is greedy: the argmax token."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]: keep the smallest set of most likely tokens whose mass reaches top_p
    (1 = off)."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 or -1 disables it (values > vocab size mean 'all')."""
    min_p: float = 0.0
    """In [0, 1]: drop tokens whose probability is below min_p times the most likely token's probability
    (0 = off)."""
    repetition_penalty: float = 1.0
    """> 0; 1 disables. Tokens seen in the prompt or the output get their logit divided by it when positive,
    multiplied by it when negative (transformers semantics; > 1 discourages repetition)."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted once from the logit of every token already generated (not prompt tokens);
    0 = off."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from a token's logit once per time it has been generated (not prompt tokens);
    0 = off."""
    max_tokens: int | None = 16
    """Most tokens to generate per completion (>= 1); None (null) means up to the engine's max_model_len."""
    min_tokens: int = 0
    """Generate at least this many tokens (>= 0, <= max_tokens) before eos or stop_token_ids may end it."""
    stop: list[str] | None = None
    """Strings that end the generation when they appear in the output text, e.g. ['###', '\\n\\n'] (a single
    str is accepted). The returned text is cut before the stop string unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the generation (in addition to the model's eos ids unless ignore_eos); the
    stop token itself is kept in token_ids."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the returned text."""
    ignore_eos: bool = False
    """Keep generating after the model's eos token(s) (stop_token_ids still apply)."""
    logprobs: int | None = None
    """If set (>= 0): return, for each generated token, the log-probabilities of the ``logprobs`` most likely
    tokens plus the sampled token's, from the raw model logits (before penalties/temperature/filters). A job
    writes them to a 'logprobs' column."""
    prompt_logprobs: int | None = None
    """If set (>= 0): return, for every prompt token after the first, its log-probability and the
    ``prompt_logprobs`` most likely tokens at its position (``RequestOutput.prompt_logprobs``; raw logits,
    computed in the prefill). Such a request takes no prefix-cache hits (its tokens need their logits)."""
    seed: int | None = None
    """Seed of this request's own random generator: the same seed gives the same tokens whatever else is
    in the batch; None uses the engine's generator (reproducible per run, not per request). In a job,
    sampling.seed (default 0 there) is the job seed: each row samples with its own seed derived from
    (seed, row id), so its output does not depend on batching, grouping or resume; null = unseeded."""
    skip_special_tokens: bool = True
    """Leave special tokens (eos, chat markers, ...) out of the returned text."""
    beam_width: int = 1
    """Beam search with this many beams (>= 1; 1 = off). Returns the ``n`` (<= beam_width) best beams."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores ``sum of logprobs / generated_len ** length_penalty`` (> 0 favours
    longer outputs, < 0 shorter ones; transformers semantics, the generated length counts the eos token)."""
    early_stopping: bool | str = False
    """Beam search stopping rule (transformers): True stops once ``beam_width`` beams are finished; False stops
    when a heuristic says no running beam can beat the finished ones; 'never' only when none can (exact)."""
    json_schema: Any = None
    """Structured output: the output is compact JSON valid against this JSON Schema (a dict or a JSON
    string; stored as a dict). At most one of json_schema / regex / choice / grammar. Needs the 'structured'
    extra (xgrammar). The output ends when the JSON is complete (finish_reason 'stop'); if max_tokens cuts it
    first, finish_reason is 'length' and the output is marked not satisfied (constraint_satisfied=False)."""
    regex: str | None = None
    """Structured output: the whole output matches this regular expression."""
    choice: list[str] | None = None
    """Structured output: the output is exactly one of these strings."""
    grammar: str | None = None
    """Structured output: the output is a sentence of this EBNF/GBNF grammar (xgrammar's dialect, start rule
    ``root``)."""

    def __post_init__(self) -> None:
        # In field order, so the first invalid field is the one reported.
        self._check_sampling()
        self._check_lengths()
        self._check_stops()
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            setattr(self, name, _as_bool(name, getattr(self, name)))
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be >= 0 (or None), got {self.logprobs}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs)
            if self.prompt_logprobs < 0:
                raise ValueError(f"prompt_logprobs must be >= 0 (or None), got {self.prompt_logprobs}")
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        self._check_beam()
        self._check_constraint()

    def _check_sampling(self) -> None:
        """n, temperature, the top-k/top-p/min-p filters and the penalties."""
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        self.temperature = _as_float("temperature", self.temperature)
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")

        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}"
            )

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

    def _check_lengths(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1 (or None for no limit), got {self.max_tokens}")

        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    def _check_stops(self) -> None:
        if self.stop is not None:
            stop = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in stop):
                raise ValueError("stop strings must be non-empty, got an empty string")
            # Keep the user's order (the index of the matched string is reported) but drop duplicates.
            self.stop = list(dict.fromkeys(stop)) or None

        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            ids = [_as_int("stop_token_ids", t) for t in self.stop_token_ids]
            if any(t < 0 for t in ids):
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {ids}")
            self.stop_token_ids = list(dict.fromkeys(ids)) or None

    def _check_beam(self) -> None:
        """beam_width, length_penalty, early_stopping, and the options beam search does not take."""
        self.beam_width = _as_int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1 (1 = no beam search), got {self.beam_width}")
        self.length_penalty = _as_float("length_penalty", self.length_penalty)
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
        es = self.early_stopping
        if isinstance(es, str) and es.strip().lower() in ("true", "false", "never"):
            es = {"true": True, "false": False, "never": "never"}[es.strip().lower()]
        elif es != "never":
            try:
                es = _as_bool("early_stopping", es)
            except ValueError:
                raise ValueError(
                    f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
                ) from None
        self.early_stopping = es
        if self.beam_width == 1:
            return
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) must be <= beam_width ({self.beam_width}) with beam search")
        unsupported = [
            name
            for name, off in (
                ("stop", self.stop is None),
                ("logprobs", self.logprobs is None),
                ("repetition_penalty", self.repetition_penalty == 1.0),
                ("presence_penalty", self.presence_penalty == 0.0),
                ("frequency_penalty", self.frequency_penalty == 0.0),
            )
            if not off
        ]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} not supported with beam search (beam_width > 1)")

    def _check_constraint(self) -> None:
        """json_schema / regex / choice / grammar: types, at most one, and the options they exclude."""
        schema = self.json_schema
        if schema is not None:
            if hasattr(schema, "_content"):  # an OmegaConf DictConfig (Hydra's sampling.json_schema={...})
                from omegaconf import OmegaConf

                schema = OmegaConf.to_container(schema, resolve=True)
            if isinstance(schema, (str, bytes)):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, Mapping):
                raise ValueError(f"json_schema must be a JSON object (dict or JSON string), got {schema!r}")
            self.json_schema = json.loads(json.dumps(dict(schema)))  # plain, JSON-serialisable, a copy
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not hasattr(choice, "__iter__"):
                raise ValueError(f"choice must be a list of strings, got {choice!r}")
            choice = list(choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choice!r}")
            self.choice = list(dict.fromkeys(choice))
        kinds = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(kinds) > 1:
            raise ValueError(f"at most one of json_schema, regex, choice, grammar may be set, got {kinds}")
        if kinds:
            if self.beam_width > 1:
                raise ValueError(f"{kinds[0]} (structured output) is not supported with beam search")
            if self.ignore_eos:
                raise ValueError(f"ignore_eos is not supported with {kinds[0]}: the grammar ends the output")
            if self.min_tokens:
                raise ValueError(f"min_tokens is not supported with {kinds[0]}: the grammar ends the output")

    @property
    def constrained(self) -> bool:
        """True when one of json_schema / regex / choice / grammar is set (structured output)."""
        return (
            self.json_schema is not None
            or self.regex is not None
            or self.choice is not None
            or self.grammar is not None
        )

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature < 1e-5): the argmax of the penalised logits."""
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        """True when any of the repetition / presence / frequency penalties is active."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict of every field (for the job config and Parquet schema metadata)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys are a ValueError."""
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; valid names: {sorted(names)}")
        return cls(**dict(d))
