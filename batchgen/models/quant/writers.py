"""Write a tiny float checkpoint (`batchgen.models.tiny.build_checkpoint`) as a GPTQ, AWQ, fp8 or
compressed-tensors checkpoint, laid out from the formats' specifications as their quantizers save them
(GPTQModel / AutoGPTQ's packer, AutoAWQ's ``WQLinear_GEMM.from_linear``, transformers' fine-grained fp8,
llm-compressor's fp8, W8A8 and W4A16): the test and benchmark fixtures of the loaders in :mod:`batchgen.models.quant`. Quantization is round-to-nearest with
min/max (or absmax) scales: what matters to a loader is the layout, not how good the weights are.

Every 2-D projection of the decoder layers is quantized; embeddings, norms and ``lm_head`` stay float.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned `bits`-bit values packed into int32 words along `axis`, value ``j`` of a word in bits
    ``bits*j ...``."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per) << (np.arange(per, dtype=np.uint32) * bits)
    words = np.bitwise_or.reduce(v, axis=-1)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def _rewrite(ckpt, out, quantize, quantization_config: dict, dtype=torch.float16) -> str:
    from safetensors.torch import load_file, save_file

    src, out = Path(ckpt), Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    tensors = {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if w.dim() == 2 and name.startswith("model.layers.") and name.endswith(".weight"):
            tensors.update({f"{module}.{k}": v for k, v in quantize(module, w.double()).items()})
        else:
            tensors[name] = w.to(dtype) if w.is_floating_point() else w
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"))
    cfg["quantization_config"] = quantization_config
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def _minmax(w: np.ndarray, bits: int, sym: bool) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's quantizer on groups ``w [..., members]``: (float16 scales, integer zeros) per group."""
    maxq = (1 << bits) - 1
    lo, hi = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
    if sym:
        big = np.maximum(-lo, hi)
        lo, hi = -big, big
    scale = ((hi - lo) / maxq).astype(np.float16)
    scale = np.where(scale == 0, np.float16(1e-4), scale)
    zero = np.full(scale.shape, (maxq + 1) // 2) if sym else np.clip(np.round(-lo / scale), 1, maxq)
    return scale, zero.astype(np.int64)


def write_gptq(ckpt, out, bits: int = 4, group_size: int = 32, desc_act: bool = False, sym: bool = True,
               checkpoint_format: str = "gptq", seed: int = 0) -> str:  # fmt: skip
    """A GPTQ copy of `ckpt`: qweight packed along K, qzeros along N (``z - 1`` for ``checkpoint_format``
    ``gptq``), float16 scales, g_idx (with `desc_act`, a random activation order per layer input, shared by
    the projections reading that input, as GPTQ's Hessian order is). `group_size` -1: one group per row."""
    rng = np.random.default_rng(seed)
    orders: dict[tuple[str, int], np.ndarray] = {}
    maxq = (1 << bits) - 1

    def quantize(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        g = k if group_size == -1 else group_size
        key = (module.rsplit(".", 1)[0] + (".o" if module.endswith("o_proj") else ""), k)
        if desc_act:
            if module.endswith(("down_proj", "o_proj")) or key not in orders:
                orders[key] = rng.permutation(k)
            order = orders[key]
        else:
            order = np.arange(k)
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[order] = np.arange(k) // g  # the i-th input in activation order belongs to group i // g
        wt = w.numpy().T  # [K, N]
        groups = -(-k // g)  # a last group cut short when g does not divide k
        scales = np.empty((groups, n), dtype=np.float16)
        zeros = np.empty((groups, n), dtype=np.int64)
        for grp in range(groups):
            scales[grp], zeros[grp] = _minmax(wt[g_idx == grp].T, bits, sym)
        s, z = scales.astype(np.float64)[g_idx], zeros[g_idx]
        q = np.clip(np.round(wt / s) + z, 0, maxq)
        stored = zeros - 1 if checkpoint_format == "gptq" else zeros
        return {
            "qweight": torch.from_numpy(_pack(q, bits, axis=0)),
            "qzeros": torch.from_numpy(_pack(stored & maxq, bits, axis=1)),
            "scales": torch.from_numpy(scales),
            "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
        }

    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": checkpoint_format, "static_groups": False, "true_sequential": True,
              "damp_percent": 0.01, "lm_head": False}  # fmt: skip
    return _rewrite(ckpt, out, quantize, config)


def write_awq(ckpt, out, group_size: int = 32) -> str:
    """An AWQ (GEMM) copy of `ckpt`: qweight ``[K, N / 8]`` and qzeros ``[G, N / 8]`` packed along N in AutoAWQ's
    order [0, 2, 4, 6, 1, 3, 5, 7], float16 scales ``[G, N]``; asymmetric 4-bit."""

    def interleave(v: np.ndarray) -> np.ndarray:  # [R, N] -> columns in packing order
        cols = v.shape[1]
        index = (np.arange(0, cols, 8)[:, None] + np.array(AWQ_ORDER)[None, :]).reshape(-1)
        return v[:, index]

    def quantize(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        groups = k // group_size
        scales, zeros = _minmax(w.numpy().reshape(n, groups, group_size), 4, sym=False)  # [N, G]
        s = np.repeat(scales.astype(np.float64), group_size, axis=1)
        z = np.repeat(zeros, group_size, axis=1)
        q = np.clip(np.round(w.numpy() / s) + z, 0, 15)  # [N, K]
        return {
            "qweight": torch.from_numpy(_pack(interleave(q.T), 4, axis=1)),
            "qzeros": torch.from_numpy(_pack(interleave(zeros.T), 4, axis=1)),
            "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
        }

    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}  # fmt: skip
    return _rewrite(ckpt, out, quantize, config)


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def _fp8_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as float8_e4m3fn in blocks of ``bn`` x ``bk``, and the scales ``[ceil(N / bn), ceil(K / bk)]``
    float32 = block absmax / 448 (the last blocks of a row or column cut short)."""
    n, k = w.shape
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.float64)
    pad[:n, :k] = w
    blocks = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-8).float()
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k].double()
    return _fp8(w, full), scale


def write_block_fp8(ckpt, out, block: tuple[int, int] = (32, 32), dtype=torch.bfloat16) -> str:
    """A fine-grained fp8 copy of `ckpt` (transformers' FineGrainedFP8 layout: float8_e4m3fn weight,
    ``weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]`` float32 = block absmax / 448)."""
    bn, bk = block

    def quantize(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = _fp8_blocks(w, bn, bk)
        return {"weight": q, "weight_scale_inv": scale}

    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": [bn, bk]}  # fmt: skip
    return _rewrite(ckpt, out, quantize, config, dtype)


def write_compressed_fp8(ckpt, out, strategy: str = "channel", dtype=torch.bfloat16) -> str:
    """A compressed-tensors ``float-quantized`` copy of `ckpt` (llm-compressor's FP8 weight-only layout:
    float8_e4m3fn weight, weight_scale ``[N, 1]`` per channel or ``[1]`` per tensor, in the checkpoint dtype)."""

    def quantize(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / 448).clamp(min=1e-8).to(dtype)
        return {"weight": _fp8(w, scale.double() if strategy == "channel" else scale.double()[0]),
                "weight_scale": scale}  # fmt: skip

    config = _compressed_config("float-quantized", _args("float", strategy))
    return _rewrite(ckpt, out, quantize, config, dtype)


def write_compressed_fp8_block(ckpt, out, block: int = 128, dtype=torch.bfloat16) -> str:
    """A compressed-tensors ``float-quantized`` copy of `ckpt` as llm-compressor saves its ``FP8_BLOCK`` preset:
    float8_e4m3fn ``weight`` with ``weight_scale`` ``[ceil(N / block), ceil(K / block)]`` float32 = block absmax
    / 448, and fp8 input activations quantized dynamically per token in groups of `block` inputs."""

    def quantize(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = _fp8_blocks(w, block, block)
        return {"weight": q, "weight_scale": scale}

    weights = {**_args("float", "block", observer="memoryless_minmax"), "block_structure": [block, block]}
    inputs = {**_args("float", "group", dynamic=True, observer=None), "group_size": block}
    return _rewrite(ckpt, out, quantize, _compressed_config("float-quantized", weights, inputs), dtype)


def _args(kind: str, strategy: str, dynamic: bool = False, observer: str | None = "minmax") -> dict:
    """compressed-tensors' 8-bit symmetric quantization args of `kind` (``int`` / ``float``), as llm-compressor
    saves them (its recent versions write every field, ``observer_kwargs`` a dict among them)."""
    return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": None, "block_structure": None, "observer": observer, "actorder": None,
            "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}  # fmt: skip


def _compressed_config(fmt: str, weights: dict, inputs: dict | None = None) -> dict:
    """A compressed-tensors ``quantization_config`` of one config group over every ``Linear`` but ``lm_head``."""
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }  # fmt: skip


def write_compressed_w8a8(
    ckpt, out, weights: str = "int8", inputs: str = "dynamic", dtype=torch.bfloat16, input_scale: float = 0.02
) -> str:
    """A compressed-tensors copy of `ckpt` with quantized input activations, as llm-compressor saves its W8A8
    schemes: `weights` ``int8`` (the ``int-quantized`` format: int8 ``weight``, ``weight_scale`` ``[N, 1]`` per
    channel; the ``W8A8`` preset) or ``fp8`` (``float-quantized``: float8_e4m3fn ``weight`` per channel, the
    ``FP8_DYNAMIC`` preset); `inputs` ``dynamic`` (per token, 8-bit of the weights' type) or ``static`` (one
    ``input_scale`` per projection, `input_scale`, the same for the parts of a fused one: their observers see
    the same input)."""
    kind = "int" if weights == "int8" else "float"
    qmax = 127 if kind == "int" else 448

    def quantize(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = (w.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=1e-8).to(dtype)
        if kind == "int":
            q = torch.round(w / scale.double()).clamp(-128, 127).to(torch.int8)
        else:
            q = _fp8(w, scale.double())
        tensors = {"weight": q, "weight_scale": scale}
        if inputs == "static":
            tensors["input_scale"] = torch.tensor([input_scale], dtype=dtype)
        return tensors

    dynamic = inputs == "dynamic"
    acts = _args(kind, "token" if dynamic else "tensor", dynamic, None if dynamic else "minmax")
    config = _compressed_config(
        "int-quantized" if kind == "int" else "float-quantized", _args(kind, "channel"), acts
    )
    return _rewrite(ckpt, out, quantize, config, dtype)


def write_compressed_w4a16(ckpt, out, group_size: int = 128, dtype=torch.bfloat16) -> str:
    """A compressed-tensors ``pack-quantized`` copy of `ckpt` (llm-compressor's ``W4A16`` preset: symmetric int4
    weights in groups of `group_size` inputs): ``weight_packed`` int32 ``[N, K / 8]`` (value + 8, eight to a
    word along K, the first in the low bits), ``weight_scale`` ``[N, K / group_size]`` = group absmax / 7 in the
    checkpoint dtype, ``weight_shape`` ``[N, K]``."""

    def quantize(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        groups = w.reshape(n, k // group_size, group_size)
        scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8).to(dtype)
        q = torch.round(groups / scale.double()[..., None]).clamp(-8, 7).reshape(n, k).to(torch.int64)
        return {"weight_packed": torch.from_numpy(_pack((q + 8).numpy(), 4, axis=1)), "weight_scale": scale,
                "weight_shape": torch.tensor([n, k], dtype=torch.int64)}  # fmt: skip

    weights = {**_args("int", "group", observer="minmax"), "num_bits": 4, "group_size": group_size}
    return _rewrite(ckpt, out, quantize, _compressed_config("pack-quantized", weights), dtype)
