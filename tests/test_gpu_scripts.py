"""The scripts a borrowed GPU machine runs (jobs/gpu): a rename or an API change that leaves them behind only
shows on that machine, so what they name and what they call is checked here, on the CPU."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_scripts_name_modules_and_tests_that_exist():
    """jobs/gpu/check.sh decides batchgen is importable by importing named modules, and both shell scripts run
    named test files and the features check."""
    check = (ROOT / "jobs/gpu/check.sh").read_text()
    run_all = (ROOT / "jobs/gpu/run_all.sh").read_text()
    modules = re.search(r'-c "import ([\w., ]+)"', check).group(1).split(", ")
    assert "batchgen.kernels.decode_attention" in modules
    for name in modules:
        importlib.import_module(name)
    files = set(re.findall(r"tests/test_\w+\.py", check + run_all))
    assert "tests/test_kernels.py" in files
    for f in files | {"jobs/gpu/features_check.py"}:
        assert (ROOT / f).is_file(), f
    assert "jobs/gpu/features_check.py" in run_all


def test_the_features_check_runs_each_feature_against_the_cpu(tmp_path):
    """The script end to end with the CPU as the device: every feature it names runs and agrees with itself."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "jobs/gpu/features_check.py"), "--device", "cpu"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    for feature in ("text", "prefix_cow", "lora", "image", "embed", "kv_fp8", "gptq", "fp8", "gguf"):
        assert " ok " in lines[feature], lines.get(feature)
    assert "features: 0 of 9 not ok on cpu" in out.stdout
    assert "leaked" not in out.stderr  # the frozen start-up heap is released at exit
