"""Imports go downward only: kernels -> attention -> models -> engine -> LLM / data / job; bench on top.

Each layer's modules are imported in a fresh interpreter, which must not have loaded any higher layer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import importlib, pkgutil, sys
name, banned = sys.argv[1], sys.argv[2].split(",")
mod = importlib.import_module(name)
names = [name]
if hasattr(mod, "__path__"):
    names += [m.name for m in pkgutil.walk_packages(mod.__path__, name + ".")]
for n in names:
    if n in banned:
        continue  # a module of this package that sits in a higher layer (the pooling runner)
    importlib.import_module(n)
bad = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned))
print(",".join(bad))
"""

_ABOVE_ENGINE = [
    "batchgen.llm",
    "batchgen.pooling.runner",
    "batchgen.data",
    "batchgen.multimodal",
    "batchgen.job",
    "batchgen.bench",
    "batchgen.cli",
]
_ABOVE_MODELS = ["batchgen.engine", *_ABOVE_ENGINE]
_ABOVE_ATTENTION = ["batchgen.models", *_ABOVE_MODELS]
_ABOVE_KERNELS = ["batchgen.attention", *_ABOVE_ATTENTION]

LAYERS = [
    ("batchgen.kernels", _ABOVE_KERNELS),
    ("batchgen.attention", _ABOVE_ATTENTION),
    ("batchgen.models", _ABOVE_MODELS),
    ("batchgen.pooling", _ABOVE_MODELS),  # pooling heads, checkpoints and encoders sit beside the models
    ("batchgen.engine", _ABOVE_ENGINE),
    ("batchgen.runtime", ["batchgen.kernels", *_ABOVE_KERNELS]),  # utilities below every layer
]


@pytest.mark.parametrize(("layer", "above"), LAYERS, ids=[layer for layer, _ in LAYERS])
def test_layer_imports_nothing_above_it(layer: str, above: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, layer, ",".join(above)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"{layer} pulls in higher layers: {proc.stdout.strip()}"
