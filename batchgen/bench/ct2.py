"""CTranslate2 as a system of the throughput benchmark (``ct2``): the engine a CPU user would otherwise pick.

Needs the ``bench-ct2`` extra (``pip install 'batchgen[bench-ct2]'``); without it the system is skipped with
that reason. The checkpoint is converted with CTranslate2's own converter
(``ctranslate2.converters.TransformersConverter``, ``quantization="float32"``) into a temporary directory
(conversion not timed), then ``ctranslate2.Generator(compute_type="float32", intra_threads=threads)`` runs
greedy decoding (``sampling_topk=1``) on the prompt token ids (mapped to the converted vocabulary's strings).

* **Batch size**: CTranslate2 batches statically; the benchmark picks its best ``max_batch_size`` from a
  small untimed sweep (``ct2_batch_sizes``) on the first rows of the workload, and reports the sweep.
* **Per-row max_tokens**: rows are generated in groups of equal ``max_tokens`` (one ``generate_batch`` call
  per group, CTranslate2 sorting each group by length into batches), so no row generates more than asked.
* **ignore_eos**: CTranslate2 has no such switch; ``min_length = max_length`` keeps the end token from
  stopping a row. A row where the end token would be the argmax then continues with the next best token and
  differs from ``hf_generate`` (counted in the table's mismatch rows).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

SWEEP_ROWS = 64
SWEEP_TOKENS = 16


def missing_reason() -> str | None:
    """Why the system cannot run here, or None."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        return f"ctranslate2 is not installed ({e}); pip install 'batchgen[bench-ct2]'"
    return None


def convert(model_path: str, out_dir: str) -> float:
    """Convert the checkpoint to CTranslate2 float32 in ``out_dir``; returns the seconds it took."""
    from ctranslate2.converters import TransformersConverter

    t0 = time.perf_counter()
    TransformersConverter(model_path).convert(out_dir, quantization="float32", force=True)
    return time.perf_counter() - t0


def generate(
    generator: Any, vocab: list[str], prompts: list[list[int]], max_tokens: list[int], batch_size: int
) -> list[list[int]]:
    """Greedy tokens per row (input order), rows grouped by ``max_tokens``."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, mt in enumerate(max_tokens):
        groups[mt].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for mt, rows in groups.items():
        results = generator.generate_batch(
            [[vocab[t] for t in prompts[i]] for i in rows],
            max_batch_size=batch_size,
            batch_type="examples",
            max_length=mt,
            min_length=mt,
            sampling_topk=1,
            include_prompt_in_result=False,
        )
        for i, r in zip(rows, results):
            out[i] = list(r.sequences_ids[0])[:mt]
    return out


def best_batch_size(
    generator: Any, vocab: list[str], prompts: list[list[int]], sizes: list[int]
) -> tuple[int, dict[int, float]]:
    """The ``max_batch_size`` with the most generated tok/s on the first rows (untimed sweep)."""
    rows = prompts[:SWEEP_ROWS]
    sweep: dict[int, float] = {}
    for bs in sorted({min(s, len(rows)) for s in sizes}):
        t0 = time.perf_counter()
        generate(generator, vocab, rows, [SWEEP_TOKENS] * len(rows), bs)
        sweep[bs] = len(rows) * SWEEP_TOKENS / (time.perf_counter() - t0)
    return max(sweep, key=sweep.__getitem__), sweep


def run_ct2(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``ct2`` system (see the module docstring); raises :class:`systems.Skip` without ctranslate2."""
    from batchgen.bench.common import rss_bytes
    from batchgen.bench.systems import Skip, _device, _load_workload, timed_repeats, uncached_result

    reason = missing_reason()
    if reason is not None:
        raise Skip(reason)
    import ctranslate2

    w = _load_workload(spec)
    device = "cuda" if _device(spec).startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory(prefix="bench-ct2-") as model_dir:
        convert_s = convert(spec["model_path"], model_dir)
        vocab = json.loads((Path(model_dir) / "vocabulary.json").read_text())
        generator = ctranslate2.Generator(
            model_dir, device=device, compute_type="float32", intra_threads=int(spec["threads"])
        )
    prompts, max_tokens = w["token_ids"], w["max_tokens"]
    bs, sweep = best_batch_size(generator, vocab, prompts, spec.get("ct2_batch_sizes", [8, 32, 128]))
    base = rss_bytes()
    walls, peak, tokens = timed_repeats(
        lambda: generate(generator, vocab, prompts, max_tokens, bs), spec["repeats"]
    )
    settings = {
        "compute_type": "float32",
        "max_batch_size": bs,
        "batch_size_sweep_tok_s": {str(k): round(v, 1) for k, v in sweep.items()},
        "convert_s": round(convert_s, 1),
        "intra_threads": int(spec["threads"]),
    }
    via = f"ctranslate2 {ctranslate2.__version__} Generator.generate_batch, max_batch_size={bs}"
    return uncached_result(via, walls, tokens, peak, base, settings)
