"""How one attention layer attends: :class:`AttentionOptions`, taken by every attention implementation (the
reference, the torch backend, the Triton kernels' wrappers) and by the engine's ``PagedAttention``.

Semantics (the reference, :mod:`.reference`, defines them): logits are ``scale * q·k``; a query at position ``p``
sees keys ``p - sliding_window < k <= p`` (transformers' convention); ``softcap`` turns logits into
``softcap * tanh(logits / softcap)`` (Gemma 2); ``sinks`` (``[Hq]``) adds one logit per head to the softmax
denominator (gpt-oss). ``None`` = plain causal attention, exactly as without the option.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """The scale and the optional attention options of one layer; a model builds it once per layer.

    Invariants (checked on construction, ``ValueError`` otherwise): ``sliding_window`` is None or >= 1,
    ``softcap`` is None or > 0. Compared by identity (``sinks`` is a tensor).
    """

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: Tensor | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")

    @property
    def plain(self) -> bool:
        """No window, soft-capping or sinks: plain causal attention."""
        return self.sliding_window is None and self.softcap is None and self.sinks is None
