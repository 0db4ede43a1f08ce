"""The collector's freeze of the start-up heap (batchgen/runtime/gc_tuning.py), in fresh interpreters: it freezes
once per process, before an engine exists, unfreezes at exit, and ``BATCHGEN_GC_FREEZE=0`` turns it off."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

PROGRAM = """
import gc
from batchgen.runtime import gc_tuning
held = [[] for _ in range(1000)]  # alive at the freeze: frozen
print(gc.get_freeze_count() == 0, gc_tuning.freeze_startup_heap(), gc_tuning.freeze_startup_heap())
frozen = gc.get_freeze_count()
later = [[] for _ in range(1000)]  # made after it: still collected as usual
print(frozen >= 1000, gc.get_freeze_count() == frozen)
"""


def _run(env_value: str | None, program: str = PROGRAM) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_GC_FREEZE"}
    if env_value is not None:
        env["BATCHGEN_GC_FREEZE"] = env_value
    return subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True
    )


def test_the_startup_heap_is_frozen_once_per_process():
    assert _run(None).stdout.split() == ["True", "True", "False", "True", "True"]


def test_batchgen_gc_freeze_0_leaves_the_collector_alone():
    assert _run("0").stdout.split() == ["True", "False", "False", "False", "True"]


def test_the_heap_is_unfrozen_at_exit():
    program = (
        "import atexit, gc\n"
        "from batchgen.runtime import gc_tuning\n"
        "gc_tuning.freeze_startup_heap()\n"
        "print(gc.get_freeze_count() > 0)\n"
        "atexit._run_exitfuncs()\n"
        "print(gc.get_freeze_count())\n"
    )
    assert _run(None, program).stdout.split() == ["True", "0"]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (pip install batchgen[triton])"
)
def test_no_leak_report_from_nanobind_extensions_at_exit():
    """Triton's nanobind bindings report the objects still alive at shutdown as leaks: a frozen heap was one."""
    program = "import triton\nfrom batchgen.runtime import gc_tuning\ngc_tuning.freeze_startup_heap()\n"
    assert "leaked" not in _run(None, program).stderr


def test_the_engine_freezes_before_it_loads_its_model():
    """The freeze comes first in the engine's constructor, so nothing of an engine is ever frozen."""
    import inspect

    from batchgen.engine.core.llm_engine import LLMEngine

    body = inspect.getsource(LLMEngine.__init__)
    assert body.index("gc_tuning.freeze_startup_heap()") < body.index("self._load(")
