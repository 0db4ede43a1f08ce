"""The installed distribution's dependency set: what `pip install batchgen` pulls on a CPU machine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement


def _requirements() -> list[Requirement]:
    return [Requirement(r) for r in requires("batchgen") or []]


def test_plain_install_pulls_no_triton():
    # Only an extra (triton, test) may ask for Triton: CUDA torch brings its own and the CPU path never runs it.
    for req in _requirements():
        if req.name == "triton":
            assert req.marker is not None and "extra" in str(req.marker), f"unconditional {req}"


def test_triton_extra_exists_for_gpu_docs_and_tests():
    extras = {str(r.marker) for r in _requirements() if r.name == "triton"}
    assert any('extra == "triton"' in m for m in extras), extras
    assert any('extra == "test"' in m for m in extras), extras


CLOUD_WITH_LOCAL_S3 = ["torch==2.13.0", "{project}[cloud]", "moto[server]"]
"""docs/storage.md's install for testing against a local S3 server: the cloud extra beside moto's server, with
the README's CPU torch."""


@pytest.mark.slow
def test_cloud_extra_resolves_beside_a_local_s3_server(tmp_path: Path) -> None:
    """`pip install -e '.[cloud]' 'moto[server]'` resolves in a fresh venv without backtracking (the cloud
    extra's bounds keep aiobotocore's botocore and moto's boto3 in one window): a dry run on a copy of the
    project's metadata, from the package registry only."""
    project = tmp_path / "project"  # pip builds metadata in the project: a copy, not the source tree
    root = Path(__file__).resolve().parents[1]
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in ("batchgen", "kernels", "conf"):
        shutil.copytree(root / name, project / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, project / name)
    # A fresh venv without pip of its own (ensurepip costs seconds): this environment's pip resolves for it
    # (`pip --python`), seeing only what that venv holds, i.e. nothing.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    report = tmp_path / "report.json"
    args = [a.format(project=project) for a in CLOUD_WITH_LOCAL_S3]
    cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--dry-run",
           "--report", str(report), *args]  # fmt: skip
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("the cloud extra beside moto[server] did not resolve in 10 minutes")
    took = time.monotonic() - t0
    said = p.stdout + p.stderr
    unreachable = (
        "Could not fetch URL",
        "NewConnectionError",
        "Network is unreachable",
        "Failed to establish",
    )
    if p.returncode != 0 and any(s in said for s in unreachable):
        pytest.skip(f"the package registry is unreachable: {said.strip().splitlines()[-1]}")
    assert p.returncode == 0, said[-3000:]
    backtracked = [line for line in said.splitlines() if "is looking at multiple versions of" in line]
    assert not any(x in line for line in backtracked for x in ("boto", "s3fs", "fsspec", "moto")), backtracked
    got = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert {"s3fs", "aiobotocore", "botocore", "boto3", "moto", "gcsfs", "adlfs"} <= set(got), sorted(got)
    print(f"cloud + moto[server] resolved in {took:.0f} s: " + ", ".join(f"{k} {got[k]}" for k in sorted(got)
          if k in ("s3fs", "fsspec", "aiobotocore", "botocore", "boto3", "moto")))  # fmt: skip
