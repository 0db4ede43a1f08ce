"""One Triton kernel, two ways to run it: compiled on CUDA, interpreted on the CPU.

``triton.jit`` picks the interpreter once, at decoration time, from ``TRITON_INTERPRET``. The kernels here
instead decide per launch from the tensors' device, so one process can run the same kernel compiled on a GPU
and interpreted on CPU tensors (the tests do both). ``TRITON_INTERPRET=1`` keeps its usual meaning: every
launch is interpreted (on CUDA tensors too, copied to the host and back by Triton).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def interpreting(device: torch.device) -> bool:
    """True when kernels on ``device`` run in Triton's interpreter (CPU tensors, or ``TRITON_INTERPRET=1``)."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


class Kernel:
    """A Triton kernel function, compiled or interpreted per launch: ``kernel.on(device)[grid](*args)``.

    The wrapped function may call the ``@helper`` functions of this package (see :func:`helper`) and Triton
    builtins (``tl.load``, ``tl.full``, ``tl.reduce`` with ``tl.standard._sum_combine`` / ``_elementwise_max``,
    ...), but not Triton's own library ``@triton.jit`` functions such as ``tl.zeros``, ``tl.sum``, ``tl.max`` or
    ``tl.cdiv``: those are compiled or interpreted depending on ``TRITON_INTERPRET`` at import, so only one of the
    two backends could run them. The interpreter needs Triton 3.7 or later (3.6's turns the loops' scalar bounds
    into arrays it cannot index with). Interpreter quirks the kernels work around (Triton 3.9): arithmetic on bfloat16
    values is wrong (the wrappers compute in float32 when interpreting) and ``tensor & scalar`` masks have an
    unsupported dtype.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: Any = None
        self._interpreted: Any = None

    def on(self, device: torch.device) -> Any:
        if interpreting(device):
            if self._interpreted is None:
                self._interpreted = InterpretedFunction(self.fn)
            return self._interpreted
        if self._compiled is None:
            self._compiled = JITFunction(self.fn)
        return self._compiled


def kernel(fn: Any) -> Kernel:
    """Decorator: ``@kernel`` instead of ``@triton.jit``."""
    return Kernel(fn)


class Helper(JITFunction):
    """A ``@triton.jit`` device function that kernels call, whichever way they run: the compiler sees a
    ``JITFunction`` (and inlines it like any other), the interpreter calls it like a Python function (this
    ``__call__``, which a plain ``JITFunction`` refuses outside a compiled kernel)."""

    def __init__(self, fn: Any) -> None:
        super().__init__(fn)
        self._interpreted = InterpretedFunction(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._interpreted(*args, **kwargs)


def helper(fn: Any) -> Helper:
    """Decorator for device functions shared by kernels: ``@helper`` instead of ``@triton.jit``."""
    return Helper(fn)
