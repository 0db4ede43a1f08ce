"""`skip_init()`: build modules without running `torch.nn.init` (for models built on the meta device).

A meta tensor has no data, so initialising it is wasted work; worse, `normal_` on a meta tensor goes through
torch's Python reference implementation, whose first call imports `torch._dynamo` (about 0.6 s on a 2-core
VM, most of the demo's model build). Inside the context every `torch.nn.init` function returns its tensor
untouched; every other torch call runs as usual (including an enclosing `torch.device(...)` context).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class skip_init(TorchFunctionMode):  # noqa: N801 - used like a function: `with skip_init():`
    """A torch-function mode that turns `torch.nn.init.*` calls into no-ops returning their tensor."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == torch.nn.init.__name__:
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)
