"""What a pooling request asks for, and the task names."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean", "cls")
POOLING_TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's pooling parameters. ``pooling``: ``last`` / ``mean`` / ``cls`` (None: the checkpoint's
    sentence-transformers pooling, else CLS for encoders and the last token for decoders); ``normalize``: L2
    normalise the embedding (None: the checkpoint's choice, True when it says nothing); ``dimensions``: keep the
    first ``dimensions`` values (Matryoshka models; normalised after truncation)."""

    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise ValueError(
                f"pooling must be one of {', '.join(POOLING_METHODS)} or None, got {self.pooling!r}"
            )
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or int(self.dimensions) < 1):
            raise ValueError(f"dimensions must be a positive integer or None, got {self.dimensions!r}")


@dataclass(frozen=True)
class PoolingSpec:
    """A resolved request: the method and normalisation to apply, the dimensions to keep (None: all)."""

    method: str
    normalize: bool
    dimensions: int | None = None
