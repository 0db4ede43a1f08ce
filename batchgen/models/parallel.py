"""Tensor parallelism of the native decoder (Megatron-style): the per-rank model shape and the collectives.

With `tp_size = N` every rank holds one shard of each layer:

- attention: `num_heads / N` query heads and their K/V heads (`num_kv_heads / N` of them, or one replicated
  K/V head when there are fewer K/V heads than ranks), so `qkv_proj` is column-parallel and each rank keeps
  only its heads' KV cache; `o_proj` is row-parallel: its output is a partial sum, all-reduced once.
- MLP / experts: `intermediate_size / N` columns of gate/up (column-parallel) and rows of down (row-parallel),
  all-reduced once per layer (a MoE layer's experts and shared expert together); the router is replicated.
- embedding and LM head: vocabulary-parallel, `ceil(vocab / N)` rows per rank (the last rank's tail is zero
  padding). A token's embedding comes from the rank that holds its row (all-reduce of the masked lookups);
  logits are computed per shard and gathered on rank 0 before sampling.
- norms, RoPE and the router: replicated; biases of row-parallel layers are added once (rank 0 holds them,
  the other ranks hold zeros).

The collectives run over torch.distributed's default process group (one per engine; ranks 0..N-1). With
`tp_size == 1` nothing here communicates and the model is exactly the single-device one.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.models.config import ModelConfig


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The shape of rank `rank`'s shard of `config` over `size` ranks (sizes per rank, `tp_rank`/`tp_size`
    set). Raises ValueError naming `engine.tensor_parallel_size` when the model does not split that way."""
    check_divisible(config, size)
    if size == 1:
        return config
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size,
        )
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
        moe=moe,
        tp_rank=rank,
        tp_size=size,
    )


def check_divisible(config: ModelConfig, size: int) -> None:
    """Every split dimension divides by `size` (K/V heads may instead divide `size`: then replicated)."""
    if size < 1:
        raise ValueError(f"engine.tensor_parallel_size must be >= 1, got {size}")
    what = f"engine.tensor_parallel_size={size} does not split {config.architecture}"
    if config.num_heads % size:
        raise ValueError(f"{what}: {config.num_heads} attention heads are not divisible by {size}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"{what}: {kv} key/value heads neither divide by {size} nor divide {size}")
    sizes = {"intermediate_size": config.intermediate_size}
    if config.moe is not None:
        sizes["moe_intermediate_size"] = config.moe.intermediate_size
        sizes["shared_expert_intermediate_size"] = config.moe.shared_expert_intermediate_size
    for name, value in sizes.items():
        if value % size:
            raise ValueError(f"{what}: {name}={value} is not divisible by {size}")


def vocab_shard_rows(config: ModelConfig) -> int:
    """Rows of the embedding / LM head on each rank: ceil(vocab / tp_size) (the whole vocabulary at 1)."""
    return -(-config.vocab_size // config.tp_size)


def all_reduce(x: Tensor, config: ModelConfig) -> Tensor:
    """Sum a row-parallel layer's partial outputs over the ranks (in place; identity without TP)."""
    if config.tp_size > 1:
        dist.all_reduce(x)
    return x


class VocabParallelEmbedding(nn.Module):
    """Rows `[rank * R, (rank + 1) * R)` of the embedding (`R = vocab_shard_rows`); ids outside the shard look
    up zeros, and the all-reduce leaves each token exactly its one row."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rows = vocab_shard_rows(config)
        self.start = config.tp_rank * rows
        self.weight = nn.Parameter(torch.empty(rows, config.hidden_size))

    def forward(self, input_ids: Tensor) -> Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return all_reduce(x, self.config)


def embedding(config: ModelConfig) -> nn.Module:
    """The token embedding: `nn.Embedding` on one rank, vocabulary-parallel over several."""
    if config.tp_size == 1:
        return nn.Embedding(config.vocab_size, config.hidden_size)
    return VocabParallelEmbedding(config)


def lm_head(config: ModelConfig) -> nn.Linear:
    """The LM head: this rank's `vocab_shard_rows` output rows (all of them on one rank)."""
    return nn.Linear(config.hidden_size, vocab_shard_rows(config), bias=False)


def gather_logits(logits: Tensor, config: ModelConfig) -> Tensor:
    """Rank 0: the full `[N, vocab]` logits from every rank's `[N, R]` shard (padding dropped). Other ranks
    send theirs and get their own shard back (unused). Identity without TP."""
    if config.tp_size == 1:
        return logits
    logits = logits.contiguous()
    if config.tp_rank != 0:
        dist.gather(logits, None, dst=0)
        return logits
    parts = [torch.empty_like(logits) for _ in range(config.tp_size)]
    dist.gather(logits, parts, dst=0)
    return torch.cat(parts, dim=-1)[:, : config.vocab_size]
