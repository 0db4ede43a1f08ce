"""Models for the engine: native decoders and the transformers backend, and their checkpoint loading.

`load_model(path, dtype="auto", device="cpu", implementation="auto")` returns a model with the engine's
interface (`model(input_ids, positions, ctx) -> hidden`, `model.compute_logits(hidden)`, `model.config`):
our native `CausalLM` for the architectures in `NATIVE_ARCHITECTURES`, or transformers' modeling code over
batchgen's paged attention (`batchgen.models.transformers_backend`) for any other decoder-only architecture.
`load_tokenizer(path)`, `ModelConfig`. Tiny offline checkpoints for tests and the default model live in
`batchgen.models.tiny`.
"""

from batchgen.models.config import (
    NATIVE_ARCHITECTURES,
    ModelConfig,
    NativeUnsupportedError,
)
from batchgen.models.llama import CausalLM
from batchgen.models.loader import IMPLEMENTATIONS, load_model, load_tokenizer

__all__ = [
    "IMPLEMENTATIONS",
    "NATIVE_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "NativeUnsupportedError",
    "load_model",
    "load_tokenizer",
]
