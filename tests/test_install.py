"""The installed distribution's dependency set: what `pip install batchgen` pulls on a CPU machine."""

from __future__ import annotations

from importlib.metadata import requires

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
