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

Quantized projections split the same way, each tensor along the dimension that holds the outputs (column) or the
inputs (row) in its own layout: Hugging Face's ``[outputs, inputs]`` (``weight``, compressed-tensors'
``weight_packed`` with inputs packed in int32 words, ``weight_scale`` with one column per group of inputs, block
``weight_scale_inv``), GPTQ's and AWQ's transposed ``[inputs, outputs]`` (``qweight``, ``qzeros``, ``scales``),
outputs packed several per element or one per block of rows (``qzeros``, AWQ's ``qweight``, ``weight_zero_point``,
block scales: their outputs from the header of the projection's weight or GPTQ / AWQ ``scales``), one group index per input (``g_idx``, renumbered per rank). A dimension
of one (per-tensor and per-output scales) and static input scales are replicated. A split that does not fall on
whole packed elements, groups or blocks is refused (ValueError naming the tensor).
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchgen.models.config import ModelConfig
from batchgen.models.parallel import vocab_shard_rows

_COLUMN = ("q_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")


_IN_MAJOR = ("qweight", "qzeros", "scales")
"""GPTQ / AWQ tensors: ``[inputs (or groups), outputs]`` (the transpose of a Hugging Face weight)."""
_PER_INPUT = ("g_idx", "weight_g_idx")
"""One group index per input."""
_REPLICATED = ("input_scale", "input_zero_point", "weight_shape")
"""Whole-projection quantities, the same on every rank."""


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
    if leaf in _REPLICATED:
        return sl[:]
    if module in ("k_proj", "v_proj", *_COLUMN):
        return _read_outputs(f, sl, stored, shape, module, leaf, config)
    if module in _ROW or (module == "experts" and leaf == "down_proj"):
        if leaf == "bias":
            full = sl[:]
            return full if rank == 0 else torch.zeros_like(full)
        return _read_inputs(sl, stored, shape, leaf, config)
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


def _read_outputs(
    f, sl, stored: str, shape: tuple[int, ...], module: str, leaf: str, config: ModelConfig
) -> Tensor:
    """A column-parallel projection's tensor: the rank's outputs (for K/V, its heads), in whatever layout and
    packing the tensor stores them; a dimension of one (a per-tensor scale) is replicated."""
    if leaf in _PER_INPUT:
        return sl[:]
    dim = 1 if leaf in _IN_MAJOR else 0
    if len(shape) <= dim or shape[dim] == 1:
        return sl[:]
    stored_rows = shape[dim]
    outputs = _outputs(f, stored, dim, stored_rows)
    if module in ("k_proj", "v_proj"):
        start, length = _kv_range(config, outputs)
    else:
        length = _split(outputs, config.tp_size, stored, "outputs")
        start = config.tp_rank * length
    if (start * stored_rows) % outputs or (length * stored_rows) % outputs:
        raise ValueError(
            f"tensor {stored} packs {outputs // stored_rows} outputs per element: rank {config.tp_rank}'s "
            f"{length} outputs from {start} do not start on an element; set engine.tensor_parallel_size=1"
        )
    return _read(sl, shape, dim, [(start * stored_rows // outputs, length * stored_rows // outputs)])


def _outputs(f, stored: str, dim: int, stored_rows: int) -> int:
    """The projection's outputs, which tensor `stored` holds `stored_rows` elements for along `dim`: fewer when
    it packs several per element (zero points, AWQ's qweight) or has one per block of rows (block scales). Read
    from the header of the projection's weight (``weight``, ``weight_packed``; GPTQ / AWQ: ``scales``)."""
    prefix = stored.rsplit(".", 1)[0]
    for companion, cdim in (("scales", 1),) if dim == 1 else (("weight", 0), ("weight_packed", 0)):
        try:
            return int(f.get_slice(f"{prefix}.{companion}").get_shape()[cdim])
        except Exception:  # noqa: BLE001 - safetensors raises its own error for an absent tensor
            continue
    return stored_rows


def _read_inputs(sl, stored: str, shape: tuple[int, ...], leaf: str, config: ModelConfig) -> Tensor:
    """A row-parallel projection's tensor: the rank's inputs (or their groups, or the words that pack them); a
    dimension of one (a per-output or per-tensor scale) is replicated. Group indices (``g_idx``) are made the
    rank's own: it holds groups ``rank * G / size ...``, numbered from 0."""
    dim = 0 if leaf in _IN_MAJOR or leaf in _PER_INPUT else len(shape) - 1
    if len(shape) == 0 or shape[dim] == 1:
        return sl[:]
    n = _split(shape[dim], config.tp_size, stored, "inputs")
    part = _read(sl, shape, dim, [(config.tp_rank * n, n)])
    if leaf in _PER_INPUT and part.numel():
        return part - part.min()
    return part


def _split(total: int, size: int, stored: str, what: str) -> int:
    if total % size:
        raise ValueError(
            f"tensor {stored}: its {total} {what} (or groups, or packed words) do not split over {size} ranks; "
            "set engine.tensor_parallel_size to a divisor"
        )
    return total // size


def splits_inputs(name: str) -> bool:
    """Whether tensor `name` (Hugging Face's name) belongs to a row-parallel projection (its inputs split)."""
    return _module_and_leaf(name)[0] in _ROW


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
