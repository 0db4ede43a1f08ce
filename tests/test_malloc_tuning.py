"""batchgen/runtime/malloc_tuning.py: applied once per process on glibc, never over the user's own malloc settings."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

CODE = "from batchgen.runtime import malloc_tuning as m; print(m.keep_freed_memory(), m.keep_freed_memory())"


def _run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc-only")
def test_applied_once_and_respects_user_settings(monkeypatch) -> None:
    import os

    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    base.pop("BATCHGEN_MALLOC_TUNING", None)
    assert _run(base) == "True False"
    assert _run({**base, "BATCHGEN_MALLOC_TUNING": "0"}) == "False False"
    assert _run({**base, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}) == "False False"
    assert _run({**base, "MALLOC_ARENA_MAX": "2"}) == "False False"


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise(MADV_HUGEPAGE) is Linux-only")
def test_huge_pages_for_a_lazy_buffer(monkeypatch) -> None:
    """The advice covers the 2 MiB-aligned part of a buffer (too small a buffer: nothing to advise); the
    buffer stays lazily allocated and usable; BATCHGEN_MALLOC_TUNING=0 turns it off."""
    import numpy as np

    from batchgen.runtime import malloc_tuning as m

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    buf = np.zeros(16 << 20, dtype=np.uint8)
    if thp.exists() and "[never]" not in thp.read_text():
        assert m.huge_pages(buf.ctypes.data, buf.nbytes)
    buf[:: 1 << 20] = 1
    assert int(buf.sum()) == 16
    assert not m.huge_pages(buf.ctypes.data, 1 << 20)  # no whole aligned 2 MiB inside
    monkeypatch.setenv("BATCHGEN_MALLOC_TUNING", "0")
    assert not m.huge_pages(buf.ctypes.data, buf.nbytes)
