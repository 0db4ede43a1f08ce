"""Imports go downward only: kernels -> attention -> models -> engine -> LLM / data / job; bench on top.

Each layer's modules are imported in a fresh process, which must not have loaded any higher layer: one
interpreter loads the third-party libraries the layers share (torch, numpy, pyarrow), never a batchgen module,
and forks one child per layer, which imports the layer's modules and reports the higher layers it loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHECK = """
import importlib, pkgutil, sys
name, banned = LAYER, BANNED
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


_FORK_PER_LAYER = """
import json, os, sys, traceback
import numpy, pyarrow, torch  # third-party, shared by the layers: loaded once, before the fork
assert not [m for m in sys.modules if m == "batchgen" or m.startswith("batchgen.")]
check, layers = sys.argv[1], json.loads(sys.argv[2])
results = {}
for layer, banned in layers:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a process that has loaded no batchgen module yet
        os.close(read)
        out = os.fdopen(write, "w")
        try:
            sys.stdout = out
            exec(check, {"LAYER": layer, "BANNED": banned})
            code = 0
        except BaseException:
            traceback.print_exc(file=sys.stderr)
            code = 1
        out.flush()
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    _, status = os.waitpid(pid, 0)
    results[layer] = [os.waitstatus_to_exitcode(status), said]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def layer_imports() -> dict[str, list]:
    """Per layer: the exit status of its child and what it printed (the higher-layer modules it loaded)."""
    layers = json.dumps([[layer, above] for layer, above in LAYERS])
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_PER_LAYER, _CHECK, layers], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"stderr": proc.stderr}


@pytest.mark.parametrize(("layer", "above"), LAYERS, ids=[layer for layer, _ in LAYERS])
def test_layer_imports_nothing_above_it(layer_imports: dict[str, list], layer: str, above: list[str]) -> None:
    code, said = layer_imports[layer]
    assert code == 0, layer_imports["stderr"][-2000:]
    assert said.strip() == "", f"{layer} pulls in higher layers: {said.strip()}"
