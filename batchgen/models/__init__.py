"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) and their checkpoint loading.

`load_model(path, dtype="auto", device="cpu") -> CausalLM`, `load_tokenizer(path)`, `ModelConfig`.
Tiny offline checkpoints for tests and the default model live in `batchgen.models.tiny`.
"""

from batchgen.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from batchgen.models.llama import CausalLM
from batchgen.models.loader import load_model, load_tokenizer

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelConfig", "load_model", "load_tokenizer"]
