"""batchgen/malloc_tuning.py: applied once per process on glibc, never over the user's own malloc settings."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CODE = "from batchgen import malloc_tuning as m; print(m.keep_freed_memory(), m.keep_freed_memory())"


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
