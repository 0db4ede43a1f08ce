"""Command-line arguments batchgen reads before Hydra does: ``--version``, and a single string given to a
list option (``sampling.stop=END``), which Hydra's typed config would refuse ("str is not a ListConfig")."""

from __future__ import annotations

import re

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
