"""Command-line arguments batchgen reads before Hydra does: ``--version``; a single string given to a
list option (``sampling.stop=END``), which Hydra's typed config would refuse ("str is not a ListConfig"); and
overrides of keys the schema does not have or of values of the wrong type, which batchgen reports in one line
(exit status 2, README's table) instead of Hydra's multi-line error."""

from __future__ import annotations

import re
from typing import Any

SINGLE_OR_LIST = ("sampling.stop",)
"""List options that also take one string on the command line (as ``SamplingParams`` does in Python)."""

_OVERRIDE = re.compile(r"^(\+{0,2})([\w.]+)=(.*)$", re.DOTALL)


def wants_version(argv: list[str]) -> bool:
    """``--version`` / ``-V`` asks for batchgen's version (Hydra would print its own)."""
    return "--version" in argv or "-V" in argv


def hydra_quoted(text: str) -> str:
    """`text` as a Hydra single-quoted string: quotes escaped, and the backslashes before a quote or at the
    end doubled (Hydra reads every other backslash literally, which batchgen's escape decoding relies on)."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


def single_strings_as_lists(argv: list[str]) -> list[str]:
    """`argv` with each ``key=value`` of :data:`SINGLE_OR_LIST` whose value is one plain string rewritten as a
    one-element list. Lists, null, quoted strings in brackets and sweeps (a comma: ``-m`` values) are left
    as they are."""
    out = []
    for arg in argv:
        m = _OVERRIDE.match(arg)
        if m and m.group(2) in SINGLE_OR_LIST:
            prefix, key, value = m.groups()
            plain = value and value[0] not in "[" and value not in ("null", "None") and "," not in value
            if plain:
                quoted = value if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else None
                arg = f"{prefix}{key}=[{quoted or hydra_quoted(value)}]"
        out.append(arg)
    return out


def override_problem(argv: list[str], schema: Any) -> str | None:
    """The first plain override in `argv` (``key=value``, no ``+``/``~``) that the job schema `schema` (the
    typed root config) refuses, as one line: an unknown key with the closest valid one (``unknown
    configuration key: data.windw_rows (did you mean data.window_rows?)``) or a value of the wrong type
    (``data.window_rows=abc: Value 'abc' of type 'str' could not be converted to Integer``). None when every
    override is fine. Group selections (``sampling=greedy``), ``hydra.*`` keys and what Hydra cannot parse
    are left to Hydra; a sweep (``-m data.window_rows=1,2``) has its key checked, not its values."""
    import copy

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    from batchgen.job.config import GROUPS, unknown_keys

    parser = None
    for arg in argv:
        m = _OVERRIDE.match(arg)
        if arg.startswith("-") or not m or m.group(1):
            continue
        key = m.group(2)
        if key.split(".")[0] == "hydra" or key in GROUPS:
            continue
        parser = parser or OverridesParser.create()
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 - Hydra reports what it cannot parse
            continue
        if override.type != OverrideType.CHANGE or override.package:
            continue
        nested: dict[str, Any] = {}
        node = nested
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[key.split(".")[-1]] = None
        bad = unknown_keys(nested)
        if bad:
            return f"unknown configuration key: {bad[0]} (batchgen --help lists every key)"
        if override.is_sweep_override():
            continue
        try:
            OmegaConf.update(copy.deepcopy(schema), key, override.value(), merge=True)
        except (ConfigAttributeError, ConfigKeyError):
            return f"unknown configuration key: {key} (batchgen --help lists every key)"
        except OmegaConfBaseException as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            return f"{arg}: {reason} (batchgen --help lists every key with its type)"
    return None
