"""Load the projections of a GPTQ, AWQ or fp8 checkpoint into their quantized modules, before the rest of the
checkpoint streams into the model as float tensors.

A projection is quantized when the checkpoint holds its scheme's tensors (``qweight``, a ``weight_scale``...):
layers a checkpoint leaves in float (``lm_head``, ``modules_to_not_convert``, compressed-tensors' ``ignore``) are
found by their absence, never by parsing module lists. A fused projection (q/k/v, gate/up) is built from its
parts' tensors by the scheme (each part in its own layout). Invariant: every tensor read here is returned, so
the float loader skips exactly those and still checks that every other parameter is written once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchgen.models.config import ModelConfig
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.input_quant import scale_tokens_over_ranks
from batchgen.models.sharding import splits_inputs


class TensorReader:
    """Tensors by name over a checkpoint's safetensors files (headers listed once, files opened lazily). With a
    tensor-parallel `config` (``tp_size > 1``) each tensor is read as rank ``tp_rank``'s slice
    (:func:`batchgen.models.sharding.read_shard`: only that slice is read from disk)."""

    def __init__(self, files: list[Path], config: ModelConfig | None = None) -> None:
        self.config = config if config is not None and config.tp_size > 1 else None
        self.where: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                self.where.update(dict.fromkeys(f.keys(), file))
        self.read: set[str] = set()
        self._open: dict[Path, object] = {}

    _MISSING = object()

    def __call__(self, name: str, default=_MISSING) -> torch.Tensor:
        if name not in self.where:
            if default is not self._MISSING:
                return default
            raise ValueError(f"quantized checkpoint is missing tensor {name!r}")
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt", device="cpu")
        self.read.add(name)
        if self.config is not None:
            from batchgen.models.sharding import read_shard

            return read_shard(self._open[file], name, name, self.config)
        return self._open[file].get_tensor(name)


@torch.no_grad()
def load_quantized_linears(
    model: nn.Module, config: ModelConfig, files: list[Path], scheme, device: torch.device
) -> tuple[set[str], list[str]]:
    """Replace each projection the checkpoint quantizes with the module `scheme.build` makes from its tensors,
    on `device` (the model's projections may still be on the meta device). Returns (checkpoint tensor names
    read, replaced module names)."""
    from batchgen.models.loader import _checkpoint_names

    get = TensorReader(files, config)
    replaced = []
    for name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or (name == "lm_head" and config.tie_word_embeddings):
            continue
        parts = _checkpoint_names(config, f"{name}.weight", tuple(linear.weight.shape))[0]
        prefixes = [hf.removesuffix(".weight") for hf, _ in parts]
        quantized = [scheme.is_quantized(p, get.where) for p in prefixes]
        if not any(quantized):
            continue
        if not all(quantized):
            raise UnsupportedCheckpoint(
                f"{', '.join(prefixes)} of fused {name} mix quantized and float tensors ({scheme.method}): batchgen "
                "runs fused q/k/v and gate/up projections whose parts are all quantized or all float"
            )
        _check_block_split(
            name, [src.rows for _, src in parts] or [linear.out_features], linear, scheme, config
        )
        bias = None
        if linear.bias is not None:
            bias = torch.cat([get(f"{p}.bias").float() for p in prefixes])
        module = scheme.build(linear.in_features, prefixes, get, bias).to(device)
        if config.tp_size > 1 and splits_inputs(f"{prefixes[0]}.weight"):
            scale_tokens_over_ranks(module, name)
        if module.out_features != linear.out_features:
            raise ValueError(f"{name}: the checkpoint's {scheme.method} tensors hold {module.out_features} outputs, "
                             f"the model has {linear.out_features}")  # fmt: skip
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, module)
        replaced.append(name)

    def make(k: int, n: int, prefixes: list[str]) -> nn.Module | None:
        if not all(scheme.is_quantized(p, get.where) for p in prefixes):
            return None
        module = scheme.build(k, prefixes, get, None)
        if module.out_features != n:
            raise ValueError(f"{', '.join(prefixes)}: the checkpoint's {scheme.method} tensors hold "
                             f"{module.out_features} outputs, the model has {n}")  # fmt: skip
        return module

    replaced += replace_experts(model, config, make, device)
    if not replaced:
        raise UnsupportedCheckpoint(f"no projection of the checkpoint holds {scheme.method} tensors")
    leftover = sorted(
        n for n in get.where if n not in get.read and n.rsplit(".", 1)[-1] in _scheme_leaves(scheme)
    )
    if leftover:
        raise UnsupportedCheckpoint(
            f"{scheme.method} tensor {leftover[0]} (+{len(leftover) - 1} more) belongs to no projection batchgen "
            "quantizes"
        )
    return get.read, replaced


def replace_experts(model: nn.Module, config: ModelConfig, make, device: torch.device) -> list[str]:
    """Swap each stacked :class:`~batchgen.models.moe.Experts` whose experts the checkpoint quantizes for a
    :class:`~batchgen.models.moe.PackedExperts` of per-expert modules ``make(in_features, out_features,
    prefixes)`` (None where the checkpoint holds those parts in float) on `device`: gate and up rows as one
    projection, down.
    Experts all float are left stacked; some quantized and some float, or quantized experts under tensor
    parallelism, are refused by name. Returns the replaced module names."""
    from batchgen.models.loader import expert_prefixes
    from batchgen.models.moe import Experts, PackedExperts

    replaced = []
    for name, experts in list(model.named_modules()):
        if type(experts) is not Experts:
            continue
        hidden, inter = experts.down_proj.shape[1], experts.intermediate_size
        per = [expert_prefixes(config, name, e) for e in range(experts.num_experts)]
        gate_up = [make(hidden, 2 * inter, gu) for gu, _ in per]
        down = [make(inter, hidden, [d]) for _, d in per]
        made = [m is not None for m in gate_up + down]
        if not any(made):
            continue
        if not all(made):
            raise UnsupportedCheckpoint(
                f"the experts of {name} are partly quantized, partly float: batchgen runs a layer's experts all "
                "quantized (in one scheme) or all float"
            )
        if config.tp_size > 1:
            raise UnsupportedCheckpoint(
                f"engine.tensor_parallel_size={config.tp_size}: quantized experts ({name}) run on one rank; set "
                "engine.tensor_parallel_size=1"
            )
        parent, _, attr = name.rpartition(".")
        module = PackedExperts(
            [m.to(device) for m in gate_up], [m.to(device) for m in down], inter, config.hidden_act
        )
        setattr(model.get_submodule(parent), attr, module)
        replaced.append(name)
    return replaced


def _check_block_split(
    name: str, part_rows: list[int], linear: nn.Linear, scheme, config: ModelConfig
) -> None:
    """Under tensor parallelism, a rank's rows (column-parallel parts) or inputs (row-parallel) of a block-scaled
    projection must be whole scale blocks; else the rank's scales would belong to other rows."""
    block = getattr(scheme, "block", None)
    if config.tp_size == 1 or block is None:
        return
    bn, bk = block
    row = name.rsplit(".", 1)[-1] in ("o_proj", "down_proj")
    sizes, unit = (
        ([linear.in_features], bk) if row else ([r if r > 0 else linear.out_features for r in part_rows], bn)
    )
    if any(n % unit for n in sizes):
        raise UnsupportedCheckpoint(
            f"engine.tensor_parallel_size={config.tp_size}: {name} splits into {sizes} {'inputs' if row else 'rows'} "
            f"per rank, not whole fp8 scale blocks of {unit}; set engine.tensor_parallel_size=1"
        )


def _scheme_leaves(scheme) -> tuple[str, ...]:
    return getattr(scheme, "tensors", None) or (scheme.scale_name,)


def kv_scale_names(files: list[Path]) -> list[str]:
    """The checkpoint's fp8 KV-cache scale tensors (:mod:`batchgen.models.quant.kv_scales`), from the headers."""
    from batchgen.models.quant.kv_scales import is_kv_scale

    names = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names += [n for n in f.keys() if is_kv_scale(n)]
    return names
