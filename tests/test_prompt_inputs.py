"""vLLM's prompt forms in the Python API: strings, token-id lists, TextPrompt and TokensPrompt dicts, mixed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen import LLM, SamplingParams, TextPrompt, TokensPrompt
from batchgen.prompt_inputs import ParsedPrompt, parse_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_parse_forms_and_single_prompts():
    assert parse_prompts("hi") == [ParsedPrompt("hi", None)]
    assert parse_prompts([1, 2, 3]) == [ParsedPrompt(None, [1, 2, 3])]
    assert parse_prompts({"prompt": "hi"}) == [ParsedPrompt("hi", None)]
    assert parse_prompts(TokensPrompt(prompt_token_ids=[4, 5])) == [ParsedPrompt(None, [4, 5])]
    assert parse_prompts({"prompt_token_ids": [4], "prompt": "x"}) == [ParsedPrompt("x", [4])]
    assert parse_prompts(np.array([7, 8])) == [ParsedPrompt(None, [7, 8])]
    assert parse_prompts(torch.tensor([7, 8])) == [ParsedPrompt(None, [7, 8])]
    mixed = parse_prompts(["a", [1], TextPrompt(prompt="b"), {"prompt_token_ids": np.array([2, 3])}, []])
    assert [p.engine_prompt for p in mixed] == ["a", [1], "b", [2, 3], []]
    assert parse_prompts([]) == []


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([[1, 2], {"text": "x"}], "prompt 1: unsupported key(s) ['text']"),
        ([{"prompt": "x", "multi_modal_data": {"audio": b""}}], "prompt 0: 'multi_modal_data' must be"),
        ([{}], "prompt 0: a prompt dict needs 'prompt'"),
        (["a", {"prompt": 3}], "prompt 1: 'prompt' must be a string"),
        (["a", "b", None], "prompt 2: a prompt must be a string, a list of token ids or a prompt dict"),
        ([[1, 2.5]], "prompt 0: token ids must be integers, got 2.5"),
        ([[1, True]], "prompt 0: token ids must be integers"),
        ([{"prompt_token_ids": "abc"}], "prompt 0: 'prompt_token_ids' must be"),
        ([{"prompt_token_ids": [1], "prompt": 5}], "prompt 0: 'prompt' must be a string"),
    ],
)
def test_bad_prompts_name_the_prompt_and_what_to_pass(prompts, message):
    with pytest.raises(ValueError) as err:
        parse_prompts(prompts)
    assert message in str(err.value)


def test_generate_takes_every_form_with_the_same_result(llama_ckpt):
    llm = LLM(llama_ckpt, num_blocks=64)
    text = "The quick brown fox"
    ids = llm.tokenizer.encode(text)
    forms = [
        text,
        ids,
        {"prompt": text},
        {"prompt_token_ids": ids},
        {"prompt_token_ids": ids, "prompt": text},
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert all(o.error is None and o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, None, text, None, text]
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt 1: unsupported key"):
        llm.generate([ids, {"prompt_ids": ids}], GREEDY, use_tqdm=False)
    (empty,) = llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)  # fails alone, as a list does
    assert "empty prompt" in empty.error


def test_embed_takes_prompt_dicts(tmp_path):
    import pooling_zoo as zoo

    path = zoo.decoder(tmp_path / "qwen3-emb", "qwen3", "Qwen3Model", seed=3)
    llm = LLM(path, num_blocks=64, block_size=8)
    text = "Instruct: find the answer\nQuery: what is a paged KV cache?"
    ids = llm.tokenizer.encode(text)
    outs = llm.embed([text, {"prompt": text}, {"prompt_token_ids": ids}, ids], use_tqdm=False)
    assert all(o.error is None and o.prompt_token_ids == ids for o in outs)
    for o in outs[1:]:
        assert o.outputs.embedding == outs[0].outputs.embedding
    with pytest.raises(ValueError, match="prompt 0: unsupported key"):
        llm.embed({"input": text}, use_tqdm=False)
