"""Secrets (storage credentials) kept out of what a job writes down: Hydra's saved config, overrides and
multirun status. Values of secret-looking keys of ``data.storage_options`` and the user info and query
strings of URLs (``s3://KEY:SECRET@bucket``, ``?sig=...``) are replaced by ``***`` wherever they appear."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from batchgen.data.storage import REDACTED, is_secret_key, is_url


def secret_values(cfg: Any) -> list[str]:
    """The secret strings of a job config (a DictConfig or a JobConfig), longest first."""
    data = cfg.data if not isinstance(cfg, dict) else cfg.get("data", {})
    out: set[str] = set()

    def walk(node: Any, secret: bool) -> None:
        if isinstance(node, dict) or hasattr(node, "items"):
            for k, v in node.items():
                walk(v, secret or is_secret_key(str(k)))
        elif isinstance(node, (list, tuple)) or type(node).__name__ == "ListConfig":
            for v in node:
                walk(v, secret)
        elif node is not None and secret and str(node):
            out.add(str(node))

    try:
        opts = data.get("storage_options") if hasattr(data, "get") else getattr(data, "storage_options", None)
    except Exception:  # noqa: BLE001 - an unresolvable interpolation holds nothing to hide
        opts = None
    walk(opts or {}, False)
    for key in ("input", "output"):
        with contextlib.suppress(Exception):
            url = str(data.get(key) if hasattr(data, "get") else getattr(data, key))
            if is_url(url):
                parts = urlsplit(url)
                out.update(x for x in (parts.username, parts.password, parts.query) if x)
    return sorted((s for s in out if len(s) >= 3), key=len, reverse=True)


_URL_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]+@")


def scrub_text(text: str, secrets: list[str]) -> str:
    """`text` with every secret replaced by ``***``, and any ``scheme://user:password@`` user info too."""
    for s in secrets:
        text = text.replace(s, REDACTED)
    return _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)


def job_secrets(cfg: Any) -> list[str]:
    """:func:`secret_values` of `cfg`, or none when the config cannot be read (never raises)."""
    try:
        return secret_values(cfg)
    except Exception:  # noqa: BLE001 - an unreadable config: the URL pattern still applies
        return []


def scrub_files(directory: str | Path, secrets: list[str]) -> None:
    """Replace every secret in the files directly under `directory` (Hydra's ``.hydra/``)."""
    d = Path(directory)
    if not secrets or not d.is_dir():
        return
    for p in d.iterdir():
        if p.is_file():
            with contextlib.suppress(OSError, UnicodeDecodeError):
                text = p.read_text()
                clean = scrub_text(text, secrets)
                if clean != text:
                    p.write_text(clean)


def scrub_hydra_record(cfg: Any) -> None:
    """Remove the job's secrets from the files Hydra saved for this run (config.yaml, hydra.yaml,
    overrides.yaml), which Hydra writes before the job starts."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.output_subdir is None:
        return
    scrub_files(Path(hc.runtime.output_dir) / str(hc.output_subdir), secret_values(cfg))
