"""Cost of structured outputs: ``python -m batchgen.bench.structured [--model PATH] [--rows 64] [--max-tokens 64]``.

Two figures, on the same workload (``--rows`` prompts, temperature 1, seeded, ``--max-tokens``):

* **mask µs per row-step**: the time :meth:`batchgen.engine.features.structured.StructuredOutputs.mask` takes per
  constrained row and step (matcher catch-up with the last token, batched bitmask fill; the in-place masking
  of the logits, in the runner, is not counted), timed around each call during the constrained runs, for each constraint kind (a nested JSON
  schema with arrays, enums, integers and optional fields; a regex; a choice).
  The fastest of ``--repeats`` runs is shown (the least disturbed on a shared machine).
* **end-to-end slowdown**: engine time per generated token of the constrained run over that of the same
  prompts unconstrained (generation lengths differ: the grammar ends the output, so the per-token time is the
  fair comparison; wall times are printed too).

The default model is a random-weight tiny Llama (vocabulary 4096): its forward is cheap, so the slowdown is an
upper bound of what a real model sees, while the mask cost grows with the vocabulary (pass ``--model`` with a
real checkpoint to measure at 128k–150k tokens). On CUDA the mask's CPU work runs after the forward is launched
and overlaps it; the figure here is the CPU time of the call.
"""

from __future__ import annotations

import argparse
import os
import time

from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "integer"}, "city": {"type": "string", "maxLength": 10}},
            "required": ["zip"],
        },
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags", "address"],
}
KINDS = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": r"[A-Z][a-z]{2,12}( [a-z]{1,8}){0,6}\."},
    "choice": {"choice": ["positive", "negative", "neutral", "mixed feelings"]},
}


def _run(llm: LLM, prompts: list[str], extra: dict, max_tokens: int) -> tuple[float, int, list]:
    params = [SamplingParams(max_tokens=max_tokens, seed=i, **extra) for i in range(len(prompts))]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    return wall, sum(len(o.outputs[0].token_ids) for o in outs), outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=3, help="runs per workload; the fastest is shown")
    args = ap.parse_args(argv)
    if args.model is None:
        from batchgen.models.tiny import tiny_default_checkpoint

        args.model = tiny_default_checkpoint()
    llm = LLM(args.model, device=args.device, max_num_seqs=args.rows, num_blocks=max(256, args.rows * 16))
    engine = llm.engine
    prompts = [f"Record {i}: describe the item in a few words." for i in range(args.rows)]
    _run(llm, prompts[:4], {}, 4)  # warm-up (kernels, allocator)
    _run(llm, prompts[:4], {"choice": ["a", "b"]}, 4)  # builds the grammar engine (tokenizer info)
    so = engine.structured
    timed = {"s": 0.0, "rows": 0, "calls": 0}
    inner = so.mask

    def mask(seqs):  # measurement only
        t = time.perf_counter()
        result = inner(seqs)
        timed["s"] += time.perf_counter() - t
        timed["rows"] += sum(1 for s in seqs if s.params.constrained)
        timed["calls"] += 1
        return result

    so.mask = mask  # type: ignore[method-assign]
    base_wall, base_tokens, _ = min(_run(llm, prompts, {}, args.max_tokens) for _ in range(args.repeats))
    base_per_tok = base_wall / max(1, base_tokens)
    print(f"model={args.model} vocab={engine.model.config.vocab_size} device={engine.device} rows={args.rows} "
          f"max_tokens={args.max_tokens} cpus={len(os.sched_getaffinity(0))} load={os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'workload':<12} {'wall s':>8} {'tokens':>7} {'ms/token':>9} {'slowdown':>9} {'mask µs/row-step':>17} "
          f"{'complete':>9} {'compile':>9}")  # fmt: skip
    print(f"{'none':<12} {base_wall:8.2f} {base_tokens:7d} {base_per_tok * 1e3:9.3f} {'1.00x':>9} {'-':>17} {'-':>9} {'-':>9}")  # fmt: skip
    for kind, extra in KINDS.items():
        misses = so.misses
        t = time.perf_counter()
        so.compile(SamplingParams(**extra))
        compile_s = time.perf_counter() - t if so.misses > misses else 0.0
        runs = []
        for _ in range(args.repeats):
            timed.update(s=0.0, rows=0, calls=0)
            runs.append(
                (*_run(llm, prompts, extra, args.max_tokens), timed["s"] / max(1, timed["rows"]) * 1e6)
            )
        wall, tokens, outs, _ = min(runs, key=lambda r: r[0])
        mask_us = min(r[3] for r in runs)
        per_tok = wall / max(1, tokens)
        ok = sum(1 for o in outs if o.outputs[0].constraint_satisfied)
        print(f"{kind:<12} {wall:8.2f} {tokens:7d} {per_tok * 1e3:9.3f} {per_tok / base_per_tok:8.2f}x "
              f"{mask_us:17.1f} {ok:>4d}/{len(outs):<4d} {compile_s * 1e3:7.1f}ms")  # fmt: skip


if __name__ == "__main__":
    main()
