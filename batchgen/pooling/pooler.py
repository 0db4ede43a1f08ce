"""Pooling math over packed hidden states.

A packed batch holds the tokens of several sequences one after another: ``hidden [T, H]`` and
``cu_seqlens [B + 1]`` (sequence ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i + 1]``). Pooling is computed in
float32 whatever the model dtype: ``last`` takes a sequence's last row, ``cls`` its first, ``mean`` the mean of
all its rows (special tokens included, as sentence-transformers' mean pooling over the attention mask).
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchgen.pooling.params import PoolingSpec


def pool(hidden: Tensor, cu_seqlens: Tensor, method: str) -> Tensor:
    """``[B, H]`` float32: one vector per sequence of the packed batch."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if method == "last":
        return hidden[ends - 1].float()
    if method == "cls":
        return hidden[starts].float()
    if method == "mean":
        lens = ends - starts
        owner = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        sums = torch.zeros(len(lens), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        return sums / lens[:, None].float()
    raise ValueError(f"unknown pooling method {method!r}")


def finish_embedding(vectors: Tensor, spec: PoolingSpec) -> Tensor:
    """Truncate to ``spec.dimensions`` (Matryoshka), then L2-normalise when ``spec.normalize``."""
    if spec.dimensions is not None:
        if spec.dimensions > vectors.shape[-1]:
            raise ValueError(
                f"dimensions={spec.dimensions} exceeds the model's embedding size {vectors.shape[-1]}"
            )
        vectors = vectors[..., : spec.dimensions]
    if spec.normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
    return vectors


def class_probs(logits: Tensor, problem_type: str | None) -> Tensor:
    """``[B, num_labels]`` float32 scores: softmax over the labels; a sigmoid per label for multi-label heads;
    the raw value for a one-label (reward / regression) head."""
    logits = logits.float()
    if logits.shape[-1] == 1:
        return logits
    if problem_type == "multi_label_classification":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
