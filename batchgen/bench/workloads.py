"""Seeded benchmark workloads, written as Parquet so anyone can rerun them.

A workload is a table with columns ``id`` (int64), ``prompt`` (text), ``prompt_token_ids`` (the prompt as
the model's tokenizer encodes it — every system gets exactly these ids) and ``max_tokens`` (tokens each
row generates; the benchmark sets ``ignore_eos`` so every system does identical work). When rows differ in
``max_tokens`` there is also a ``sampling`` struct column ``{max_tokens}`` that the batchgen pipeline reads
as per-row overrides.

Prompts are text made of whole-word tokens of the tokenizer's vocabulary (``" word"`` pieces), so a prompt
of N words encodes to about N tokens and a template ending in a blank line is a token prefix of every prompt
built on it.

Workloads (``make_workload(name, ...)``):

* ``shared_prefix``: batch labelling — 4 few-shot templates of ~``prefix_tokens`` tokens, each followed by a
  distinct ~``item_tokens``-token item; rows are assigned to templates round-robin, then shuffled, so that
  grouping by prefix matters.
* ``unique``: no shared prefixes; prompt lengths uniform in [``min_prompt``, ``max_prompt``] tokens.
* ``long_tail``: chat-like traffic — prompt and output lengths lognormal (medians ``prompt_median`` and
  ``max_tokens``, clipped), per-row ``max_tokens``.

Invariant: the same arguments and tokenizer give the same table (numpy ``default_rng(seed)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORKLOADS = ("shared_prefix", "unique", "long_tail")


@dataclass
class WorkloadSpec:
    """Size knobs of a workload (defaults are the published sizes)."""

    rows: int = 256
    max_tokens: int = 64
    seed: int = 0
    num_templates: int = 4
    prefix_tokens: int = 300
    item_tokens: int = 30
    min_prompt: int = 50
    max_prompt: int = 600
    prompt_median: float = 150.0
    prompt_sigma: float = 0.9
    output_sigma: float = 0.8
    max_prompt_long_tail: int = 1500


def word_pieces(tokenizer: Any) -> list[str]:
    """Vocabulary entries that decode to a space followed by 2+ ASCII letters, sorted (deterministic)."""
    words = set()
    for tid in range(len(tokenizer)):
        s = tokenizer.decode([tid])
        if re.fullmatch(r" [a-z]{2,}", s):
            words.add(s)
    if len(words) < 50:
        raise ValueError(f"tokenizer has only {len(words)} whole-word pieces; cannot build prompts")
    return sorted(words)


def _text(rng: np.random.Generator, words: list[str], n: int) -> str:
    idx = rng.integers(0, len(words), size=max(1, int(n)))
    return "".join(words[i] for i in idx).lstrip()


def _prompts(name: str, spec: WorkloadSpec, words: list[str]) -> tuple[list[str], list[int], list[int]]:
    """(prompt texts, max_tokens per row, template index per row or -1)."""
    rng = np.random.default_rng([spec.seed, WORKLOADS.index(name)])
    n = spec.rows
    if name == "shared_prefix":
        templates = []
        for t in range(spec.num_templates):
            # a few "examples" separated by newlines, ending with a blank line: a clean token boundary
            parts, left = [], spec.prefix_tokens - 8
            while left > 0:
                k = int(min(left, rng.integers(40, 80)))
                parts.append(f"Example: {_text(rng, words, k)}")
                left -= k + 3
            templates.append(f"Task {t}: label each item.\n" + "\n".join(parts) + "\n\n")
        which = np.arange(n) % spec.num_templates
        rng.shuffle(which)
        prompts = [
            templates[w] + "Item: " + _text(rng, words, spec.item_tokens - 2) + "\nLabel:" for w in which
        ]
        return prompts, [spec.max_tokens] * n, [int(w) for w in which]
    if name == "unique":
        lens = rng.integers(spec.min_prompt, spec.max_prompt + 1, size=n)
        # a distinct leading number makes the first block of every prompt distinct
        prompts = [f"{i}: " + _text(rng, words, int(k) - 2) for i, k in enumerate(lens)]
        return prompts, [spec.max_tokens] * n, [-1] * n
    if name == "long_tail":
        plens = np.clip(
            np.round(rng.lognormal(np.log(spec.prompt_median), spec.prompt_sigma, size=n)),
            8,
            spec.max_prompt_long_tail,
        )
        olens = np.clip(
            np.round(rng.lognormal(np.log(spec.max_tokens), spec.output_sigma, size=n)),
            4,
            4 * spec.max_tokens,
        )
        prompts = [f"{i}: " + _text(rng, words, int(k) - 2) for i, k in enumerate(plens)]
        return prompts, [int(o) for o in olens], [-1] * n
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def make_workload(name: str, spec: WorkloadSpec, tokenizer: Any) -> pa.Table:
    """Build the workload table (see the module docstring)."""
    words = word_pieces(tokenizer)
    prompts, max_tokens, template = _prompts(name, spec, words)
    ids = tokenizer(prompts, add_special_tokens=True, return_attention_mask=False)["input_ids"]
    cols: dict[str, Any] = {
        "id": pa.array(range(spec.rows), pa.int64()),
        "prompt": pa.array(prompts, pa.string()),
        "prompt_token_ids": pa.array(ids, pa.list_(pa.int32())),
        "max_tokens": pa.array(max_tokens, pa.int32()),
        "template": pa.array(template, pa.int32()),
    }
    if len(set(max_tokens)) > 1:
        cols["sampling"] = pa.StructArray.from_arrays(
            [pa.array(max_tokens, pa.int64())], names=["max_tokens"]
        )
    return pa.table(cols, metadata={"workload": name, "seed": str(spec.seed)})


def write_workload(table: pa.Table, path: str | Path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return str(path)


def read_workload(path: str | Path) -> dict[str, Any]:
    """The columns the benchmark systems need: token ids and max_tokens per row, in row order."""
    t = pq.read_table(path, columns=["id", "prompt_token_ids", "max_tokens"])
    return {
        "ids": t.column("id").to_pylist(),
        "token_ids": t.column("prompt_token_ids").to_pylist(),
        "max_tokens": t.column("max_tokens").to_pylist(),
    }


def describe(table: pa.Table) -> dict[str, Any]:
    """Row count and prompt/output token totals of a workload table."""
    lens = [len(x) for x in table.column("prompt_token_ids").to_pylist()]
    outs = table.column("max_tokens").to_pylist()
    return {
        "rows": table.num_rows,
        "prompt_tokens": int(sum(lens)),
        "prompt_len_min": int(min(lens)),
        "prompt_len_median": float(np.median(lens)),
        "prompt_len_max": int(max(lens)),
        "output_tokens": int(sum(outs)),
        "output_len_min": int(min(outs)),
        "output_len_median": float(np.median(outs)),
        "output_len_max": int(max(outs)),
    }
