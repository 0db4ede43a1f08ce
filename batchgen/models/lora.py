"""LoRA slots in a native decoder: wrapped projections and the adapters resident in them.

:func:`attach_lora` wraps every dense ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` of a loaded
:class:`~batchgen.models.llama.CausalLM` in a :class:`LoRALinear` with ``max_loras`` adapter slots of rank up to
``max_lora_rank`` (zeros: an empty slot adds nothing), and returns the :class:`LoRASlots` that loads an adapter
into a slot or clears it. The base weights are untouched.

Per forward, the batch's per-token slot indices come in the forward context (``ctx.lora``, a
:class:`~batchgen.kernels.lora.LoRAPlan`; None or empty: the base model, no LoRA work at all). The model reads
it once, at the start of its forward, into the state its wrapped layers share; each wrapped layer then computes
``base(x)`` and adds the delta of every token's adapter (:mod:`batchgen.kernels.lora`: segmented torch on the
CPU, the Triton kernels on CUDA).

Tensor parallelism: a slot holds this rank's shard, cut like its base layer (column-parallel layers: ``B``'s
output rows; row-parallel layers: ``A``'s input columns, so the delta is a partial sum that the layer's existing
all-reduce completes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from batchgen.kernels.lora import LoRAPlan, LoRAWeights, add_lora_torch
from batchgen.models.config import ModelConfig
from batchgen.models.lora_adapter import LoRAAdapter, part_sizes, shard_part

_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class LoRAState:
    """Shared by a model's wrapped layers: the current forward's plan (None: base model only)."""

    plan: LoRAPlan | None = None
    use_triton: bool = False

    def add(self, y: Tensor, x: Tensor, weights: LoRAWeights) -> Tensor:
        plan = self.plan
        if plan is None or plan.empty:
            return y
        if self.use_triton:
            from batchgen.kernels.lora_triton import add_lora_triton

            return add_lora_triton(y, x, plan, weights)
        return add_lora_torch(y, x, plan, weights)


class LoRALinear(nn.Module):
    """``base(x)`` plus each token's adapter delta. The slot tensors are non-trainable parameters (so the
    engine's memory sizing counts them as weights)."""

    def __init__(
        self, base: nn.Linear, sizes: list[int], max_loras: int, max_rank: int, state: LoRAState
    ) -> None:
        super().__init__()
        self.base = base
        w = getattr(base, "weight", None)  # quantized projections have none: their adapters are float32
        dtype = w.dtype if w is not None and w.is_floating_point() else torch.float32
        device = w.device if w is not None else next(base.parameters()).device
        self.weights = LoRAWeights.empty(max_loras, base.in_features, sizes, max_rank, dtype, device)
        self.lora_a = nn.Parameter(self.weights.a, requires_grad=False)
        self.lora_b = nn.ParameterList(nn.Parameter(b, requires_grad=False) for b in self.weights.b)
        self.state = state

    def forward(self, x: Tensor) -> Tensor:
        return self.state.add(self.base(x), x, self.weights)


class LoRASlots:
    """The model's adapter slots: ``load(slot, adapter)`` writes an adapter's parts (this rank's shard) into
    every wrapped layer, zeroing the parts it does not target; ``clear(slot)`` empties a slot."""

    def __init__(
        self, model: nn.Module, layers: dict[str, LoRALinear], state: LoRAState, max_loras: int, max_rank: int
    ) -> None:
        self.model = model
        self.layers = layers
        self.state = state
        self.max_loras = max_loras
        self.max_rank = max_rank

    @torch.inference_mode()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        config = self.model.config
        for path, layer in self.layers.items():
            kind = path.split(".", 3)[3]
            for i in range(len(layer.weights.sizes)):
                part = adapter.parts.get((path, i))
                if part is None:
                    layer.weights.set_slot(slot, i, None, None, 0.0)
                    continue
                a, b = shard_part(part, kind, i, config)
                layer.weights.set_slot(slot, i, a, b, part.scale)

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.weights.clear_slot(slot)


def attach_lora(model: nn.Module, max_loras: int, max_rank: int) -> LoRASlots:
    """Wrap the model's dense projections with ``max_loras`` empty slots (see the module docstring)."""
    config = model.config
    device = next(model.parameters()).device
    state = LoRAState(use_triton=device.type == "cuda" and _triton_available())
    layers: dict[str, LoRALinear] = {}
    for idx, decoder_layer in enumerate(model.model.layers):
        for name in _LAYERS:
            if part_sizes(config, name, idx) is None:
                continue  # a mixture-of-experts MLP: attention only
            owner_name, attr = name.split(".")
            owner = getattr(decoder_layer, owner_name)
            base = getattr(owner, attr)
            sizes = _local_sizes(config, name, base)
            wrapped = LoRALinear(base, sizes, max_loras, max_rank, state)
            setattr(owner, attr, wrapped)
            layers[f"model.layers.{idx}.{name}"] = wrapped

    def read_plan(module: nn.Module, args: tuple) -> None:
        ctx = args[2] if len(args) > 2 else None
        state.plan = getattr(ctx, "lora", None)

    model.register_forward_pre_hook(read_plan)
    return LoRASlots(model, layers, state, max_loras, max_rank)


def whole_model_config(path: str, config: ModelConfig) -> ModelConfig:
    """The config adapters are parsed against: ``config`` itself, or, for a tensor-parallel rank's shard, the
    whole model's (read from the checkpoint at ``path``) in the same dtype."""
    if config.tp_size == 1:
        return config
    from batchgen.models.loader import check_tensor_parallel

    whole = check_tensor_parallel(path, "native", config.tp_size)
    return dataclasses.replace(whole, dtype=config.dtype)


def _local_sizes(config, name: str, base: nn.Linear) -> list[int]:
    """Output size of each part on this rank (the base layer is already this rank's shard)."""
    out = base.out_features
    if name == "self_attn.qkv_proj":
        q = config.num_heads * config.head_dim
        kv = (out - q) // 2
        return [q, kv, kv]
    if name == "mlp.gate_up_proj":
        return [out // 2, out // 2]
    return [out]


def _triton_available() -> bool:
    from batchgen.kernels import triton_available

    return triton_available()
