"""The engine stays readable: no class over ~450 lines, no function over ~60 lines in batchgen/engine."""

from __future__ import annotations

import ast
from pathlib import Path

import batchgen.engine

ENGINE = Path(batchgen.engine.__file__).parent
MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 60


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
    files = sorted(ENGINE.glob("*.py"))
    assert len(files) > 10
    found = [f for p in files for f in _too_long(ast.parse(p.read_text()), p)]
    assert not found, "\n".join(found)


def test_the_shape_check_catches_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = f"def f():\n{body}\n"
    assert _too_long(ast.parse(src), tmp_path / "x.py") == [
        f"x.py:1 f is {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"
    ]
