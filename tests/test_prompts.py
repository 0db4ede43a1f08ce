"""Prompt building: validation into error rows, chat templates, per-row sampling overrides, seeds."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pytest

from batchgen.data.prompts import (
    PromptSpec,
    build_prompts,
    check_messages,
    parse_overrides,
    row_seed,
    struct_override_problems,
)
from batchgen.models.loader import load_tokenizer
from batchgen.sampling_params import SamplingParams

BASE = SamplingParams(temperature=0.0, max_tokens=8, seed=0)


@pytest.fixture(scope="module")
def tok(llama_ckpt: str):
    return load_tokenizer(llama_ckpt)


def test_bad_plain_prompts_become_error_rows(tok) -> None:
    table = pa.table({"prompt": ["hello world", None, "", "   \n", "x " * 300, "fine"]})
    rows = build_prompts(table, 100, PromptSpec(base_sampling=BASE, max_model_len=64), tok)
    assert [r.row_index for r in rows] == list(range(100, 106))
    assert [r.id for r in rows] == list(range(100, 106))
    errs = [r.error for r in rows]
    assert errs[0] is None and errs[5] is None
    assert errs[1] == "prompt is null"
    assert errs[2] == "prompt is empty"
    assert errs[3] == "prompt is only whitespace"
    assert "max_model_len is 64" in errs[4] and rows[4].num_prompt_tokens >= 64
    ok = rows[0]
    assert ok.token_ids == tok.encode("hello world") and ok.params is not None
    assert all(r.token_ids is None and r.params is None for r in rows if r.error)


def test_non_string_prompt_column(tok) -> None:
    rows = build_prompts(pa.table({"prompt": [1, None]}), 0, PromptSpec(base_sampling=BASE), tok)
    assert rows[0].error == "prompt must be a string, got int"
    assert rows[1].error == "prompt is null"
    rows = build_prompts(pa.table({"prompt": [[1, 2]]}), 0, PromptSpec(base_sampling=BASE), tok)
    assert rows[0].error == "prompt must be a string, got list"


def test_chat_messages_rendered_with_template(tok) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    table = pa.table(
        {
            "messages": pa.array(
                [msgs, None, [], [{"role": "user", "content": None}], [{"role": None, "content": "x"}]],
                type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
            )
        }
    )
    spec = PromptSpec(messages_column="messages", base_sampling=BASE)
    rows = build_prompts(table, 0, spec, tok)
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert expected.endswith("<|im_start|>assistant\n")
    assert rows[0].token_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert rows[1].error == "messages is null"
    assert rows[2].error == "messages is empty"
    assert rows[3].error == "messages[0].content must be a string, got NoneType"
    assert rows[4].error.startswith("messages[0].role must be a non-empty string")


def test_messages_as_json_strings(tok) -> None:
    good = json.dumps([{"role": "user", "content": "Hi"}])
    rows = build_prompts(
        pa.table({"m": [good, "not json", json.dumps({"role": "user"}), json.dumps(["x"])]}),
        0,
        PromptSpec(messages_column="m", base_sampling=BASE),
        tok,
    )
    assert rows[0].ok
    assert "not valid JSON" in rows[1].error
    assert rows[2].error.startswith("messages must be a list")
    assert rows[3].error.startswith("messages[0] must be an object")


def test_check_messages_keeps_extra_fields_and_drops_nulls() -> None:
    out = check_messages([{"role": "user", "content": "a", "name": None}])
    assert out == [{"role": "user", "content": "a"}]
    assert (
        check_messages([{"role": "user", "content": " "}])
        == "messages has no content (every message is empty)"
    )


def test_per_row_sampling_overrides(tok) -> None:
    st = pa.struct([("max_tokens", pa.int32()), ("temperature", pa.float64()), ("seed", pa.int64())])
    table = pa.table(
        {
            "prompt": ["a", "b", "c", "d"],
            "sampling": pa.array(
                [None, {"max_tokens": 3, "temperature": None, "seed": None}, {"max_tokens": None, "temperature": -1.0, "seed": None},
                 {"max_tokens": None, "temperature": None, "seed": 42}],
                type=st,
            ),
        }
    )  # fmt: skip
    rows = build_prompts(table, 0, PromptSpec(sampling_column="sampling", base_sampling=BASE), tok)
    assert rows[0].params.max_tokens == 8 and rows[0].params.seed == row_seed(0, 0)
    assert rows[1].params.max_tokens == 3 and rows[1].params.temperature == 0.0
    assert rows[2].error.startswith("invalid sampling override") and "temperature" in rows[2].error
    assert rows[3].params.seed == 42


def test_override_parsing() -> None:
    assert parse_overrides(None) == {}
    assert parse_overrides('{"max_tokens": 4, "top_p": null}') == {"max_tokens": 4}
    assert parse_overrides([("max_tokens", 4)]) == {"max_tokens": 4}
    assert "not allowed per row" in parse_overrides({"n": 2})
    assert "unknown sampling override" in parse_overrides({"temprature": 1})
    assert "not valid JSON" in parse_overrides("{oops")
    assert struct_override_problems(pa.struct([("max_tokens", pa.int32())])) is None
    assert "temprature" in struct_override_problems(pa.struct([("temprature", pa.float32())]))
    assert "expected a struct" in struct_override_problems(pa.int64())


def test_id_column_and_seeds(tok) -> None:
    table = pa.table({"prompt": ["a", "b", "c"], "uid": ["x", None, "z"]})
    rows = build_prompts(table, 10, PromptSpec(id_column="uid", base_sampling=BASE), tok)
    assert [r.id for r in rows] == ["x", None, "z"]
    assert rows[1].error == "id column 'uid' is null"
    assert rows[0].params.seed == row_seed(0, "x") != row_seed(0, "z")
    # the seed depends on (job seed, id) only: stable, and different for int/str ids of the same text
    assert row_seed(0, "x") == row_seed(0, "x") and row_seed(1, "x") != row_seed(0, "x")
    assert row_seed(0, 1) != row_seed(0, "1")
    unseeded = build_prompts(
        table, 10, PromptSpec(id_column="uid", base_sampling=dataclasses.replace(BASE, seed=None)), tok
    )
    assert unseeded[0].params.seed is None


def test_values_python_cannot_decode_become_error_rows(tok) -> None:
    """Invalid UTF-8 and out-of-range timestamps: `to_pylist` raises for the whole column; here only the row
    fails, saying why."""
    from conftest import write_invalid_utf8

    table = pa.table(
        {
            "prompt": write_invalid_utf8([b"fine", b"ab\x80cd", b"also fine"]),
            "ts": pa.array([0, 2**62, 1], pa.timestamp("us")),
        }
    )
    rows = build_prompts(table, 0, PromptSpec(base_sampling=BASE), tok)
    assert [r.error for r in rows] == [None, "prompt is not valid UTF-8 at byte 2", None]
    assert not rows[1].retryable and rows[0].ok and rows[2].ok
    rows = build_prompts(table, 0, PromptSpec(id_column="ts", base_sampling=BASE), tok)
    assert rows[1].error.startswith(
        "id column 'ts' value is not convertible to a Python value (OverflowError"
    )


def test_unreadable_rows_and_settings_errors_are_retryable(tok) -> None:
    table = pa.table({"prompt": ["one two three four five six", None, "ok"]})
    spec = PromptSpec(base_sampling=BASE, max_model_len=4)
    rows = build_prompts(
        table, 0, spec, tok, unreadable=[(1, 2, "input unreadable: 'x.parquet' row group 0")]
    )
    assert rows[0].error.startswith("prompt has") and rows[0].retryable  # engine.max_model_len: a setting
    assert rows[1].error.startswith("input unreadable") and rows[1].retryable
    assert rows[2].ok
