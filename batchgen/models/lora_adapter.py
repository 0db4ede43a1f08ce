"""Reading a PEFT LoRA adapter directory into the parts of our native decoder's projections.

An adapter is ``adapter_config.json`` + ``adapter_model.safetensors`` (never pickle: a ``.bin`` adapter is
refused with the conversion to do). Each ``<module>.lora_A.weight [r, in]`` / ``lora_B.weight [out, r]`` pair
becomes one :class:`AdapterPart` of a fused layer: ``q_proj`` / ``k_proj`` / ``v_proj`` are parts 0/1/2 of
``self_attn.qkv_proj``, ``o_proj`` part 0 of ``self_attn.o_proj``, ``gate_proj`` / ``up_proj`` parts 0/1 of
``mlp.gate_up_proj``, ``down_proj`` part 0 of ``mlp.down_proj``. A checkpoint's own fused ``qkv_proj`` /
``gate_up_proj`` (Phi-3) is split by rows of ``lora_B`` into the same parts (same ``A``): the product is the
same. Scaling is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``;
``alpha_pattern`` / ``rank_pattern`` override per module as PEFT matches them.

Anything the engine cannot apply exactly (DoRA, trained biases, ``modules_to_save``, embedding or LM-head
targets, MoE experts, a rank above ``max_lora_rank``, shapes that do not fit the model) raises
:class:`LoRAAdapterError` naming the adapter, the key and what to do.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open
from torch import Tensor

from batchgen.models.config import ModelConfig

# projection -> (our layer, part index); fused checkpoint projections -> (our layer, None): split into parts
_PARTS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "qkv_proj": ("self_attn.qkv_proj", None),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "gate_up_proj": ("mlp.gate_up_proj", None),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(.*?)\.(lora_A|lora_B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
_LAYER = re.compile(
    r"^(?:model\.(?:language_model\.)?|language_model\.model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)$"
)


class LoRAAdapterError(ValueError):
    """An adapter that cannot be read or applied to this model (the message says which and why)."""


@dataclass
class AdapterPart:
    """One targeted part: ``a [r, in]``, ``b [part_out, r]`` (full, unsharded sizes), PEFT's scaling."""

    a: Tensor
    b: Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A parsed adapter: ``parts[(layer path, part index)]``, e.g. ``("model.layers.0.self_attn.qkv_proj", 1)``
    for ``k_proj`` of layer 0. ``max_rank`` is its largest rank."""

    name: str
    path: str
    parts: dict[tuple[str, int], AdapterPart] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max((p.rank for p in self.parts.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.parts.values())


def part_sizes(config: ModelConfig, layer: str, layer_idx: int) -> tuple[int, list[int]] | None:
    """``(in_features, [out per part])`` of one of our LoRA-able layers (full sizes; ``config`` unsharded);
    None when the layer has no such dense projection (a MoE layer's MLP)."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    if layer == "self_attn.qkv_proj":
        return h, [q, kv, kv]
    if layer == "self_attn.o_proj":
        return q, [h]
    moe = config.moe
    if moe is not None and moe.sparse_layers[layer_idx]:
        return None
    inter = config.intermediate_size
    if layer == "mlp.gate_up_proj":
        return h, [inter, inter]
    if layer == "mlp.down_proj":
        return inter, [h]
    return None


def _pairs(tensors: dict[str, Tensor], where: str) -> dict[str, tuple[Tensor, Tensor]]:
    """The adapter's (lora_A, lora_B) per target module."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(
                f"{where}: unexpected tensor {key!r}: only lora_A / lora_B weights are supported (no trained "
                f"biases, modules_to_save, DoRA magnitudes or embeddings)"
            )
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"{where}: module {module!r} has {sorted(ab)} but needs lora_A and lora_B")
    return {module: (ab["lora_A"], ab["lora_B"]) for module, ab in pairs.items()}


def _check_pair(
    module: str, a: Tensor, b: Tensor, config: ModelConfig, max_rank: int, where: str
) -> tuple[int, str, int | None, list[int]]:
    """Where the pair goes (layer index, layer path, part or None, the layer's output sizes), after checking
    its shapes and rank against the model."""
    layer_idx, layer, part = _target(module, config, where)
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
        raise LoRAAdapterError(
            f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair"
        )
    if r > max_rank:
        raise LoRAAdapterError(
            f"{where}: {module} has rank {r} > max_lora_rank={max_rank}; raise max_lora_rank to at least {r}"
        )
    sizes = part_sizes(config, layer, layer_idx)
    if sizes is None:
        raise LoRAAdapterError(
            f"{where}: {module}: layer {layer_idx}'s MLP is a mixture of experts; LoRA on experts is not "
            f"supported (attention projections are)"
        )
    in_features, outs = sizes
    expected_out = outs[part] if part is not None else sum(outs)
    if a.shape[1] != in_features or b.shape[0] != expected_out:
        raise LoRAAdapterError(
            f"{where}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this model "
            f"(expected [r, {in_features}] / [{expected_out}, r]); was the adapter trained on another base model?"
        )
    return layer_idx, layer, part, list(outs)


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and validate the adapter at ``path`` for a model of ``config`` (tensors in the model's dtype, on
    the CPU). Raises :class:`LoRAAdapterError`."""
    if config.tp_size != 1:
        raise ValueError("load_adapter needs the whole model's config (tp_size 1); shard when loading a slot")
    where = f"LoRA adapter {name!r} ({path})"
    d = Path(path)
    cfg = _read_config(d, where)
    _check_config(cfg, where)
    pairs = _pairs(_read_tensors(d, where), where)
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    alpha_pattern: dict = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))
    adapter = LoRAAdapter(name, str(path))
    for module, (a, b) in sorted(pairs.items()):
        layer_idx, layer, part, outs = _check_pair(module, a, b, config, max_rank, where)
        r = a.shape[0]
        module_alpha = float(alpha_pattern[k]) if (k := _pattern_key(alpha_pattern, module)) else alpha
        scale = module_alpha / (math.sqrt(r) if rslora else r)
        a = a.to(config.dtype)
        b = b.to(config.dtype)
        path_ = f"model.layers.{layer_idx}.{layer}"
        if part is not None:
            adapter.parts[(path_, part)] = AdapterPart(a, b, scale)
        else:
            start = 0
            for i, n in enumerate(outs):
                adapter.parts[(path_, i)] = AdapterPart(a, b[start : start + n].clone(), scale)
                start += n
    if not adapter.parts:
        raise LoRAAdapterError(f"{where}: adapter_model.safetensors holds no lora_A / lora_B weights")
    return adapter


def check_adapter_files(name: str, path: str | Path) -> None:
    """What :func:`load_adapter` checks before reading weights, without reading them: a directory with a
    readable, supported ``adapter_config.json`` and an ``adapter_model.safetensors``. Raises
    :class:`LoRAAdapterError` with the message loading would give."""
    where = f"LoRA adapter {name!r} ({path})"
    d = Path(path)
    _check_config(_read_config(d, where), where)
    if not (d / "adapter_model.safetensors").exists():
        _read_tensors(d, where)  # raises: the message for a missing or pickle-only adapter


def _read_config(d: Path, where: str) -> dict:
    f = d / "adapter_config.json"
    if not d.is_dir():
        raise LoRAAdapterError(f"{where}: not a directory; give the PEFT adapter's directory")
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(
            f"{where}: no adapter_config.json (a PEFT adapter directory has one)"
        ) from None
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{where}: cannot read adapter_config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{where}: adapter_config.json is not a JSON object")
    return cfg


def _check_config(cfg: dict, where: str) -> None:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {peft_type}; only LoRA adapters are supported")
    unsupported = {
        "use_dora": "DoRA",
        "lora_bias": "trained LoRA biases (lora_bias)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D models)",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"{where}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"{where}: bias={cfg['bias']!r} (trained base biases) is not supported; use 'none'"
        )
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(
            f"{where}: modules_to_save={cfg['modules_to_save']} (fully trained modules) is not supported"
        )


def _read_tensors(d: Path, where: str) -> dict[str, Tensor]:
    f = d / "adapter_model.safetensors"
    if not f.exists():
        if (d / "adapter_model.bin").exists():
            raise LoRAAdapterError(
                f"{where}: only adapter_model.bin (pickle) found; batchgen does not load pickle files. Convert it: "
                f"PeftModel.from_pretrained(base, dir).save_pretrained(dir, safe_serialization=True)"
            )
        raise LoRAAdapterError(f"{where}: no adapter_model.safetensors")
    try:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except Exception as e:  # a truncated or corrupt file
        raise LoRAAdapterError(f"{where}: cannot read adapter_model.safetensors: {e}") from None


def _target(module: str, config: ModelConfig, where: str) -> tuple[int, str, int | None]:
    """``model.layers.3.self_attn.k_proj`` -> (3, "self_attn.qkv_proj", 1)."""
    m = _LAYER.match(module)
    proj = m.group(3) if m else None
    if m is None or proj not in _PARTS or not _PARTS[proj][0].startswith(m.group(2)):
        raise LoRAAdapterError(
            f"{where}: target module {module!r} is not supported: LoRA applies to the q/k/v/o attention and "
            f"gate/up/down MLP projections of the decoder layers"
        )
    layer_idx = int(m.group(1))
    if layer_idx >= config.num_layers:
        raise LoRAAdapterError(f"{where}: {module}: the model has only {config.num_layers} layers")
    layer, part = _PARTS[proj]
    return layer_idx, layer, part


def _pattern_key(patterns: dict, module: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of the module's name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def shard_part(part: AdapterPart, layer: str, index: int, config: ModelConfig) -> tuple[Tensor, Tensor]:
    """This tensor-parallel rank's ``(a, b)`` of a part: column-parallel layers (``qkv_proj``,
    ``gate_up_proj``) keep ``a`` whole and take their output rows of ``b``; row-parallel ones (``o_proj``,
    ``down_proj``) take their input columns of ``a`` and keep ``b`` whole (each rank's delta is then a partial
    sum, all-reduced with the layer's output). ``config`` is the rank's (sharded) config."""
    size, rank = config.tp_size, config.tp_rank
    a, b = part.a, part.b
    if size == 1:
        return a, b
    if layer in ("self_attn.o_proj", "mlp.down_proj"):
        n = a.shape[1] // size
        return a[:, rank * n : (rank + 1) * n], b
    if layer == "self_attn.qkv_proj" and index > 0:
        from batchgen.models.sharding import _kv_range

        start, n = _kv_range(config, b.shape[0])
        return a, b[start : start + n]
    n = b.shape[0] // size
    return a, b[rank * n : (rank + 1) * n]
