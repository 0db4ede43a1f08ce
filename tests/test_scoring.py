"""Prompt logprobs and scoring against transformers' log-softmax of the forward logits, with and without
prefix-cache hits and with chunked prefill; chat with OpenAI content parts."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, SamplingParams
from batchgen.scoring import rolling_windows


@pytest.fixture(scope="module")
def hf(llama_ckpt):
    return AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).eval()


def hf_logsoftmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def make_llm(ckpt, **kw) -> LLM:
    opts = dict(device="cpu", num_blocks=128, block_size=8, max_num_seqs=4)
    opts.update(kw)
    return LLM(ckpt, **opts)


PROMPTS = [list(range(5, 30)), [7, 3, 9, 11, 2, 40, 41, 42, 43, 44, 45], list(range(5, 18)) + [90, 91]]


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_match_transformers(llama_ckpt, hf, chunk) -> None:
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = make_llm(llama_ckpt, **kw)
    # The first prompt fills the prefix cache; the third shares 12 tokens with it (would be a hit).
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        ref = hf_logsoftmax(hf, ids)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        for i in range(1, len(ids)):
            d = out.prompt_logprobs[i]
            assert d[ids[i]] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
            top = ref[i - 1].topk(3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert d[t] == pytest.approx(v, abs=1e-4)
            assert len(d) in (3, 4)
    assert outs[2].num_cached_tokens == 0  # prompt-logprob requests take no prefix-cache hits


def test_prompt_logprobs_off_by_default(llama_ckpt) -> None:
    llm = make_llm(llama_ckpt)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_score_matches_transformers(llama_ckpt, hf, prefix_caching) -> None:
    llm = make_llm(llama_ckpt, enable_prefix_caching=prefix_caching, max_num_batched_tokens=16)
    ctx = list(range(3, 24))  # 21 tokens: 2 full blocks of 8 shareable
    conts = [[50, 51, 52], [60], [70, 71], [80, 81, 82, 83]]
    pairs = [(ctx, c) for c in conts] + [([9, 8], [7, 6])]
    scores = llm.score([p[0] for p in pairs], [p[1] for p in pairs])
    for (c, x), s in zip(pairs, scores):
        ref = hf_logsoftmax(hf, c + x)
        want = sum(ref[len(c) - 1 + j, t].item() for j, t in enumerate(x))
        greedy = all(ref[len(c) - 1 + j].argmax().item() == t for j, t in enumerate(x))
        assert s.loglikelihood == pytest.approx(want, abs=1e-4)
        assert s.num_tokens == len(x)
        assert s.is_greedy == greedy
    hits = sum(s.num_cached_tokens for s in scores)
    assert (hits > 0) == prefix_caching  # continuations 2..4 reuse the context's blocks


def test_score_greedy_continuation(llama_ckpt) -> None:
    llm = make_llm(llama_ckpt)
    ctx = [5, 6, 7, 8, 9]
    gen = llm.generate([ctx], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    cont = gen[0].outputs[0].token_ids
    s = llm.score([ctx, ctx], [cont, [(cont[0] + 1) % 100, *cont[1:]]])
    assert s[0].is_greedy and not s[1].is_greedy


def test_rolling_windows_cover_each_token_once() -> None:
    toks = list(range(100, 137))
    windows = list(rolling_windows(toks, 1, max_seq_len=8))
    assert [t for _, c in windows for t in c] == toks
    assert windows[0][0] == [1]
    assert all(len(c) + len(x) - 1 <= 8 for c, x in windows)


def test_loglikelihood_rolling_matches_transformers(llama_ckpt, hf) -> None:
    llm = make_llm(llama_ckpt)
    text = "hello world, this is a test of rolling perplexity over a few windows of tokens"
    tok = llm.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    ((ll, n),) = llm.loglikelihood_rolling(text, max_length=8)
    want = 0.0
    for c, x in rolling_windows(ids, prefix, 8):
        ref = hf_logsoftmax(hf, c + x)
        want += sum(ref[len(c) - 1 + j, t].item() for j, t in enumerate(x))
    assert n == len(ids)
    assert ll == pytest.approx(want, abs=1e-3)
    assert math.isfinite(math.exp(-ll / n))


def test_chat_accepts_openai_content_parts(llama_ckpt) -> None:
    llm = make_llm(llama_ckpt)
    plain = [{"role": "user", "content": "hi there\nfriend"}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi there"}, {"type": "text", "text": "friend"}],
        }
    ]
    sp = SamplingParams(temperature=0, max_tokens=4)
    a = llm.chat(plain, sp, use_tqdm=False)
    b = llm.chat([parts, plain], sp, use_tqdm=False)
    assert len(a) == 1 and len(b) == 2
    assert a[0].prompt == b[0].prompt == b[1].prompt
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="takes no images"):  # image parts need an image-text checkpoint
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], sp)


def test_job_messages_accept_content_parts() -> None:
    from batchgen.data.prompts import check_messages

    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert check_messages(parts) == [{"role": "user", "content": "a\nb"}]
    bad = [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url"}]}]
    assert (
        check_messages(bad) == "messages[1].content[0] has type 'image_url'; only 'text' parts are supported"
    )


def test_score_job_matches_api_and_resumes(llama_ckpt, tmp_path) -> None:
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config

    from batchgen.job.run import run_job

    def read(d):
        return pa.concat_tables([pq.read_table(p) for p in sorted(d.glob("*.parquet"))])

    ctx = "the shared context of every row, long enough to fill a few blocks of the cache"
    conts = [" one", " two three", " four", " five six seven", None, " eight"]
    rows = {"context": [ctx] * 5 + [None], "completion": conts}
    pq.write_table(pa.table(rows), tmp_path / "in.parquet")
    job = job_config(llama_ckpt, tmp_path / "in.parquet", tmp_path / "out", data={"window_rows": 4})
    job = dataclasses.replace(
        job,
        task="score",
        data=dataclasses.replace(job.data, prompt_column="context", continuation_column="completion"),
        run=dataclasses.replace(job.run, max_error_fraction=1.0),  # two rows are errors on purpose
    )
    res = run_job(job, print_summary=False, handle_signals=False)
    assert res.exit_code == 0, res.message
    out = read(tmp_path / "out").sort_by("id").to_pydict()
    assert out["status"] == ["ok"] * 4 + ["error", "error"]
    llm = make_llm(llama_ckpt)
    want = llm.score([ctx] * 4, conts[:4])
    for i, s in enumerate(want):
        assert out["loglikelihood"][i] == pytest.approx(s.loglikelihood, abs=1e-4)
        assert out["num_continuation_tokens"][i] == s.num_tokens
        assert out["is_greedy"][i] == s.is_greedy
    assert sum(out["num_cached_tokens"]) > 0  # continuations after the first reuse the context
    # rolling: perplexity of the context column
    job2 = dataclasses.replace(
        job, data=dataclasses.replace(job.data, output=str(tmp_path / "ppl"), continuation_column=None)
    )
    assert run_job(job2, print_summary=False, handle_signals=False).exit_code == 0
    ppl = read(tmp_path / "ppl").sort_by("id").to_pydict()
    ((ll, n),) = llm.loglikelihood_rolling(ctx)
    assert ppl["loglikelihood_rolling"][0] == pytest.approx(ll, abs=1e-3) and ppl["num_tokens"][0] == n
    assert ppl["perplexity"][0] == pytest.approx(math.exp(-ll / n), rel=1e-4)
    assert ppl["status"][5] == "error"
