"""Encoder checkpoints through transformers' modeling code, in length-bucketed batches: BERT, RoBERTa /
XLM-RoBERTa / CamemBERT, DistilBERT, ELECTRA and ModernBERT unpadded; MPNet, DeBERTa(-v2) and ALBERT padded.

The rows of a call are sorted by length and cut into batches of at most ``max_batch_tokens`` tokens (and
``max_batch_seqs`` sequences). A packed family's batch runs as ONE packed row of tokens (no padding in any
linear layer) with per-sequence position ids, and attention stays within each sequence
(:mod:`.varlen_attention`). A family whose attention adds relative-position terms (MPNet, DeBERTa) or does not
go through transformers' attention interface runs each batch padded to its longest row with an attention mask
(length-sorted, so little of it is padding), through the model's own forward and head. Results come back in
the caller's order. Weights load from safetensors only; remote code never runs.

Heads: an embedding checkpoint returns the pooled backbone output; a ``*ForSequenceClassification`` checkpoint
runs the architecture's own head modules on the pooled vectors exactly as transformers' forward would (BERT:
pooler + classifier on CLS; RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA: the classification head on CLS;
DistilBERT: pre-classifier, ReLU and classifier on CLS; ModernBERT: its ``classifier_pooling``, head and
classifier).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from batchgen.kernels import cpu_kernel
from batchgen.models.packed_linear import pack_transformers_linears, packed_layout
from batchgen.pooling import varlen_attention
from batchgen.pooling.checkpoint import PACKED_ENCODER_MODEL_TYPES, CheckpointPooling
from batchgen.pooling.pooler import pool

logger = logging.getLogger(__name__)

_ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")
"""Packed families whose position ids start after ``pad_token_id`` and whose head is RoBERTa's."""


def length_batches(lengths: Sequence[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Indices of ``lengths`` sorted by length, cut into batches of at most ``max_tokens`` tokens (a longer
    single row goes alone) and ``max_seqs`` rows."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        n = lengths[i]
        if cur and (tokens + n > max_tokens or len(cur) >= max_seqs):
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        batches.append(cur)
    return batches


@dataclass
class EncoderOutput:
    """One batch's forward: ``hidden [T, H]`` (every row's tokens, packed in the batch's order; None for a
    padded family's classifier, whose head ran inside the model), ``cu [B + 1]`` (where each row starts in
    ``hidden``) and, for a classifier, the head's ``logits [B, num_labels]``."""

    hidden: Tensor | None
    cu: Tensor
    logits: Tensor | None


class EncoderModel:
    """One encoder checkpoint, ready to pool. ``hidden_size``: the backbone's width; ``max_model_len``: the
    longest input it takes (position embeddings, or the sentence-transformers ``max_seq_length``); ``packed``:
    whether batches run as one packed row (the families in ``PACKED_ENCODER_MODEL_TYPES``) or padded to the
    batch's longest row with an attention mask (the others: their attention adds position terms a packed row
    cannot carry)."""

    def __init__(self, info: CheckpointPooling, dtype: torch.dtype, device: torch.device) -> None:
        import transformers

        self.packed = info.model_type in PACKED_ENCODER_MODEL_TYPES
        if self.packed:
            varlen_attention.register()
            if device.type == "cpu":
                cpu_kernel.start_build()  # the packed attention's C kernel, compiled while the weights load
        self.info = info
        self.device = device
        self.classify = info.task == "classify"
        cls = transformers.AutoModelForSequenceClassification if self.classify else transformers.AutoModel
        attn = {"attn_implementation": varlen_attention.ATTN_IMPLEMENTATION} if self.packed else {}
        model = cls.from_pretrained(
            str(info.path),
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            **attn,
        )
        # Linear layers run batchgen's GEMM over packed panels where its C kernels build (faster than MKL at an
        # encoder batch's thousands of token rows, and the bias is added in the same pass); otherwise they keep
        # their weights as loaded (MKL), which beats oneDNN's packed weights at these row counts.
        # `python -m batchgen.bench.embed` compares the layouts.
        self.model = model.to(device).eval().requires_grad_(False)
        if torch.device(device).type == "cpu" and packed_layout() == "panels":
            pack_transformers_linears(self.model)
        self.backbone: nn.Module = getattr(model, model.base_model_prefix) if self.classify else model
        cfg = model.config
        self.config = cfg
        self.hidden_size = int(cfg.hidden_size)
        self.dtype = dtype
        limit = int(getattr(cfg, "max_position_embeddings", 512))
        self.position_offset = 0
        if info.model_type in _ROBERTA_LIKE:  # positions start after padding_idx
            self.position_offset = int(cfg.pad_token_id) + 1
            limit -= self.position_offset
        elif info.model_type == "mpnet":  # the same, from transformers' fixed MPNet padding_idx of 1
            limit -= 2
        self.max_model_len = min(limit, info.max_seq_length or limit)
        self.uses_token_types = getattr(cfg, "type_vocab_size", 0) > 0 and info.model_type != "modernbert"
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_token_id = int(pad) if isinstance(pad, int) else 0

    @torch.inference_mode()
    def forward(self, token_lists: Sequence[Sequence[int]]) -> EncoderOutput:
        """One batch through the model: hidden states of every row (and the head's logits for a classifier)."""
        lengths = [len(t) for t in token_lists]
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], device=self.device)
        if not self.packed:
            return self._padded(token_lists, lengths, cu)
        hidden = self._packed(token_lists, lengths)
        return EncoderOutput(hidden, cu, self._head(hidden, cu) if self.classify else None)

    def _packed(self, token_lists: Sequence[Sequence[int]], lengths: list[int]) -> Tensor:
        dev = self.device
        ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long, device=dev)[None]
        pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)[None] + self.position_offset
        kwargs = {"token_type_ids": torch.zeros_like(ids)} if self.uses_token_types else {}
        layout = varlen_attention.PackedLayout.build(lengths, dev)
        with varlen_attention.packed(layout):
            out = self.backbone(input_ids=ids, position_ids=pos, **kwargs)
        return out.last_hidden_state[0] if hasattr(out, "last_hidden_state") else out[0][0]

    def _padded(self, token_lists: Sequence[Sequence[int]], lengths: list[int], cu: Tensor) -> EncoderOutput:
        """The batch padded on the right to its longest row (the batches are length-sorted: little padding),
        through the model's own forward with an attention mask; a classifier's logits come from its own head."""
        width = max(lengths)
        ids = torch.full((len(lengths), width), self.pad_token_id, dtype=torch.long)
        for i, toks in enumerate(token_lists):
            ids[i, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.long)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask)
        if self.classify:
            return EncoderOutput(None, cu, out.logits)
        return EncoderOutput(out.last_hidden_state[mask.bool()], cu, None)

    def _head(self, hidden: Tensor, cu: Tensor) -> Tensor:
        """The classification head's logits ``[B, num_labels]`` for a packed batch's hidden states."""
        m, kind = self.model, self.info.model_type
        if kind == "bert":
            pooled = m.bert.pooler(pool(hidden, cu, "cls").to(hidden.dtype)[:, None, :])
            return m.classifier(m.dropout(pooled))
        if kind in (*_ROBERTA_LIKE, "electra"):  # heads that take the sequence and read its first token
            return m.classifier(pool(hidden, cu, "cls").to(hidden.dtype)[:, None, :])
        if kind == "distilbert":
            pooled = torch.relu(m.pre_classifier(pool(hidden, cu, "cls").to(hidden.dtype)))
            return m.classifier(m.dropout(pooled))
        if kind == "modernbert":
            method = "cls" if self.config.classifier_pooling == "cls" else "mean"
            pooled = m.head(pool(hidden, cu, method).to(hidden.dtype))
            return m.classifier(m.drop(pooled))
        raise ValueError(f"classification heads of model_type {kind!r} are not supported on the encoder path")


def load_encoder(info: CheckpointPooling, dtype: str, device: torch.device) -> EncoderModel:
    """The encoder of ``info`` in ``dtype`` ('auto': the checkpoint's, float32 if it names none)."""
    from batchgen.models.config import parse_dtype

    if dtype == "auto":
        import json

        raw = json.loads((Path(info.path) / "config.json").read_text())
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return EncoderModel(info, parse_dtype(dtype), device)
