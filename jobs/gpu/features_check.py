"""Each engine feature on a device against the same feature on the CPU, float32, on tiny local checkpoints.

    python jobs/gpu/features_check.py                      # cuda against cpu, every feature
    python jobs/gpu/features_check.py --device cpu --features text,lora   # the script itself, anywhere

For every feature the same prompts run through ``batchgen.LLM`` twice, once with ``device=DEVICE`` and once with
``device=cpu`` (the reference: the CPU path is held to transformers by the test suite), and the outputs are
compared: greedy token ids (text, LoRA adapters, images, prefix sharing with copy-on-write of ``n > 1`` greedy
samples, quantized weights through the Triton weight-only GEMMs: GPTQ int4 with activation order and zero
points, block fp8, a GGUF file holding every block format; decode batches of 5 and of 20 rows, above the 16
rows where the GEMMs switch to a dequantized weight), embeddings by cosine similarity (pooling), and, for the fp8 KV cache, the share of rows whose tokens
agree (an approximation on both sides: reported, not required). A line per feature says ``ok``, ``MISMATCH`` or
``ERROR`` with the first difference or the exception; the exit status is 1 when any feature is not ok.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

QUANTIZED = ("gptq", "fp8", "gguf")
"""Features that run a quantized checkpoint (through the Triton weight-only GEMMs on CUDA)."""
FEATURES = ("text", "prefix_cow", "lora", "image", "embed", "kv_fp8", *QUANTIZED)
GGUF_TYPES = {
    "attn_q": 12,
    "attn_k": 2,
    "attn_v": 14,
    "attn_output": 6,
    "ffn_gate": 3,
    "ffn_up": 7,
    "ffn_down": 8,
}
"""One projection per block format: Q4_K, Q4_0, Q6_K, Q5_0, Q4_1, Q5_1, Q8_0 (ggml type ids)."""
NEW = 12


def _prompts() -> list[list[int]]:
    """Token-id prompts: two pairs share a prefix longer than a block, one is a single token."""
    head = [5, 9, 33, 7, 100, 3, 41, 8, 77, 12, 19, 64, 65, 66, 67, 68, 69, 70]
    return [head + [11, 12], [17, 2, 250, 11, 12, 300, 6], head + [401, 402, 7], [60], [17, 2, 250, 11, 9]]


def _greedy(n: int = 1) -> Any:
    from batchgen import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, n=n)


def _tokens(outputs: list[Any]) -> list[list[list[int]]]:
    for o in outputs:
        if getattr(o, "error", None):
            raise RuntimeError(f"request {o.request_id} failed: {o.error}")
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


class Checkpoints:
    """The tiny checkpoints, built once under ``root`` on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, str] = {}

    def get(self, name: str, build: Callable[[str], str]) -> str:
        if name not in self._made:
            self._made[name] = build(str(self.root / name))
        return self._made[name]

    def llama(self) -> str:
        from batchgen.models.tiny import build_checkpoint

        return self.get("llama", lambda p: build_checkpoint(p, hidden_size=64, num_layers=2, num_heads=4))

    def llama256(self) -> str:
        """GGUF's K-quants need rows of whole 256-value blocks."""
        from batchgen.models.tiny import build_checkpoint

        return self.get("llama256", lambda p: build_checkpoint(p, hidden_size=256, intermediate_size=512,
                                                               num_layers=2, num_heads=4))  # fmt: skip

    def quantized(self, kind: str) -> str:
        from batchgen.models.quant import writers

        if kind == "gptq":
            return self.get(
                kind, lambda p: writers.write_gptq(self.llama(), Path(p), desc_act=True, sym=False)
            )
        if kind == "fp8":
            return self.get(kind, lambda p: writers.write_block_fp8(self.llama(), Path(p), block=(48, 40)))
        from batchgen.models.quant.gguf_writer import write_gguf

        return self.get(kind, lambda p: write_gguf(self.llama256(), Path(p + ".gguf"), GGUF_TYPES, seed=1))

    def adapter(self) -> str:
        from batchgen.bench.lora import write_adapter

        return self.get("adapter", lambda p: write_adapter(self.llama(), Path(p), rank=8, seed=1))

    def llava(self) -> str:
        from batchgen.multimodal.tiny import build_llava

        return self.get("llava", lambda p: build_llava(p))


def _images(n: int) -> list[Any]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(56, 56), (90, 40), (33, 120), (200, 150)]
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes[:n]]


def run_feature(name: str, device: str, ckpt: Checkpoints) -> Any:
    """The comparable result of feature ``name`` on ``device`` (float32)."""
    from batchgen import LLM, LoRARequest

    opts: dict[str, Any] = {"device": device, "max_num_seqs": 8, "dtype": "float32", "num_blocks": 256}
    if name in ("text", "prefix_cow", "kv_fp8"):
        if name == "kv_fp8":
            opts["kv_cache_dtype"] = "fp8"
        llm = LLM(ckpt.llama(), **opts)
        return _tokens(llm.generate(_prompts(), _greedy(3 if name == "prefix_cow" else 1), use_tqdm=False))
    if name == "lora":
        llm = LLM(ckpt.llama(), enable_lora=True, max_lora_rank=8, **opts)
        lora = LoRARequest("random", 1, ckpt.adapter())
        requests = [lora if i % 2 == 0 else None for i in range(len(_prompts()))]  # mixed with the base model
        return _tokens(llm.generate(_prompts(), _greedy(), use_tqdm=False, lora_request=requests))
    if name == "image":
        llm = LLM(ckpt.llava(), **opts)
        prompts = [
            {
                "prompt": f"USER: <image>\nWhat is in picture {i}? ASSISTANT:",
                "multi_modal_data": {"image": img},
            }
            for i, img in enumerate(_images(4))
        ]
        prompts.append(
            {"prompt": "USER: <image><image>\nCompare. ASSISTANT:", "multi_modal_data": {"image": _images(2)}}
        )
        return _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    if name in QUANTIZED:  # decode batches of 5 (the fused GEMMs) and 20 (the dequantized weight)
        llm = LLM(ckpt.quantized(name), **{**opts, "max_num_seqs": 32})
        return [_tokens(llm.generate(p, _greedy(), use_tqdm=False)) for p in (_prompts(), _prompts() * 4)]
    if name == "embed":
        llm = LLM(ckpt.llama(), task="embed", **opts)
        out = llm.embed(_prompts(), use_tqdm=False)
        return [list(o.outputs.embedding) for o in out]
    raise ValueError(f"unknown feature {name!r}: one of {', '.join(FEATURES)}")


def compare(name: str, got: Any, ref: Any) -> tuple[bool, str]:
    """``(ok, detail)`` of a feature's result on the device against the CPU's."""
    if name == "embed":
        import torch

        a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        return bool(cos.min() > 0.9999), f"min cosine {float(cos.min()):.6f} over {len(cos)} rows"
    if name in QUANTIZED:  # two batches
        got, ref = got[0] + got[1], ref[0] + ref[1]
    rows = sum(len(r) for r in ref)
    same = sum(g == r for gr, rr in zip(got, ref) for g, r in zip(gr, rr))
    if name == "kv_fp8":  # both sides round K/V to fp8: agreement is reported, not required
        return True, f"{same}/{rows} rows equal to the CPU's fp8 cache"
    if same == rows:
        return True, f"{rows}/{rows} rows equal"
    first = next((i, g, r) for i, (gr, rr) in enumerate(zip(got, ref)) for g, r in zip(gr, rr) if g != r)
    return False, f"{same}/{rows} rows equal; prompt {first[0]}: {first[1]} vs cpu {first[2]}"


def _release() -> None:
    """Free the engine just used (its KV pool and weights) before the next one starts."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--features", default=",".join(FEATURES))
    args = ap.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="batchgen-features-") as tmp:
        ckpt = Checkpoints(Path(tmp))
        for name in args.features.split(","):
            t0 = time.perf_counter()
            try:
                got = run_feature(name, args.device, ckpt)
                _release()
                ok, detail = compare(name, got, run_feature(name, "cpu", ckpt))
                _release()
                status = "ok" if ok else "MISMATCH"
            except Exception as e:  # noqa: BLE001 - each feature reports its own failure; the next one runs
                ok, status = False, "ERROR"
                detail = f"{type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stderr)
            failed += not ok
            print(f"{name:12s} {status:9s} {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"features: {failed} of {len(args.features.split(','))} not ok on {args.device}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
