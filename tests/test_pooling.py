"""Pooling tasks against transformers (and sentence-transformers): decoder and encoder embedders, a 3-label
classifier, a reward head, sentence-transformers configs, batched and shuffled, error rows, prefix reuse."""

from __future__ import annotations

import random

import pooling_zoo as zoo
import pytest
import torch
import transformers

from batchgen import LLM
from batchgen.pooling.checkpoint import read_checkpoint

TEXTS = [
    "Instruct: find the answer\nQuery: what is a paged KV cache?",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Instruct: find the answer\nQuery: how do generators work in Python?",
    "def f(x):\n    return x * 2",
    "Instruct: find the answer\nQuery: what is a paged KV cache and why use it?",
    "tokens and more tokens",
] * 2


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pooling")


def _tokens(path, texts=TEXTS):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [tok.encode(t) for t in texts]


def _hf_hidden(model, ids: list[int], **kw) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), **kw)
    return out.last_hidden_state[0] if hasattr(out, "last_hidden_state") else out


def _ref_pool(h: torch.Tensor, method: str) -> torch.Tensor:
    return {"last": h[-1], "cls": h[0], "mean": h.mean(0)}[method]


def _assert_close_embeddings(ours, ref, normalize=True):
    ours = torch.tensor(ours)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min().item() >= 0.9999, cos
    if normalize:
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5, rtol=0)


def _assert_embeds_as_automodel(llm, path, toks: list[list[int]], methods: tuple[str, ...]) -> None:
    """``llm.embed`` of ``toks`` (one call per pooling method, normalised) against transformers' ``AutoModel``
    hidden states of each row alone, pooled the same way."""
    ref_model = transformers.AutoModel.from_pretrained(path).eval()
    hidden = [_hf_hidden(ref_model, t) for t in toks]
    for method in methods:
        outs = llm.embed(toks, pooling=method, use_tqdm=False)
        ref = torch.nn.functional.normalize(torch.stack([_ref_pool(h, method) for h in hidden]), dim=-1)
        _assert_close_embeddings([o.outputs.embedding for o in outs], ref)


def _shuffled(n: int, seed: int = 0) -> list[int]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


# ------------------------------------------------------------------------------------------- decoders
@pytest.fixture(scope="module")
def qwen3_embedder(root):
    return zoo.decoder(root / "qwen3-emb", "qwen3", "Qwen3Model", seed=3)


def test_decoder_embedder_matches_transformers(qwen3_embedder):
    llm = LLM(qwen3_embedder, num_blocks=64, block_size=8, max_num_batched_tokens=64, max_num_seqs=5)
    assert llm.task == "embed"
    toks = _tokens(qwen3_embedder)
    order = _shuffled(len(toks))
    ref_model = transformers.AutoModel.from_pretrained(qwen3_embedder).eval()
    hidden = [_hf_hidden(ref_model, toks[i]) for i in order]
    for method in ("last", "mean"):
        outs = llm.embed([toks[i] for i in order], pooling=method, use_tqdm=False)
        ref = torch.nn.functional.normalize(torch.stack([_ref_pool(h, method) for h in hidden]), dim=-1)
        assert all(o.error is None for o in outs)
        _assert_close_embeddings([o.outputs.embedding for o in outs], ref)
        if method == "last":  # rows sharing the instruction prefix reused its blocks
            assert llm.engine.stats.prompt_tokens_cached > 0


def test_causal_lm_embeds_on_request_and_dimensions(root):
    path = zoo.decoder(root / "llama-lm", "llama", "LlamaForCausalLM", seed=1)
    assert read_checkpoint(path).task == "generate"
    llm = LLM(path, task="embed", num_blocks=64, block_size=8)
    toks = _tokens(path)[:6]
    outs = llm.embed(toks, dimensions=16, normalize=True, use_tqdm=False)
    ref_model = transformers.AutoModel.from_pretrained(path).eval()
    ref = torch.stack([_hf_hidden(ref_model, t)[-1][:16] for t in toks])
    _assert_close_embeddings([o.outputs.embedding for o in outs], torch.nn.functional.normalize(ref, dim=-1))
    raw = llm.embed(toks[:2], normalize=False, use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor([o.outputs.embedding for o in raw]),
        (torch.stack([_hf_hidden(ref_model, t)[-1] for t in toks[:2]])),
        atol=1e-4,
        rtol=1e-4,
    )
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(toks[:1], dimensions=1000, use_tqdm=False)


@pytest.mark.parametrize("num_labels", [3, 1])
def test_decoder_classifier_and_reward_match_transformers(root, num_labels):
    kw = {"num_labels": num_labels}
    if num_labels == 3:
        kw["id2label"] = zoo.LABELS3
        kw["label2id"] = {v: k for k, v in zoo.LABELS3.items()}
    path = zoo.decoder(
        root / f"llama-cls{num_labels}", "llama", "LlamaForSequenceClassification", seed=4, **kw
    )
    llm = LLM(path, num_blocks=64, block_size=8, max_num_batched_tokens=48)
    assert llm.task == "classify"
    toks = _tokens(path)
    order = _shuffled(len(toks), 1)
    outs = llm.classify([toks[i] for i in order], use_tqdm=False)
    ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    for i, o in zip(order, outs):
        with torch.no_grad():
            logits = ref_model(input_ids=torch.tensor([toks[i]])).logits[0]
        zoo.assert_classified(o, logits, num_labels)
        if num_labels != 3:
            assert o.outputs.label is None and o.outputs.score == pytest.approx(float(logits[0]), abs=1e-4)


@pytest.mark.parametrize(
    "arch,backbone,classifier",
    [
        ("qwen2", "Qwen2Model", "Qwen2ForSequenceClassification"),
        ("mistral", "MistralModel", "MistralForSequenceClassification"),
        ("gemma2", "Gemma2Model", "Gemma2ForSequenceClassification"),
        # model_type gemma3_text is also the language model of the vision-language Gemma 3 checkpoints: a bare
        # text backbone or classifier must load as the text model, not look for a text_config
        ("gemma3_text", "Gemma3TextModel", "Gemma3TextForSequenceClassification"),
    ],
)
def test_native_decoder_families_embed_and_classify(root, arch, backbone, classifier):
    emb = zoo.decoder(root / f"{arch}-emb", arch, backbone, seed=15)
    llm = LLM(emb, num_blocks=64, block_size=8, max_num_batched_tokens=48)
    assert llm.engine.model.config.implementation == "native"
    toks = _tokens(emb)
    order = _shuffled(len(toks), 6)
    _assert_embeds_as_automodel(llm, emb, [toks[i] for i in order], ("last", "mean"))
    labels = {"num_labels": 3, "id2label": zoo.LABELS3, "label2id": {v: k for k, v in zoo.LABELS3.items()}}
    cls = zoo.decoder(root / f"{arch}-cls", arch, classifier, seed=16, **labels)
    outs = LLM(cls, num_blocks=64, block_size=8).classify([toks[i] for i in order], use_tqdm=False)
    ref_cls = transformers.AutoModelForSequenceClassification.from_pretrained(cls).eval()
    for i, o in zip(order, outs):
        with torch.no_grad():
            zoo.assert_classified(o, ref_cls(input_ids=torch.tensor([toks[i]])).logits[0], 3)


def test_error_rows_do_not_disturb_others(qwen3_embedder):
    llm = LLM(qwen3_embedder, num_blocks=64, block_size=8, max_model_len=40)
    toks = _tokens(qwen3_embedder)[:3]
    outs = llm.embed([toks[0], [], list(range(1, 60)), toks[1]], use_tqdm=False)
    assert outs[0].error is None and outs[3].error is None
    assert "empty" in outs[1].error and outs[1].outputs is None
    assert "at most" in outs[2].error
    alone = llm.embed([toks[0], toks[1]], use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor(outs[3].outputs.embedding), torch.tensor(alone[1].outputs.embedding)
    )
    with pytest.raises(ValueError, match="task='classify'"):
        llm.classify(["x"], use_tqdm=False)


def test_empty_text_is_an_error_row_as_in_a_job(root):
    """docs/pooling.md: an empty row comes back with ``error`` set and no outputs, also on an encoder whose
    tokenizer would give it [CLS] [SEP]; the job's error row says the same for its prompt column."""
    path = zoo.encoder(root / "bert-empty", "bert", "BertModel", seed=5)
    llm = LLM(path)
    empty, text, ids = llm.embed(["", "a b", [7, 8]], use_tqdm=False)
    assert empty.error == "prompt must be a non-empty string" and empty.outputs is None
    assert empty.prompt_token_ids == []
    assert (
        text.error is None and ids.error is None and len(text.outputs.embedding) == len(ids.outputs.embedding)
    )


# ------------------------------------------------------------------------------------------- encoders
@pytest.mark.parametrize(
    "kind,model_class",
    [
        ("bert", "BertModel"),
        ("modernbert", "ModernBertModel"),
        ("camembert", "CamembertModel"),
        ("electra", "ElectraModel"),
        ("distilbert", "DistilBertModel"),
        ("mpnet", "MPNetModel"),
        ("deberta-v2", "DebertaV2Model"),
        ("deberta", "DebertaModel"),
        ("albert", "AlbertModel"),
    ],
)
def test_encoder_embedder_matches_transformers(root, kind, model_class):
    path = zoo.encoder(root / f"{kind}-emb", kind, model_class, seed=5)
    llm = LLM(path, max_num_batched_tokens=96, max_num_seqs=6)
    assert llm.task == "embed" and llm.engine is None
    toks = _tokens(path)
    order = _shuffled(len(toks), 2)
    _assert_embeds_as_automodel(llm, path, [toks[i] for i in order], ("cls", "mean"))


@pytest.mark.parametrize(
    "kind,model_class", [("bert", "BertModel"), ("camembert", "CamembertModel"), ("mpnet", "MPNetModel")]
)
def test_encoder_position_limit(root, kind, model_class):
    """The longest row an encoder takes is its position table less the positions its family skips (RoBERTa's
    start after the padding id; MPNet's after 1 whatever the config says): that row embeds as transformers
    does, one token more is an error row."""
    path = zoo.encoder(root / f"{kind}-limit", kind, model_class, seed=10, max_position_embeddings=40)
    pad = transformers.AutoConfig.from_pretrained(path).pad_token_id
    limit = {"bert": 40, "camembert": 40 - (pad + 1), "mpnet": 38}[kind]
    llm = LLM(path)
    ids = [7 + i % 50 for i in range(limit + 1)]
    ok, long = llm.embed([ids[:limit], ids], pooling="mean", use_tqdm=False)
    assert long.outputs is None and f"at most {limit}" in long.error
    ref_model = transformers.AutoModel.from_pretrained(path).eval()
    ref = torch.nn.functional.normalize(_hf_hidden(ref_model, ids[:limit]).mean(0), dim=-1)
    _assert_close_embeddings([ok.outputs.embedding], ref[None])


@pytest.mark.parametrize(
    "kind,model_class,num_labels",
    [
        ("bert", "BertForSequenceClassification", 3),
        ("xlm-roberta", "XLMRobertaForSequenceClassification", 3),
        ("camembert", "CamembertForSequenceClassification", 3),
        ("electra", "ElectraForSequenceClassification", 3),
        ("distilbert", "DistilBertForSequenceClassification", 3),
        ("bert", "BertForSequenceClassification", 1),  # a cross-encoder's relevance score
        ("mpnet", "MPNetForSequenceClassification", 3),
        ("deberta-v2", "DebertaV2ForSequenceClassification", 3),
        ("albert", "AlbertForSequenceClassification", 1),
    ],
)
def test_encoder_classifier_matches_transformers(root, kind, model_class, num_labels):
    kw = {"num_labels": num_labels}
    if num_labels == 3:
        kw.update(id2label=zoo.LABELS3, label2id={v: k for k, v in zoo.LABELS3.items()})
    path = zoo.encoder(root / f"{kind}-cls{num_labels}", kind, model_class, seed=6, **kw)
    llm = LLM(path, max_num_batched_tokens=64)
    assert llm.task == "classify"
    toks = _tokens(path)
    order = _shuffled(len(toks), 5)
    outs = llm.classify([toks[i] for i in order], use_tqdm=False)
    ref_model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    for i, o in zip(order, outs):
        with torch.no_grad():
            logits = ref_model(input_ids=torch.tensor([toks[i]])).logits[0]
        zoo.assert_classified(o, logits, num_labels)


def test_a_model_family_batchgen_does_not_pool_is_refused_by_name(root):
    def config(ids):
        return transformers.NomicBertConfig(**zoo._ENCODER, **zoo.special_token_kwargs(ids))

    path = zoo.build_random_checkpoint(root / "nomic-refused", config, "NomicBertModel", vocab_size=zoo.VOCAB)
    with pytest.raises(ValueError, match="nomic_bert models are not pooled by batchgen"):
        LLM(path)


def test_sentence_transformers_config_matches_sentence_transformers(root):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    path = zoo.encoder(root / "st-mean", "bert", "BertModel", seed=7)
    zoo.sentence_transformers_layout(path, "mean", True, old=True)
    info = read_checkpoint(path)
    assert (info.task, info.pooling, info.normalize, info.max_seq_length) == ("embed", "mean", True, 256)
    llm = LLM(path, max_num_batched_tokens=80)
    outs = llm.embed(TEXTS, use_tqdm=False)
    ref = torch.tensor(st.SentenceTransformer(path, device="cpu").encode(TEXTS))
    ours = torch.tensor([o.outputs.embedding for o in outs])
    assert torch.nn.functional.cosine_similarity(ours, ref).min() >= 0.9999
    torch.testing.assert_close(ours.norm(dim=-1), ref.norm(dim=-1), atol=1e-4, rtol=1e-4)
    # the sentence-transformers >= 5 spelling, without Normalize: CLS pooling, not normalised
    zoo.sentence_transformers_layout(path, "cls", False, old=False)
    info = read_checkpoint(path)
    assert (info.pooling, info.normalize, info.default_normalize) == ("cls", False, False)


def test_sentence_transformers_do_lower_case(root):
    """A checkpoint whose sentence-transformers config lowercases texts: batchgen tokenises the lowercased
    text too (mixed-case texts embed as sentence-transformers embeds them); token ids are taken as given."""
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    path = zoo.encoder(root / "st-lower", "bert", "BertModel", seed=14)
    zoo.sentence_transformers_layout(path, "mean", True, lower=True)
    assert read_checkpoint(path).lowercase
    texts = ["The Quick BROWN Fox", "Paged KV Cache", "ALL CAPS QUERY", "already lower"]
    llm = LLM(path)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    ref = torch.tensor(st.SentenceTransformer(path, device="cpu").encode(texts))
    assert torch.nn.functional.cosine_similarity(ours, ref).min() >= 0.9999
    lowered = llm.embed([t.lower() for t in texts], use_tqdm=False)
    assert [o.prompt_token_ids for o in lowered] == [
        o.prompt_token_ids for o in llm.embed(texts, use_tqdm=False)
    ]
    ids = transformers.AutoTokenizer.from_pretrained(path).encode(texts[0])  # ids: not lowercased
    assert llm.embed([ids], use_tqdm=False)[0].prompt_token_ids == ids


def test_sentence_transformers_decoder_lasttoken(root):
    path = zoo.decoder(root / "qwen3-st", "qwen3", "Qwen3Model", seed=8)
    zoo.sentence_transformers_layout(path, "lasttoken", True, old=False)
    llm = LLM(path, num_blocks=64, block_size=8)
    toks = _tokens(path)[:5]
    outs = llm.embed(toks, use_tqdm=False)
    ref_model = transformers.AutoModel.from_pretrained(path).eval()
    ref = torch.nn.functional.normalize(torch.stack([_hf_hidden(ref_model, t)[-1] for t in toks]), dim=-1)
    _assert_close_embeddings([o.outputs.embedding for o in outs], ref)


def test_unsupported_sentence_transformers_module_is_named(root):
    path = zoo.encoder(root / "st-dense", "bert", "BertModel", seed=9)
    zoo.sentence_transformers_layout(path, "max", False, old=False)
    with pytest.raises(ValueError, match="pooling mode 'max'"):
        read_checkpoint(path)


def test_task_detection_from_the_architecture_name() -> None:
    """A language model whose class name ends in "Model" (GPT-2's LMHeadModel) generates; a bare backbone
    embeds; a sequence classifier classifies."""
    from batchgen.pooling.checkpoint import detect_task

    assert detect_task("GPT2LMHeadModel", "gpt2", False) == "generate"
    assert detect_task("LlamaForCausalLM", "llama", False) == "generate"
    assert detect_task("Qwen3Model", "qwen3", False) == "embed"
    assert detect_task("BertModel", "bert", False) == "embed"
    assert detect_task("LlamaForSequenceClassification", "llama", False) == "classify"
