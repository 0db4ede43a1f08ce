"""Runs pooling tasks over a checkpoint: token lists in, embeddings or class scores out, in input order.

Encoders run through :class:`~batchgen.pooling.encoder.EncoderModel` (length-sorted, unpadded batches of at
most ``engine.max_num_batched_tokens`` tokens and ``engine.max_num_seqs`` rows); decoders through an
:class:`~batchgen.engine.core.llm_engine.LLMEngine` over a :class:`~batchgen.pooling.decoder.PoolingDecoder`
(prefill-only requests, continuous batching, the prefix cache for last-token pooling). A row that cannot run
(empty, longer than the model takes) gets an error string; it never stops the others.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from batchgen.driver import EngineRequest, run_requests
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.outputs import RequestOutput
from batchgen.pooling.checkpoint import (
    ENCODER_MODEL_TYPES,
    UNSUPPORTED_ENCODER_MODEL_TYPES,
    CheckpointPooling,
)
from batchgen.pooling.encoder import length_batches, load_encoder
from batchgen.pooling.params import PoolingParams, PoolingSpec
from batchgen.pooling.pooler import class_probs, finish_embedding, pool
from batchgen.runtime import threads

logger = logging.getLogger(__name__)


@dataclass
class PooledRow:
    """One row's result: ``values`` (the embedding, or the class scores), or ``error``."""

    values: list[float] | None = None
    label: str | None = None
    error: str | None = None


class PoolingRunner:
    """One checkpoint loaded for ``task`` (``embed`` or ``classify``)."""

    def __init__(
        self,
        info: CheckpointPooling,
        task: str,
        engine_config: EngineConfig | None = None,
        dtype: str = "auto",
        tokenizer: str | None = None,
        implementation: str = "auto",
    ) -> None:
        from batchgen.engine.core.llm_engine import LLMEngine, resolve_device
        from batchgen.models.loader import load_tokenizer
        from batchgen.pooling.decoder import check_pooling_decoder, load_pooling_decoder

        self.info, self.task = info, task
        self.config = config = engine_config or EngineConfig()
        if task == "classify" and info.task != "classify":
            raise ValueError(
                f"{info.path} ({info.architecture or info.model_type}) has no classification head: "
                "classify needs a *ForSequenceClassification checkpoint"
            )
        self.engine = None
        self.encoder = None
        if info.model_type in UNSUPPORTED_ENCODER_MODEL_TYPES:
            raise ValueError(
                f"{info.path}: {info.model_type} models are not pooled by batchgen; it pools decoder-only models "
                f"and the encoder families {', '.join(ENCODER_MODEL_TYPES)}"
            )
        if info.is_encoder:
            if config.tensor_parallel_size > 1:
                raise ValueError(
                    f"{info.path}: encoder models ({info.model_type}) run on one device (they are small and run "
                    "outside the paged engine); set engine.tensor_parallel_size=1"
                )
            if implementation == "native":
                raise ValueError(
                    f"{info.path}: encoder models ({info.model_type}) run with transformers' modeling code; use "
                    "model.implementation=auto or transformers"
                )
            device = resolve_device(config.device)
            threads.apply(device)  # the engine's CPU thread policy (the encoder runs outside the engine)
            self.encoder = load_encoder(info, dtype, device)
            self.tokenizer = load_tokenizer(tokenizer or str(info.path))
            self.max_model_len = min(
                config.max_model_len or self.encoder.max_model_len, self.encoder.max_model_len
            )
            self.hidden_size = self.encoder.hidden_size
        else:
            check_pooling_decoder(info, implementation, config.tensor_parallel_size)
            self.engine = LLMEngine(
                str(info.path),
                config,
                dtype=dtype,
                tokenizer=tokenizer,
                load=functools.partial(load_pooling_decoder, info, dtype, implementation),
            )
            self.tokenizer = self.engine.tokenizer
            limit = info.max_seq_length or self.engine.max_model_len
            self.max_model_len = min(limit, self.engine.max_model_len)
            self.hidden_size = self.engine.model.config.hidden_size

    def spec(self, params: PoolingParams | None) -> PoolingSpec:
        """The request's pooling with the checkpoint's defaults filled in (classifiers pool as their head
        was trained: the last token for decoders, the head's own pooling for encoders)."""
        p = params or PoolingParams()
        if self.task == "classify":
            return PoolingSpec("last" if not self.info.is_encoder else "cls", False, None)
        if p.dimensions is not None and p.dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions={p.dimensions} exceeds the model's embedding size {self.hidden_size}"
            )
        method = p.pooling or self.info.default_pooling
        normalize = self.info.default_normalize if p.normalize is None else bool(p.normalize)
        return PoolingSpec(method, normalize, p.dimensions)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts`` as the checkpoint's own pipeline makes them (lowercased first where its
        sentence-transformers config sets ``do_lower_case``)."""
        if not texts:
            return []
        if self.info.lowercase:
            texts = [t.lower() for t in texts]
        return [list(t) for t in self.tokenizer(list(texts), return_attention_mask=False)["input_ids"]]

    def check(self, tokens: Sequence[int]) -> str | None:
        """Why a row cannot run (None: it can)."""
        if len(tokens) == 0:
            return "empty input: it has no tokens"
        if len(tokens) > self.max_model_len:
            return (
                f"input has {len(tokens)} tokens but the model takes at most {self.max_model_len}; shorten it "
                "(or raise engine.max_model_len where the model allows)"
            )
        return None

    def run(
        self,
        token_lists: Sequence[Sequence[int]],
        spec: PoolingSpec,
        on_done: Callable[[int], None] | None = None,
    ) -> list[PooledRow]:
        """Pool every row (input order); ``on_done(n)`` after each batch of ``n`` rows."""
        results: list[PooledRow | None] = [None] * len(token_lists)
        todo = []
        for i, toks in enumerate(token_lists):
            why = self.check(toks)
            if why is None:
                todo.append(i)
            else:
                results[i] = PooledRow(error=why)
        run = self._run_encoder if self.encoder is not None else self._run_decoder
        run(token_lists, todo, spec, results, on_done)
        return results  # type: ignore[return-value]

    def _finish(self, vectors: torch.Tensor, spec: PoolingSpec) -> list[PooledRow]:
        """Pooled hidden states ``[B, H]`` -> rows (head, normalisation, truncation applied)."""
        if self.task == "classify":
            return self._classified(self._head(vectors))
        return [PooledRow(v) for v in finish_embedding(vectors, spec).tolist()]

    def _classified(self, logits: torch.Tensor) -> list[PooledRow]:
        """A head's logits ``[B, num_labels]`` -> rows: the class scores and the most likely label's name (no
        label for a one-label head's score)."""
        labels = self.info.labels
        return [
            PooledRow(p, None if len(p) == 1 else labels[max(range(len(p)), key=p.__getitem__)])
            for p in class_probs(logits, self.info.problem_type).tolist()
        ]

    def _head(self, vectors: torch.Tensor) -> torch.Tensor:
        assert self.engine is not None
        score = self.engine.model.score
        return score(vectors.to(score.weight.dtype))

    def _run_encoder(self, token_lists, todo, spec, results, on_done) -> None:
        enc = self.encoder
        assert enc is not None
        lengths = [len(token_lists[i]) for i in todo]
        cfg = self.config
        for batch in length_batches(lengths, cfg.max_num_batched_tokens, cfg.max_num_seqs):
            rows = [todo[j] for j in batch]
            out = enc.forward([token_lists[i] for i in rows])
            if self.task == "classify":
                assert out.logits is not None
                done = self._classified(out.logits)
            else:
                assert out.hidden is not None
                vectors = pool(out.hidden, out.cu, spec.method)
                done = [PooledRow(v) for v in finish_embedding(vectors, spec).tolist()]
            for i, r in zip(rows, done):
                results[i] = r
            if on_done is not None:
                on_done(len(rows))

    def _run_decoder(self, token_lists, todo, spec, results, on_done) -> None:
        from batchgen.engine.features.pooling import PoolingState

        engine = self.engine
        assert engine is not None
        base = engine.stats.num_requests
        states: dict[str, tuple[int, PoolingState]] = {}
        requests = []
        pad = self.info.pad_token_id if self.task == "classify" else None
        # rows sharing a prefix next to each other: the prefix cache serves them (last-token pooling)
        for i in sorted(todo, key=lambda i: list(token_lists[i])):
            rid = f"pool-{base + i}"
            states[rid] = (i, PoolingState(spec.method))
            requests.append(EngineRequest(rid, head_tokens(token_lists[i], pad), pooling=states[rid][1]))

        def collect(finished: list[RequestOutput]) -> None:
            ok = [(states[o.request_id], o) for o in finished]
            for (i, _), o in ok:
                if o.error is not None:
                    results[i] = PooledRow(error=o.error)
            good = [(i, s) for (i, s), o in ok if o.error is None]
            if good:
                vectors = torch.stack([s.vector for _, s in good])
                for (i, _), row in zip(good, self._finish(vectors, spec)):
                    results[i] = row
            if on_done is not None and finished:
                on_done(len(finished))

        run_requests(engine, requests, collect)


def head_tokens(tokens: Sequence[int], pad: int | None) -> list[int]:
    """The tokens up to the one a decoder classifier's head reads: transformers' ``*ForSequenceClassification``
    scores the last token that is not ``pad`` (the first when all are), and a causal model's hidden state
    there does not depend on the tokens after it."""
    toks = list(tokens)
    if pad is None:
        return toks
    n = len(toks)
    while n > 0 and toks[n - 1] == pad:
        n -= 1
    return toks[: max(n, 1)]
