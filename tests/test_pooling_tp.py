"""Decoder pooling under tensor parallelism (engine.tensor_parallel_size=2, CPU ranks over gloo): embeddings
and class probabilities equal the one-process engine's; encoders and the transformers backend are refused
with one clear error."""

from __future__ import annotations

import pooling_zoo as zoo
import pytest
import torch

from batchgen import LLM

ENGINE = dict(device="cpu", num_blocks=64, block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
TOKENS = [[1, 5, 9, 33, 7], list(range(10, 52)), [4, 4, 4, 100, 200, 300, 17], [7] * 3, list(range(10, 30))]


def test_embeddings_and_classifier_under_tp2_equal_one_process(tmp_path):
    emb = zoo.decoder(tmp_path / "qwen3", "qwen3", "Qwen3Model", seed=31)
    want = {m: LLM(emb, **ENGINE).embed(TOKENS, pooling=m, use_tqdm=False) for m in ("last", "mean")}
    sharded = LLM(emb, tensor_parallel_size=2, **ENGINE)
    for method, ref in want.items():
        got = sharded.embed(TOKENS, pooling=method, use_tqdm=False)
        torch.testing.assert_close(
            torch.tensor([o.outputs.embedding for o in got]),
            torch.tensor([o.outputs.embedding for o in ref]),
            atol=1e-5,
            rtol=1e-4,
        )
    labels = {"id2label": zoo.LABELS3, "label2id": {v: k for k, v in zoo.LABELS3.items()}}
    cls = zoo.decoder(
        tmp_path / "llama-cls", "llama", "LlamaForSequenceClassification", seed=32, num_labels=3, **labels
    )
    ref = LLM(cls, **ENGINE).classify(TOKENS, use_tqdm=False)
    got = LLM(cls, tensor_parallel_size=2, **ENGINE).classify(TOKENS, use_tqdm=False)
    for a, b in zip(got, ref):
        assert (
            a.outputs.probs == pytest.approx(b.outputs.probs, abs=1e-5) and a.outputs.label == b.outputs.label
        )


def test_encoders_and_the_transformers_backend_are_refused_under_tp(tmp_path):
    bert = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=33)
    with pytest.raises(ValueError, match="encoder models .* run on one device"):
        LLM(bert, tensor_parallel_size=2, device="cpu")
    neox = zoo.decoder(tmp_path / "neox", "gpt_neox", "GPTNeoXModel", seed=34)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .* transformers backend runs on one device"):
        LLM(neox, tensor_parallel_size=2, device="cpu")
