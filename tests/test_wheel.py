"""The built wheel is the product: every package of the source tree is in it, and, installed non-editably in a
fresh virtual environment, it runs ``LLM.generate`` and ``LLM.embed`` from a directory outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The source folders that install under another name (pyproject.toml's package-dir).
MAPPED = {"batchgen": "batchgen", "kernels": "batchgen.kernels", "conf": "batchgen.conf"}


def _source_packages() -> set[str]:
    """Every folder with an ``__init__.py`` under the package's source folders, as its installed name."""
    found = set()
    for folder, name in MAPPED.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            if "__pycache__" not in rel:
                found.add(".".join((name, *rel)))
    return found


def test_every_source_package_is_in_the_wheel(built_wheel):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    packages = _source_packages()
    assert {"batchgen", "batchgen.pooling", "batchgen.kernels", "batchgen.conf"} <= packages
    missing = sorted(p for p in packages if p.replace(".", "/") + "/__init__.py" not in names)
    assert not missing, f"packages missing from the wheel: {missing}"
    # and every module of those packages
    modules = {
        "/".join((*MAPPED[pkg].split("."), *py.relative_to(REPO / pkg).parts))
        for pkg in MAPPED
        for py in (REPO / pkg).rglob("*.py")
        if "__pycache__" not in py.parts
    }
    assert not sorted(modules - names), f"modules missing from the wheel: {sorted(modules - names)}"


@pytest.mark.slow
def test_installed_wheel_generates_and_embeds_outside_the_checkout(built_wheel, tmp_path):
    # A fresh venv holding only the wheel (--no-deps), its dependencies seen through a .pth to this
    # interpreter's site-packages (which may hold an editable batchgen: its finder .pth is not processed there).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = [
        p
        for p in sys.path
        if ("site-packages" in p or "dist-packages" in p) and not Path(p).resolve().is_relative_to(REPO)
    ]
    Path(site, "_deps.pth").write_text("\n".join(deps) + "\n")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(built_wheel)]
    out = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    run = tmp_path / "elsewhere"
    run.mkdir()
    smoke = subprocess.run(
        [str(python), str(REPO / ".ci" / "wheel_smoke.py")],
        cwd=run,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert "embed: 32 dimensions" in smoke.stdout
