"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), batched by expert.

Routing is transformers' own: router logits, softmax over all experts in float32, top-k, optional
renormalisation, weights cast back to the model dtype (Mixtral keeps them in float32). The experts then run
on tokens grouped by expert: the (token, slot) pairs are sorted by expert id once, and each expert that
received tokens multiplies its contiguous group in two matmuls (gate/up fused, then down). There is no loop
over tokens; the loop over experts touches only experts with work. Contributions are summed into the output
with one `index_add_` in expert order — the order transformers adds them in, so float32 results match it.

Expert weights are stacked: `experts.gate_up_proj [E, 2I, H]` (gate rows then up rows) and
`experts.down_proj [E, H, I]`, the layout transformers 5.x uses in memory; the loader fills them from
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


def activation(name: str):
    """transformers' activation function of that name (exactly the same numerics)."""
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
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order within a group
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        inter = self.intermediate_size
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = xs[start : start + n]
            gate, up = F.linear(seg, self.gate_up_proj[e]).split(inter, dim=-1)
            ys[start : start + n] = F.linear(self.act(gate) * up, self.down_proj[e])
            start += n
        weights = top_weights.reshape(-1).index_select(0, order)
        contrib = (ys * weights[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, contrib)


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
