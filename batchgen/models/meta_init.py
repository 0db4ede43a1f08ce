"""Build a model on the meta device and give it real (empty) storage, without torch's meta reference ops.

A meta tensor has no data, so initialising one is wasted work; worse, `nn.init.normal_` on a meta tensor and
`empty_like` of one (what `Module.to_empty` calls) run torch's Python reference implementations, whose first
calls import `torch._dynamo` and sympy: about 1.5 s of the demo's start-up on a 2-core VM, for a 2.4M-parameter
model. `skip_init()` turns every `torch.nn.init` call into a no-op while a model is built; `materialize`
then allocates each parameter and buffer with `torch.empty(shape)` on the target device, as
``model.to(dtype=dtype).to_empty(device=device)`` would (floating-point tensors in `dtype`, others keep theirs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class skip_init(TorchFunctionMode):  # noqa: N801 - used like a function: `with skip_init():`
    """A torch-function mode that turns `torch.nn.init.*` calls into no-ops returning their tensor."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == torch.nn.init.__name__:
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`model` (built on the meta device) with uninitialised storage on `device` for each tensor still on the
    meta device, floating point in `dtype`; tensors already on a device (modules swapped in since) are kept.

    Like ``model.to(dtype=dtype).to_empty(device=device)``, shared parameters are not kept shared: re-tie them.
    """

    def empty(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    return model._apply(empty)
