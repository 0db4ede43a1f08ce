"""Package discovery: every package under ``batchgen/`` ships, and the two top-level source folders that install
inside it (``kernels/`` as ``batchgen.kernels``, ``conf/`` as ``batchgen.conf``; see pyproject.toml's
package-dir) ship with all their subpackages. Everything else lives in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
MAPPED = {"kernels": "batchgen.kernels", "conf": "batchgen.conf"}


def discover() -> list[str]:
    packages = find_packages(str(ROOT), include=["batchgen", "batchgen.*"])
    for folder, name in MAPPED.items():
        packages += [name] + [f"{name}.{sub}" for sub in find_packages(str(ROOT / folder))]
    return sorted(packages)


setup(packages=discover())
