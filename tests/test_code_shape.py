"""The code stays readable: no class over ~450 lines in the engine, no function over ~120 lines anywhere in the
package (the Triton kernels, one GPU program each, excepted). These are backstops against sprawl, not targets:
code is split by concept, never to fit a gauge."""

from __future__ import annotations

import ast
from pathlib import Path

import batchgen.engine
import batchgen.kernels

ENGINE = Path(batchgen.engine.__file__).parent
PACKAGE = ENGINE.parent
TRITON_KERNELS = {"_decode_kernel", "_prefill_kernel", "_decode_reduce_kernel"}
MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 120


def _too_long(tree: ast.AST, path: Path) -> list[str]:
    found = []
    for node in ast.walk(tree):
        limit = None
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION_LINES
        if limit is not None:
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if lines > limit:
                found.append(f"{path.name}:{node.lineno} {node.name} is {lines} lines (limit {limit})")
    return found


def test_no_long_class_or_function_in_the_engine():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 10
    found = [f for p in files for f in _too_long(ast.parse(p.read_text()), p)]
    assert not found, "\n".join(found)


def test_no_long_function_in_the_package():
    kernels = Path(batchgen.kernels.__file__).parent  # installed as batchgen.kernels, may live elsewhere
    files = sorted({*PACKAGE.rglob("*.py"), *kernels.glob("*.py")})
    assert len(files) > 50
    found = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in TRITON_KERNELS:
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{p}:{node.lineno} {node.name} is {lines} lines")
    assert not found, "\n".join(found)


def test_the_shape_check_catches_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = f"def f():\n{body}\n"
    assert _too_long(ast.parse(src), tmp_path / "x.py") == [
        f"x.py:1 f is {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"
    ]
