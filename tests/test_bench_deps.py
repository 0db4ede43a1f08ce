"""psutil and matplotlib belong to the ``bench`` extra: every benchmark module imports without them, and the
benchmarks run (memory figures from /proc, charts skipped)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import batchgen.bench

SCRIPT = """
import importlib, sys
sys.modules["psutil"] = None  # an import of either now raises ImportError
sys.modules["matplotlib"] = None
for name in {modules!r}:
    importlib.import_module(name)
from batchgen.bench import common, memory
from batchgen.bench.systems import PeakRSS
assert common.pyplot() is None
with PeakRSS() as mem:
    pass
assert mem.peak >= 0
memory.main(["--small", "--workloads", "fixed", "--requests", "8", "--out", {out!r}])
"""


def test_benchmarks_import_and_run_without_the_bench_extra(tmp_path):
    modules = [f"batchgen.bench.{m.name}" for m in pkgutil.iter_modules(batchgen.bench.__path__)]
    assert "batchgen.bench.overhead" in modules and "batchgen.bench.throughput" in modules
    code = SCRIPT.format(modules=modules, out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "matplotlib is not installed: charts skipped" in proc.stdout
    assert (tmp_path / "memory.json").is_file() and not list(tmp_path.glob("*.png"))
