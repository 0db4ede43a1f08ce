"""Outputs of pooling requests (vLLM's names): ``EmbeddingRequestOutput.outputs.embedding`` and
``ClassificationRequestOutput.outputs.probs``. A request that could not run (empty, too long for the model)
has ``error`` set and ``outputs`` None; the others are unaffected."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """``probs``: one score per label (softmax; sigmoid per label for multi-label heads; for a one-label reward
    or regression head, its raw score). ``label``: the most likely label's name from ``id2label`` (None for a
    one-label head, whose ``score`` is ``probs[0]``)."""

    probs: list[float]
    label: str | None = None

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @property
    def score(self) -> float:
        return self.probs[0] if len(self.probs) == 1 else max(self.probs)


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | None
    error: str | None = None
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput
ClassificationRequestOutput = PoolingRequestOutput
