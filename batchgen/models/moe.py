"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), batched by expert.

Routing is transformers' own: router logits, softmax over all experts in float32, top-k, optional
renormalisation, weights cast back to the model dtype (Mixtral keeps them in float32). The experts then run
on tokens grouped by expert: the (token, slot) pairs are sorted by expert id once, and the experts multiply
their contiguous groups in two grouped GEMMs (`torch.nn.functional.grouped_mm`: gate/up fused, then down; a
matmul per expert with work where torch has no grouped kernel for the device/dtype). There is no loop over
tokens. Each token's k weighted contributions are summed in slot order, as transformers' default
(`grouped_mm`) experts implementation does, so float32 results match it.

Expert weights are stacked: `experts.gate_up_proj [E, 2I, H]` (gate rows then up rows) and
`experts.down_proj [E, H, I]`, the shapes transformers 5.x uses (float32 on CPU: stored column-major, see
`packed_linear.use_column_major_weights`); the loader fills them from
per-expert checkpoint tensors (`experts.N.w1/w3/w2` for Mixtral, `experts.N.gate_proj/up_proj/down_proj` for
Qwen) or from already stacked ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from batchgen.models.config import ModelConfig, MoESpec


# Activations whose transformers implementation is exactly this torch module's function (`F.silu`, `F.relu`):
# built here so that the common models need no transformers import at start-up.
_TORCH_ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU}


def activation(name: str):
    """transformers' activation function of that name (exactly the same numerics)."""
    if name in _TORCH_ACTIVATIONS:
        return _TORCH_ACTIVATIONS[name]()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = activation(act)

    def forward(self, x: Tensor, top_idx: Tensor, top_weights: Tensor) -> Tensor:
        """x [T, H]; top_idx / top_weights [T, k] -> [T, H] (sum over each token's k experts, weighted)."""
        t, k = top_idx.shape
        flat = top_idx.reshape(-1)
        _, order = torch.sort(flat, stable=True)  # (token, slot) pairs grouped by expert
        offsets = torch.cumsum(torch.bincount(flat, minlength=self.num_experts), 0, dtype=torch.int32)
        ys = self.grouped(x.index_select(0, order // k), offsets)
        ys = ys * top_weights.reshape(-1).index_select(0, order)[:, None]  # float32 with Mixtral's weights
        unsorted = ys.index_select(0, torch.argsort(order))  # back to (token, slot) order
        return unsorted.view(t, k, -1).sum(dim=1).to(x.dtype)

    def grouped(self, xs: Tensor, offsets: Tensor) -> Tensor:
        """Rows `xs` [S, H] grouped by expert (`offsets` [E]: cumulative row counts) through their experts."""
        h = grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offsets)
        gate, up = h.split(self.intermediate_size, dim=-1)
        return grouped_mm(self.act(gate) * up, self.down_proj.transpose(-2, -1), offsets)


class PackedExperts(Experts):
    """`Experts` whose projections are modules per expert (``gate_up[e]``: gate rows then up rows, ``down[e]``),
    such as :class:`~batchgen.models.quant.quant_linear.QuantLinear` over a GGUF file's ``ffn_*_exps`` blocks
    kept packed; routing, grouping and the weighted sum are `Experts`' own, so results match it to the
    projections' rounding."""

    def __init__(
        self, gate_up: list[nn.Module], down: list[nn.Module], intermediate_size: int, act: str
    ) -> None:
        nn.Module.__init__(self)
        self.num_experts = len(gate_up)
        self.intermediate_size = intermediate_size
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act = activation(act)

    def grouped(self, xs: Tensor, offsets: Tensor) -> Tensor:
        out = torch.empty(xs.shape[0], xs.shape[1], dtype=xs.dtype, device=xs.device)
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                gate, up = self.gate_up[e](xs[start:end]).split(self.intermediate_size, dim=-1)
                out[start:end] = self.down[e](self.act(gate) * up)
            start = end
        return out


def grouped_mm(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """Rows of `x` [S, in] grouped by expert (`offsets` [E]: cumulative row counts) times `weight[e]`
    [E, in, out]: torch's grouped GEMM when this build has one for the device/dtype, else one matmul per
    expert that received rows."""
    if _use_grouped_mm(x, weight):
        return _GROUPED_MM(x.to(weight.dtype), weight, offs=offsets)
    out = torch.empty(x.shape[0], weight.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[e], out=out[start:end])
        start = end
    return out


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _use_grouped_mm(x: Tensor, weight: Tensor) -> bool:
    if _GROUPED_MM is None:
        return False
    if weight.device.type == "cpu":  # CPU kernel since 2.9; 16-byte alignment needed up to 2.10
        return _TORCH_VERSION >= (2, 11) or (
            _TORCH_VERSION >= (2, 9) and weight.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
        )
    if weight.device.type == "cuda":  # bfloat16 on SM80+
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    return False


class SparseMoE(nn.Module):
    """Router (`gate`), stacked `experts`, and Qwen2-MoE's sigmoid-gated `shared_expert`."""

    def __init__(self, config: ModelConfig, spec: MoESpec) -> None:
        super().__init__()
        from batchgen.models.llama import MLP

        self.spec = spec
        self.gate = nn.Linear(config.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(
            spec.num_experts, config.hidden_size, spec.intermediate_size, config.hidden_act
        )
        if spec.shared_expert_intermediate_size:
            self.shared_expert: nn.Module | None = MLP(
                config.hidden_size, spec.shared_expert_intermediate_size, config.hidden_act
            )
            self.shared_expert_gate: nn.Module | None = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(top-k weights [T, k], expert ids [T, k]) exactly as transformers computes them."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_idx = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if not self.spec.fp32_weights:
            top_w = top_w.to(logits.dtype)
        return top_w, top_idx

    def forward(self, x: Tensor) -> Tensor:
        top_w, top_idx = self.route(x)
        out = self.experts(x, top_idx, top_w)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
