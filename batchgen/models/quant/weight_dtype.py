"""Which dtype a model computes in, given the dtype its weights are held in.

`dtype` (vLLM's name: ``auto`` is the checkpoint's own dtype) chooses how the weights are **stored**. On a GPU the
model computes in that dtype too. On the CPU, which has no fast bfloat16/float16 arithmetic on the machines we
run, a bfloat16 or float16 model computes in float32: its linear layers keep their weights in the narrow dtype
(half the bytes of float32, packed into the GEMM's panels) and widen them in registers; the embedding table
stays narrow and widens the rows it looks up; the small rest (norms, biases) and stacked expert weights are
widened once at load. Widening is exact, so the model computes exactly what a float32 model with the rounded
weights computes (transformers' ``from_pretrained(bf16 checkpoint, dtype=float32)``).

Invariant: ``config.dtype`` of a loaded native model is the dtype of its activations (and of an ``auto`` KV
cache); ``config.weight_dtype`` the dtype its projections and embedding are stored in.
"""

from __future__ import annotations

import torch
from torch import nn

NARROW = (torch.bfloat16, torch.float16)


def compute_dtype(weight_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The activations' dtype for weights stored in `weight_dtype` on `device` (module docstring)."""
    if torch.device(device).type == "cpu" and weight_dtype in NARROW:
        return torch.float32
    return weight_dtype


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a loaded model's activations (and an ``auto`` KV cache) are in: its config's ``dtype`` where it
    has one, else its first parameter's."""
    dtype = getattr(getattr(model, "config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype
