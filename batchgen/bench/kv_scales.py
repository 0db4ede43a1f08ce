"""Greedy agreement of an fp8 KV cache with the float32 cache, with and without calibrated KV-cache scales
(``python -m batchgen.bench.kv_scales``).

The model is `batchgen.bench.quant`'s random-weight llama. Scales are calibrated the way llm-compressor
calibrates a ``kv_cache_scheme``: the float32 model runs calibration prompts (their own random ids, not the
evaluation prompts), each layer's K and V absolute maxima are recorded (per tensor, or per KV head), the scale
is ``absmax / 448`` (e4m3's largest value), and the scales are written into a copy of the checkpoint as
``self_attn.k_scale`` / ``v_scale`` with a compressed-tensors ``kv_cache_scheme``, which the loader reads.
Agreement is the share of generated tokens before each sequence's first difference from the float32 cache's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

FP8_MAX = 448.0


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of generated tokens before each sequence's first difference (greedy agreement)."""
    same = sum(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, b))
    return same / max(1, sum(map(len, a)))


def calibrate(path: str, prompts: list[list[int]], new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, Hkv]`` absolute maxima of K and V over `prompts` and `new` greedy tokens each (float32 cache)."""
    from batchgen import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=64, kv_cache_memory="256MiB")
    runner = llm.engine.runner
    layer_of = {runner.kv_cache[i][0].data_ptr(): i for i in range(runner.kv_cache.shape[0])}
    n_layers, n_kv = runner.kv_cache.shape[0], runner.kv_cache.shape[-2]
    k_max, v_max = torch.zeros(n_layers, n_kv), torch.zeros(n_layers, n_kv)
    forward = runner.attn.forward

    def record(q, k, v, k_cache, v_cache, meta, options, kv_scales=None):
        i = layer_of[k_cache.data_ptr()]
        k_max[i] = torch.maximum(k_max[i], k.abs().amax(dim=(0, 2)))
        v_max[i] = torch.maximum(v_max[i], v.abs().amax(dim=(0, 2)))
        return forward(q, k, v, k_cache, v_cache, meta, options, kv_scales)

    runner.attn.forward = record
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return k_max, v_max


def write_scales(path: str, out: Path, k_max: torch.Tensor, v_max: torch.Tensor, per_head: bool) -> str:
    """A copy of checkpoint `path` with fp8 KV-cache scales (compressed-tensors' kv_cache_scheme layout)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    state = load_file(str(out / "model.safetensors"))
    for i in range(k_max.shape[0]):
        for name, amax in (("k_scale", k_max[i]), ("v_scale", v_max[i])):
            scale = (amax if per_head else amax.max().reshape(1)) / FP8_MAX
            state[f"model.layers.{i}.self_attn.{name}"] = scale.clamp(min=1e-12).contiguous()
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
        "config_groups": {}, "ignore": [],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": "attn_head" if per_head else "tensor"},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def main() -> None:
    from batchgen import LLM, SamplingParams
    from batchgen.models.tiny import build_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--seqs", type=int, default=64)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="batchgen-kv-scales-"))
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=4,
                 intermediate_size=3 * args.hidden)  # fmt: skip
    f32 = build_checkpoint(root / "f32", "llama", **shape)

    def prompts(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(5, 4000, (args.prompt,), generator=g).tolist() for _ in range(args.seqs)]

    k_max, v_max = calibrate(f32, prompts(1)[:16], args.new)
    tensor = write_scales(f32, root / "tensor", k_max, v_max, per_head=False)
    head = write_scales(f32, root / "head", k_max, v_max, per_head=True)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    evaluation = [{"prompt_token_ids": x} for x in prompts(0)]

    def run(path: str, kv: str) -> list[list[int]]:
        llm = LLM(path, max_num_seqs=64, kv_cache_memory="256MiB", kv_cache_dtype=kv)
        return [o.outputs[0].token_ids for o in llm.generate(evaluation, params, use_tqdm=False)]

    base = run(f32, "auto")
    print(f"K absmax per layer {k_max.amax(1).tolist()}, V absmax {v_max.amax(1).tolist()}")
    rows = [("bfloat16 cache", f32, "bfloat16")]
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        rows += [(f"{kv}, scale 1", f32, kv), (f"{kv}, calibrated per-tensor scales", tensor, kv),
                 (f"{kv}, calibrated per-head scales", head, kv)]  # fmt: skip
    for name, path, kv in rows:
        print(
            json.dumps({"cache": name, "greedy_agreement_vs_f32": round(_agreement(run(path, kv), base), 3)})
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
