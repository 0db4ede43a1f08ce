"""Decoder pooling through transformers' modeling code (families without native code, and
``model_impl="transformers"`` for a native one): embeddings, a 3-label classifier and a reward head equal
transformers' AutoModel / AutoModelForSequenceClassification, batched and shuffled."""

from __future__ import annotations

import random

import pooling_zoo as zoo
import pytest
import torch
import transformers

from batchgen import LLM

TEXTS = [
    "Instruct: find the answer\nQuery: what is a paged KV cache?",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Instruct: find the answer\nQuery: how do generators work in Python?",
    "def f(x):\n    return x * 2",
    "tokens and more tokens",
]
ENGINE = dict(num_blocks=64, block_size=8, max_num_batched_tokens=48, max_num_seqs=4)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pooling-hf")


def _tokens(path):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [tok.encode(t) for t in TEXTS]


def _order(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


@pytest.mark.parametrize(
    "arch,model_class,impl",
    [("gpt_neox", "GPTNeoXModel", "auto"), ("llama", "LlamaModel", "transformers")],
)
def test_embeddings_match_automodel(root, arch, model_class, impl):
    path = zoo.decoder(root / f"{arch}-emb", arch, model_class, seed=11)
    llm = LLM(path, model_impl=impl, **ENGINE)
    assert llm.task == "embed"
    assert llm.engine.model.config.implementation == "transformers"
    toks = _tokens(path)
    order = _order(len(toks), 3)
    ref_model = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = [ref_model(input_ids=torch.tensor([toks[i]])).last_hidden_state[0] for i in order]
    for method in ("last", "mean"):
        outs = llm.embed([toks[i] for i in order], pooling=method, use_tqdm=False)
        ref = torch.stack([h[-1] if method == "last" else h.mean(0) for h in hidden])
        ours = torch.tensor([o.outputs.embedding for o in outs])
        cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
        assert cos.min().item() >= 0.9999, cos
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "arch,model_class,num_labels",
    [
        ("gpt_neox", "GPTNeoXForSequenceClassification", 3),
        ("olmo2", "Olmo2ForSequenceClassification", 1),
        ("starcoder2", "Starcoder2ForSequenceClassification", 2),  # no labels in config.json: 2, LABEL_i
    ],
)
def test_classifier_and_reward_match_transformers(root, arch, model_class, num_labels):
    kw = {"num_labels": num_labels}
    if num_labels == 3:
        kw.update(id2label=zoo.LABELS3, label2id={v: k for k, v in zoo.LABELS3.items()})
    path = zoo.decoder(root / f"{arch}-cls", arch, model_class, seed=12, **kw)
    llm = LLM(path, **ENGINE)
    assert llm.task == "classify"
    ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    pad = ref_model.config.pad_token_id
    toks = _tokens(path)
    toks.append(toks[0] + [pad, pad])  # transformers scores the last token that is not padding
    order = _order(len(toks), 4)
    outs = llm.classify([toks[i] for i in order], use_tqdm=False)
    for i, o in zip(order, outs):
        with torch.no_grad():
            logits = ref_model(input_ids=torch.tensor([toks[i]])).logits[0]
        zoo.assert_classified(o, logits, num_labels)
        if num_labels == 2:
            assert o.outputs.label == f"LABEL_{int(logits.argmax())}"


def test_native_only_is_refused_for_a_family_without_native_code(root):
    path = zoo.decoder(root / "neox-native", "gpt_neox", "GPTNeoXModel", seed=13)
    with pytest.raises(ValueError, match="no native decoder"):
        LLM(path, model_impl="native", **ENGINE)
