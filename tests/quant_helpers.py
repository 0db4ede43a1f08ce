"""Test helpers for quantized checkpoints: the fixture writers (GGUF re-exported from the package's) and the
greedy comparison with transformers every format's equality test makes."""

import torch

from batchgen.models.quant.gguf_writer import random_blocks, write_gguf

__all__ = [
    "NEW", "PROMPTS", "batchgen_greedy", "random_blocks", "transformers_greedy", "transformers_model",
    "write_compressed_tensors", "write_gguf",
]  # fmt: skip

PROMPTS = [[1, 17, 33, 90], [1, 200, 5, 9, 77, 31, 8], [1, 64]]
NEW = 12


def batchgen_greedy(llm, prompts=PROMPTS, new: int = NEW) -> list[list[int]]:
    """`new` greedy tokens per prompt (token ids) from a batchgen LLM, EOS ignored."""
    from batchgen import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def transformers_model(path, gguf_file: str | None = None):
    """transformers' own float32 loading of the checkpoint (``gguf_file=`` for a GGUF file in ``path``), EOS off."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **extra).eval()
    hf.generation_config.eos_token_id = None
    return hf


def transformers_greedy(hf, prompts=PROMPTS, new: int = NEW) -> list[list[int]]:
    """`new` greedy tokens per prompt from transformers' ``generate`` (a model or a checkpoint path), one
    prompt at a time (no padding)."""
    if not isinstance(hf, torch.nn.Module):
        hf = transformers_model(hf)
    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def write_compressed_tensors(
    ckpt: str, out, bits: int = 4, group_size: int | None = 128, dtype=None, ignore=("lm_head",),
    symmetric: bool = True, mlp: tuple[int, int | None, bool] | None = None, actorder: str | None = None,
) -> str:  # fmt: skip
    """A compressed-tensors pack-quantized (W4A16 / W8A16, symmetric or with zero points) copy of the tiny
    checkpoint `ckpt`, laid out as llm-compressor saves one: each Linear's weight_packed (compressed-tensors' own
    pack_to_int32), weight_scale (absmax / qmax per group, in the checkpoint dtype), weight_shape; a
    quantization_config. `ignore`: module names, last name parts or ``re:`` patterns left float. `mlp` (bits,
    group_size, symmetric): a second config group for the MLP projections (``re:.*mlp.*``), the first one then
    targeting ``re:.*self_attn.*``. `actorder`: the config's activation order; ``group`` / ``dynamic`` scatter
    each group over the inputs (a random permutation per projection) and save its ``weight_g_idx``."""
    import json
    import re
    import shutil
    from pathlib import Path

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    src, out = Path(ckpt), Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    dtype = dtype or getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))
    state = load_file(str(src / "model.safetensors"))
    main = (bits, group_size, symmetric)
    tensors = {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        ignored = any(re.match(i[3:], module) if i.startswith("re:") else i in (module, module.split(".")[-1])
                      for i in ignore)  # fmt: skip
        if w.dim() != 2 or "embed_tokens" in name or ignored:
            tensors[name] = w.to(dtype) if w.is_floating_point() else w
            continue
        bits, group_size, symmetric = mlp if mlp and ".mlp." in module else main
        qmax = (1 << (bits - 1)) - 1
        rows, cols = w.shape
        g = group_size or cols
        order = torch.arange(cols)
        if actorder in ("group", "dynamic"):  # group j holds the inputs order[j*g:(j+1)*g]
            order = torch.randperm(cols, generator=torch.Generator().manual_seed(rows + cols))
            tensors[f"{module}.weight_g_idx"] = (torch.argsort(order) // g).to(torch.int32)
        groups = w.float()[:, order].reshape(rows, cols // g, g)
        if symmetric:
            scale = (groups.abs().amax(-1) / qmax).clamp(min=1e-8).to(dtype)
            zp = torch.zeros(scale.shape)
        else:  # min/max over 2^bits - 1 steps, zero point in the signed range
            lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
            scale = ((hi - lo) / (2 * qmax + 1)).clamp(min=1e-8).to(dtype)
            zp = (-qmax - 1 - torch.round(lo / scale.float())).clamp(-qmax - 1, qmax)
            tensors[f"{module}.weight_zero_point"] = pack_to_int32(zp.to(torch.int8), bits, packed_dim=0)
        q = (
            (torch.round(groups / scale.float()[..., None]) + zp[..., None])
            .clamp(-qmax - 1, qmax)
            .reshape(rows, cols)
            .to(torch.int8)
        )
        q = torch.empty_like(q).index_copy_(1, order, q)  # back to the inputs' order
        tensors[f"{module}.weight_packed"] = pack_to_int32(q, bits)
        tensors[f"{module}.weight_scale"] = scale.contiguous()
        tensors[f"{module}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"))

    def group(targets, bits, group_size, symmetric):
        strategy = "group" if group_size else "channel"
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
                   "group_size": group_size, "dynamic": False, "observer": "minmax", "actorder": actorder,
                   "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}  # fmt: skip
        return {"targets": targets, "weights": weights, "input_activations": None, "output_activations": None,
                "format": "pack-quantized"}  # fmt: skip

    groups = {"group_0": group(["Linear"], *main)}
    if mlp:
        groups = {"group_0": group(["re:.*self_attn.*"], *main), "group_1": group(["re:.*mlp.*"], *mlp)}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def dequantized_copy(path: str, out, marker: str, weight, quant_suffixes: tuple[str, ...]) -> str:
    """A float32 copy of the quantized checkpoint `path` at `out`, for transformers to run: each projection
    holding a tensor ``<prefix>.<marker>`` gets ``weight(state, prefix)`` (its dequantization from the
    specification) as its ``weight``; tensors ending in `quant_suffixes` are dropped, the others widened to
    float32; no quantization_config."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    out = Path(out)
    shutil.copytree(path, out)
    state = load_file(str(out / "model.safetensors"))
    dense = {}
    for name, t in state.items():
        if name.endswith(f".{marker}"):
            prefix = name.removesuffix(f".{marker}")
            dense[f"{prefix}.weight"] = weight(state, prefix).float()
        elif not name.endswith(quant_suffixes):
            dense[name] = t.float()
    save_file(dense, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)
