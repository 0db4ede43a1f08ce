"""``batchgen --help``: every option of the job config with its default and its documentation.

The documentation of an option is the docstring of its dataclass field (the string literal right below it),
and its default is the value in a default :class:`~batchgen.job.config.JobConfig`, so the help and the code
cannot drift apart. Invariant: every leaf option has a non-empty doc (tested), and no doc contains ``${``
(Hydra would read it as an interpolation).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from typing import Any

from batchgen.job.config import GROUPS, JobConfig

HELP_HEADER = """batchgen: offline batch generation with a paged-attention engine.
Parquet prompts in, Parquet generations out; resumable, prefix-grouped, shardable (Slurm arrays).

Usage:
  batchgen [key=value ...]
  batchgen data.input=prompts.parquet data.output=out/ model.path=/ckpt/qwen2.5-0.5b sampling.max_tokens=256
  batchgen                      # the embedded demo: tiny model + shipped sample prompts, on CPU
  batchgen --cfg job            # print the resolved configuration and exit
"""

HELP_FOOTER = """Exit status: 0 done; 3 done, but more error rows than run.max_error_fraction; 75 incomplete:
stopped by a signal, the disk is full or a tensor-parallel rank was lost (rerun the same command to resume);
2 invalid configuration, input or output directory; 1 other errors (including Hydra's own messages about misspelt keys).
Sweeps (-m): give each job its own output, e.g. data.output=out/<the job number, hydra:job.num>.
Hydra flags: batchgen --hydra-help"""

GROUP_TITLES = {
    "engine": "``engine.*``: the paged-attention engine.",
    "sampling": "``sampling.*``: how each row's completions are generated (batchgen.SamplingParams).",
}
"""Titles of the groups whose class docstring is not about the job; the others use their first line."""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right below each field."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _value_text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def option_docs() -> list[tuple[str, str, str]]:
    """Every leaf option as (dotted key, default, doc), in declaration order."""
    out: list[tuple[str, str, str]] = []

    def walk(prefix: str, obj: Any) -> None:
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}.{f.name}", value)
            else:
                out.append((f"{prefix}.{f.name}", _value_text(value), docs.get(f.name, "")))

    defaults = JobConfig()
    top = field_docs(JobConfig)
    for f in dataclasses.fields(JobConfig):  # top-level plain keys (task) first, then the groups
        if f.name not in GROUPS:
            out.append((f.name, _value_text(getattr(defaults, f.name)), top.get(f.name, "")))
    for name in GROUPS:
        walk(name, getattr(defaults, name))
    return out


def render_options(width: int = 100) -> str:
    """The option list shown by ``batchgen --help``."""
    lines: list[str] = []
    group = None
    for key, default, doc in option_docs():
        g = key.split(".")[0] if "." in key else ""
        if g != group:
            group = g
            if g:
                title = GROUP_TITLES.get(g) or (inspect.getdoc(GROUPS[g]) or "").splitlines()[0]
                lines.append(f"\n{g}:  {title}")
            else:
                lines.append("\njob:  what the job computes.")
        lines.append(f"  {key}={default}")
        for wl in textwrap.wrap(doc, width=width - 6, break_on_hyphens=False):
            lines.append(f"      {wl}")
    return "\n".join(lines).replace("``", "").lstrip("\n")


def help_template() -> str:
    """Hydra help template (``hydra.help.template``): header, config groups, every option with its doc."""
    body = render_options()
    # string.Template escaping for Hydra's substitution; no '${' may appear (OmegaConf interpolation).
    body = body.replace("$", "$$")
    assert "$${" not in body, "option docs must not contain '${'"
    return (
        "${hydra.help.header}\n"
        "== Configuration groups (group=option) ==\n$APP_CONFIG_GROUPS\n"
        "== Options (key=default) ==\n" + body + "\n\n${hydra.help.footer}\n"
    )
