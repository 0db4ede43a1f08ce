"""Compile the kernels for a CUDA GPU without one (ahead of time): does every configuration build, and how
many registers / how much spill stack does it use?

Used by ``tests/test_kernels_compile.py`` (so CPU-only CI still type-checks the compiled path) and handy when
tuning tile sizes::

    with recording() as launches:
        paged_decode_attention(q, PagedKV(k_cache, v_cache, block_tables, seq_lens), options)  # CPU tensors are fine
    for launch in launches:
        print(compile_launch(launch))

While recording, the wrappers pick the tile configuration they would use on CUDA, and launch nothing.
Relies on Triton internals (``ASTSource``, argument specialisation), so it may need touching on Triton
upgrades; nothing in the engine imports it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, native_specialize_impl

from . import _jit, copy_blocks, decode_attention, prefill_attention, store_kv

_WRAPPER_MODULES = (store_kv, copy_blocks, decode_attention, prefill_attention)


@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its grid and the exact arguments."""

    kernel: _jit.Kernel
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass
class CompileResult:
    name: str
    constexprs: dict[str, Any]
    registers: int
    stack_bytes: int  # > 0 means register spills (or local arrays)
    shared_bytes: int


class _Recorder:
    def __init__(self, kernel: _jit.Kernel, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, grid, args, kwargs))


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within the block, kernel wrappers record their launches (with CUDA tile choices) instead of running."""
    launches: list[Launch] = []
    saved_on = _jit.Kernel.on
    saved_interp = {m: m.interpreting for m in _WRAPPER_MODULES if hasattr(m, "interpreting")}
    _jit.Kernel.on = lambda self, device: _Recorder(self, launches)  # type: ignore[method-assign]
    for m in saved_interp:
        m.interpreting = lambda device: False
    try:
        yield launches
    finally:
        _jit.Kernel.on = saved_on  # type: ignore[method-assign]
        for m, fn in saved_interp.items():
            m.interpreting = fn


def compile_launch(launch: Launch, arch: int = 90) -> CompileResult:
    """Compile ``launch`` for ``sm_{arch}`` with the same argument specialisation as a real launch."""
    fn = JITFunction(launch.kernel.fn)
    kwargs = dict(launch.kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, value) in enumerate(zip(fn.arg_names, launch.args)):
        ty, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = key
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name, value in kwargs.items():
        signature[name] = "constexpr"
        constexprs[name] = value
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    regs, stack = _resource_usage(compiled.asm["cubin"])
    return CompileResult(launch.name, dict(kwargs), regs, stack, int(compiled.metadata.shared))


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
