"""``kernels/`` installs as ``batchgen.kernels``, never as a top-level ``kernels`` (the name of a PyPI
distribution that transformers probes and imports), and importing it does not need Triton."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_batchgen_kernels_maps_to_the_kernels_folder():
    import batchgen.kernels

    assert Path(batchgen.kernels.__file__).resolve() == REPO / "kernels" / "__init__.py"


def test_transformers_does_not_see_a_kernels_distribution():
    # Run from the repository root, where a bare `kernels` folder is on sys.path: the worst case.
    code = "from transformers.utils import is_kernels_available; print(is_kernels_available())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_package_and_engine_import_without_triton():
    # Block `import triton`: the torch backend, the attention interface and auto backend selection still work.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, batchgen.kernels as k, batchgen.attention as a\n"
        "assert not k.triton_available()\n"
        "assert a.resolve_backend('auto', torch.device('cpu')) == 'torch'\n"
        "a.PagedAttention('torch')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_wheel_installs_kernels_only_under_batchgen(built_wheel):
    # The built distribution itself (not just the editable install): no top-level `kernels` package, and the
    # Hydra configs and the sample data travel with it.
    wheel = built_wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"batchgen", wheel.name.split("-py3")[0] + ".dist-info"}
    for needed in (
        "batchgen/kernels/__init__.py",
        "batchgen/kernels/reference.py",
        "batchgen/kernels/torch_backend.py",
        "batchgen/kernels/cpu_kernel.py",
        "batchgen/kernels/csrc/paged_attention_cpu.c",
        "batchgen/kernels/csrc/linear_cpu.c",
        "batchgen/kernels/csrc/quant_linear_cpu.c",
        "batchgen/kernels/csrc/half.h",
        "batchgen/conf/config.yaml",
        "batchgen/sample_data/prompts.parquet",
    ):
        assert needed in names
