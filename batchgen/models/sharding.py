"""Which slice of each Hugging Face checkpoint tensor a tensor-parallel rank reads.

`read_shard(f, stored, name, config)` reads one tensor of an open safetensors file for rank `config.tp_rank`
of `config.tp_size` (a sharded `ModelConfig`, see `batchgen.models.parallel`) through `safe_open`'s
`get_slice`: only the rank's rows/columns are read from disk, never the whole tensor. The rule is chosen by the
tensor's (text-model) name, so it applies to every native architecture:

- column-parallel (split the output rows): `q_proj`; `k_proj` / `v_proj` by K/V head (one whole head per rank
  when there are fewer K/V heads than ranks); `gate_proj` / `up_proj` / Mixtral's `w1` / `w3` (dense MLPs,
  experts, shared experts); the fused `qkv_proj` / `gate_up_proj` of Phi-3 and stacked experts (each part
  sliced, then concatenated); their biases alike.
- row-parallel (split the input columns): `o_proj`, `down_proj`, `w2`; their biases only on rank 0 (zeros
  elsewhere: the all-reduce adds them once).
- vocabulary-parallel rows: `embed_tokens`, `lm_head` (the last rank's rows past the vocabulary are zeros).
- everything else (norms, the MoE router, Qwen2-MoE's `shared_expert_gate`) is replicated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchgen.models.config import ModelConfig
from batchgen.models.parallel import vocab_shard_rows

_COLUMN = ("q_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")


def read_shard(f, stored: str, name: str, config: ModelConfig) -> Tensor:
    """Rank `config.tp_rank`'s part of checkpoint tensor `stored` (our name for it: `name`) from the open
    safetensors file `f`."""
    sl = f.get_slice(stored)
    shape = tuple(sl.get_shape())
    module, leaf = _module_and_leaf(name)
    rank, size = config.tp_rank, config.tp_size
    if module in ("embed_tokens", "lm_head"):
        rows = vocab_shard_rows(config)
        part = sl[rank * rows : min((rank + 1) * rows, shape[0])]
        return _pad_rows(part, rows)
    if module in ("k_proj", "v_proj"):
        return _read(sl, shape, 0, [_kv_range(config, shape[0])])
    if module in _COLUMN:
        n = shape[0] // size
        return _read(sl, shape, 0, [(rank * n, n)])
    if module in _ROW or (module == "experts" and leaf == "down_proj"):
        if leaf == "bias":
            full = sl[:]
            return full if rank == 0 else torch.zeros_like(full)
        n = shape[-1] // size
        return _read(sl, shape, len(shape) - 1, [(rank * n, n)])
    if module == "qkv_proj":  # Phi-3: [q | k | v] rows
        d = config.head_dim
        q_full = config.num_heads * size * d
        kv_full = (shape[0] - q_full) // 2
        q = config.num_heads * d
        k0, kn = _kv_range(config, kv_full)
        return _read(sl, shape, 0, [(rank * q, q), (q_full + k0, kn), (q_full + kv_full + k0, kn)])
    if module == "gate_up_proj" or (module == "experts" and leaf == "gate_up_proj"):  # [.., gate | up, H]
        dim = 1 if module == "experts" else 0  # stacked experts: [E, 2I, H]
        inter = shape[dim] // 2
        n = inter // size
        return _read(sl, shape, dim, [(rank * n, n), (inter + rank * n, n)])
    return sl[:]


def _module_and_leaf(name: str) -> tuple[str, str]:
    """`model.layers.0.self_attn.q_proj.weight` -> (`q_proj`, `weight`); `lm_head.weight` -> (`lm_head`, ...)."""
    prefix, _, leaf = name.rpartition(".")
    return prefix.rpartition(".")[2], leaf


def _kv_range(config: ModelConfig, kv_rows: int) -> tuple[int, int]:
    """(first row, rows) of this rank's K/V heads in a `[num_kv_heads * head_dim, ...]` tensor."""
    d = config.head_dim
    heads = kv_rows // d
    size, rank = config.tp_size, config.tp_rank
    if heads >= size:
        n = heads // size
        return rank * n * d, n * d
    return (rank * heads // size) * d, d  # replicated: the K/V head of this rank's query heads


def _read(sl, shape: tuple[int, ...], dim: int, ranges: list[tuple[int, int]]) -> Tensor:
    """Ranges `(start, length)` of dimension `dim`, read one by one and concatenated."""
    parts = []
    for start, length in ranges:
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, start + length)
        parts.append(sl[tuple(index)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
