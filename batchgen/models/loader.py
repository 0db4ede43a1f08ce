"""Load a Hugging Face checkpoint directory into our `CausalLM`, streaming safetensors tensor by tensor.

Invariants:
- Only `*.safetensors` files are ever opened (through `safetensors.safe_open`); pickle checkpoints
  (`*.bin`, `*.pt`, `*.pth`) are refused, and `trust_remote_code` is never used.
- The model is built on the meta device and materialised once, empty, in the target dtype on the
  target device; then each checkpoint tensor is read, copied into its (slice of a) parameter and
  dropped, so peak memory is the model plus one tensor, never a second full state dict.
- Every parameter element is written exactly once; anything missing, unexpected or misshapen is a
  `ValueError` naming the tensor and the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from batchgen.models.config import ModelConfig, parse_dtype
from batchgen.models.llama import CausalLM

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Checkpoint tensors we know and do not need (old checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a directory: pass a local Hugging Face checkpoint directory "
            "(batchgen never downloads from a hub)"
        )
    return p


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: from `model.safetensors.index.json` if present, else `*.safetensors`."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) missing from {path}: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        hint = (
            f" (found {', '.join(pickles)}: pickle checkpoints are never loaded; convert them to safetensors)"
            if pickles
            else ""
        )
        raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")
    return files


def _resolve_dtype(config: ModelConfig, dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str) and dtype.lower() == "auto":
        return config.dtype
    return parse_dtype(dtype)


def _target(config: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """HF tensor name -> (our parameter name, row offset, rows) for fused params, or (name, 0, -1) as is.

    Returns None for tensors to skip (tied lm_head, RoPE buffers).
    """
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    parts = name.rsplit(".", 2)  # [..., "q_proj", "weight"]
    if len(parts) == 3:
        prefix, proj, kind = parts
        q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        if proj in fused:
            ours, offset, rows = fused[proj]
            return f"{prefix}.{ours}.{kind}", offset, rows
    return name, 0, -1


def _expected_hf_names(config: ModelConfig, params: dict[str, torch.nn.Parameter]) -> dict[str, set[str]]:
    """Our parameter name -> the HF tensor names that must fill it."""
    out: dict[str, set[str]] = {}
    for name in params:
        if ".qkv_proj." in name:
            out[name] = {name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")}
        elif ".gate_up_proj." in name:
            out[name] = {name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")}
        else:
            out[name] = {name}
    return out


@torch.no_grad()
def load_model(
    path: str | os.PathLike, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"
):
    """Build our `CausalLM` from a checkpoint directory (config.json + safetensors).

    `dtype`: 'auto' (the checkpoint's `dtype`/`torch_dtype`, float32 if absent), 'float32', 'bfloat16',
    'float16' or a torch.dtype. `model.config.dtype` reports the dtype actually used.
    """
    ckpt = _checkpoint_dir(path)
    config = ModelConfig.from_pretrained(ckpt)
    config = dataclasses.replace(config, dtype=_resolve_dtype(config, dtype))
    files = safetensors_files(ckpt)
    device = torch.device(device)

    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype=config.dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty may give each module its own copy of a shared parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)

    params = dict(model.named_parameters())  # tied lm_head is deduplicated: only embed_tokens
    expected = _expected_hf_names(config, params)
    seen: dict[str, str] = {}  # HF tensor name -> file it came from
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _target(config, name)
                if target is None:
                    continue
                ours, offset, rows = target
                param = params.get(ours)
                if param is None:
                    raise ValueError(
                        f"unexpected tensor {name!r} in {file.name} (no matching parameter in "
                        f"{config.architecture})"
                    )
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in both {seen[name]} and {file.name}")
                dest = param if rows < 0 else param.narrow(0, offset, rows)
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(dest.shape)} from config.json"
                    )
                dest.copy_(tensor)
                del tensor
                seen[name] = file.name

    missing = sorted(n for names in expected.values() for n in names if n not in seen)
    if missing:
        shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        raise ValueError(
            f"checkpoint {ckpt} is missing tensor(s) {shown}; searched {', '.join(p.name for p in files)}"
        )
    return model


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer via `AutoTokenizer` (local files only, no remote code)."""
    from transformers import AutoTokenizer

    ckpt = _checkpoint_dir(path)
    return AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=False, local_files_only=True)
