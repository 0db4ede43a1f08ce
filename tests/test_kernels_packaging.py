"""``kernels/`` installs as ``batchgen.kernels``, never as a top-level ``kernels`` (the name of a PyPI
distribution that transformers probes and imports), and importing it does not need Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_batchgen_kernels_maps_to_the_kernels_folder():
    import batchgen.kernels

    assert Path(batchgen.kernels.__file__).resolve() == REPO / "kernels" / "__init__.py"


def test_transformers_sees_only_an_installed_kernels_distribution():
    # Run from the repository root, where the bare `kernels` folder is on sys.path: the worst case. transformers
    # reports kernels available exactly when a `kernels` distribution is installed, never because of the folder.
    code = (
        "import importlib.metadata as m\n"
        "from transformers.utils import is_kernels_available\n"
        "try:\n    m.version('kernels'); installed = True\n"
        "except m.PackageNotFoundError:\n    installed = False\n"
        "print(is_kernels_available() == installed)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_the_folder_stands_aside_for_an_installed_kernels_package(tmp_path):
    # An installed `kernels` package (here a stand-in on PYTHONPATH, behind the repository root that `python -c`
    # puts first) is what `import kernels` gives, even from the repository root; batchgen.kernels is unchanged.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from kernels.layer import CUDAProperties\n")
    (tmp_path / "kernels" / "layer.py").write_text("class CUDAProperties:\n    pass\n")
    code = (
        "import kernels, batchgen.kernels\n"
        "from kernels import CUDAProperties\n"
        "print(kernels.__file__)\n"
        "print(batchgen.kernels.PagedKV.__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "kernels" / "__init__.py"), "batchgen.kernels.paged_kv"]


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
