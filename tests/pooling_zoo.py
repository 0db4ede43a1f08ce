"""Tiny pooling checkpoints built offline: decoder embedders and classifiers on the model zoo's configs,
encoders (BERT, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT, ModernBERT, MPNet, DeBERTa-v2, ALBERT) and
sentence-transformers layouts
written as the hub's checkpoints have them (modules.json, 1_Pooling/config.json, 2_Normalize,
sentence_bert_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from model_zoo import _config

from batchgen.models.tiny import build_random_checkpoint, special_token_kwargs

VOCAB = 512
_ENCODER: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=512,
    initializer_range=0.08,
)
ENCODERS = {
    "bert": ("BertConfig", {}),
    "xlm-roberta": ("XLMRobertaConfig", {}),
    "modernbert": ("ModernBertConfig", {"local_attention": 8, "global_attn_every_n_layers": 2}),
    "camembert": ("CamembertConfig", {}),
    "electra": ("ElectraConfig", {"embedding_size": 48}),  # its embedding projection runs too
    "distilbert": ("DistilBertConfig", {}),
    # padded families: relative-position attention (MPNet's bucketed bias, DeBERTa-v3's disentangled terms)
    "mpnet": ("MPNetConfig", {"relative_attention_num_buckets": 32}),
    "deberta-v2": (
        "DebertaV2Config",
        {
            "relative_attention": True,
            "pos_att_type": ["p2c", "c2p"],
            "position_biased_input": False,
            "max_relative_positions": -1,
            "position_buckets": 64,
            "norm_rel_ebd": "layer_norm",
            "share_att_key": True,
            "type_vocab_size": 0,
        },
    ),
    "deberta": (
        "DebertaConfig",
        {
            "relative_attention": True,
            "pos_att_type": ["p2c", "c2p"],
            "position_biased_input": False,
            "max_relative_positions": -1,
            "type_vocab_size": 0,
        },
    ),
    "albert": ("AlbertConfig", {"embedding_size": 32}),
}
LABELS3 = {0: "negative", 1: "neutral", 2: "positive"}


def _no_chat_template(path: str) -> str:
    """Encoder tokenizers have no chat template (sentence-transformers would apply one)."""
    p = Path(path)
    (p / "chat_template.jinja").unlink(missing_ok=True)
    cfg_file = p / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(cfg))
    return path


def decoder(out: Path, arch: str, model_class: str, seed: int = 0, **overrides) -> str:
    """A model-zoo decoder config (``arch``: llama, qwen3...) saved as ``transformers.<model_class>``."""
    return build_random_checkpoint(
        out, lambda ids: _config(arch, ids, overrides), model_class, vocab_size=VOCAB, seed=seed
    )


def encoder(out: Path, kind: str, model_class: str, seed: int = 0, **overrides) -> str:
    cfg_name, extra = ENCODERS[kind]

    def config(ids: dict[str, int]):
        kw = {**_ENCODER, **extra, **overrides, **special_token_kwargs(ids)}
        if kind == "distilbert":  # its own key names (the config maps hidden_size etc. onto them)
            names = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"}
            kw = {names.get(k, k): v for k, v in kw.items()}
            kw["hidden_dim"] = kw.pop("intermediate_size")
        if kind == "modernbert":
            kw.update(cls_token_id=kw["bos_token_id"], sep_token_id=kw["eos_token_id"])
        return getattr(transformers, cfg_name)(**kw)

    return _no_chat_template(build_random_checkpoint(out, config, model_class, vocab_size=VOCAB, seed=seed))


def sentence_transformers_layout(
    path: str, mode: str, normalize: bool, max_seq_length: int = 256, old: bool = True, lower: bool = False
) -> str:
    """Write the sentence-transformers files beside a checkpoint: ``mode`` cls / mean / lasttoken, in the
    boolean spelling of sentence-transformers < 5 (``old``) or its ``pooling_mode`` string."""
    p = Path(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (p / "2_Normalize").mkdir(exist_ok=True)
    (p / "modules.json").write_text(json.dumps(modules))
    (p / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((p / "config.json").read_text())["hidden_size"]
    if old:
        pool = {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": mode == "cls",
            "pooling_mode_mean_tokens": mode == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_lasttoken": mode == "lasttoken",
        }
    else:
        pool = {"embedding_dimension": hidden, "pooling_mode": mode, "include_prompt": True}
    (p / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (p / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": lower})
    )
    return path


def assert_classified(out: Any, logits: Any, num_labels: int) -> None:
    """A classify output against transformers' logits: softmax probabilities (the raw score of a one-label
    head) within 1e-4, and a 3-label head's label name from LABELS3."""
    want = logits if num_labels == 1 else torch.softmax(logits, -1)
    torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=0)
    if num_labels == 3:
        assert out.outputs.label == LABELS3[int(logits.argmax())]
