"""Structured outputs (json_schema / regex / choice / grammar): every finished output satisfies its constraint,
even from a random-weight model at temperature 1; per-row constraints; the grammar cache; per-request errors."""

from __future__ import annotations

import json
import re

import pytest

from batchgen import LLM, SamplingParams

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")
jsonschema = pytest.importorskip(
    "jsonschema", reason="validating outputs needs jsonschema (the 'test' extra)"
)

SEEDS = range(12)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "integer"}, "city": {"type": "string", "maxLength": 5}},
            "required": ["zip"],
            "additionalProperties": False,
        },
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(llama_ckpt: str) -> LLM:
    return LLM(llama_ckpt, num_blocks=256)


def _run(llm: LLM, params: list[SamplingParams], prompt: str = "Hello there") -> list:
    return llm.generate([prompt] * len(params), params, use_tqdm=False)


def test_json_schema_valid_over_seeds(llm: LLM) -> None:
    outs = _run(llm, [SamplingParams(json_schema=PERSON, max_tokens=256, seed=s) for s in SEEDS])
    texts = set()
    for o in outs:
        c = o.outputs[0]
        assert o.error is None and c.finish_reason == "stop", (c.finish_reason, c.text)
        assert c.constraint_satisfied is True
        jsonschema.validate(json.loads(c.text), PERSON)
        outside_strings = re.sub(r'"(?:[^"\\\\]|\\\\.)*"', '""', c.text)
        assert not re.search(r"\s", outside_strings), c.text  # compact JSON: no whitespace between tokens
        texts.add(c.text)
    assert len(texts) > 1  # temperature 1: the seeds give different objects


def test_json_schema_as_string_and_optional_fields(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -5, "maximum": 500},
            "b": {"type": "string", "maxLength": 5},
            "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
    }
    outs = _run(llm, [SamplingParams(json_schema=json.dumps(schema), max_tokens=128, seed=s) for s in SEEDS])
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.constraint_satisfied
        jsonschema.validate(json.loads(c.text), schema)


def test_choice_and_regex_over_seeds(llm: LLM) -> None:
    choices = ["yes", "no", "maybe so", "ünïcode ☃"]
    pattern = r"[0-9]{2,3}-(ab|cd)[xyz]{1,2}"
    params = [SamplingParams(choice=choices, seed=s, max_tokens=32) for s in SEEDS]
    params += [SamplingParams(regex=pattern, seed=s, max_tokens=32) for s in SEEDS]
    outs = _run(llm, params)
    for o in outs[: len(SEEDS)]:
        c = o.outputs[0]
        assert c.text in choices and c.finish_reason == "stop" and c.constraint_satisfied
    for o in outs[len(SEEDS) :]:
        c = o.outputs[0]
        assert re.fullmatch(pattern, c.text), c.text
        assert c.finish_reason == "stop" and c.constraint_satisfied


def test_grammar_ebnf(llm: LLM) -> None:
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" expr'
    outs = _run(llm, [SamplingParams(grammar=grammar, seed=s, max_tokens=64) for s in SEEDS])
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\((\d\+)*\d\)", c.text), c.text
            assert c.constraint_satisfied
        else:
            assert c.constraint_satisfied is False


def test_per_row_constraints_in_one_batch(llm: LLM) -> None:
    """Different constraints (and none) side by side in the same steps; n > 1 samples are each valid."""
    params = [
        SamplingParams(choice=["red", "green"], seed=1),
        SamplingParams(max_tokens=8, seed=2),
        SamplingParams(
            json_schema={"type": "array", "items": {"type": "integer"}, "maxItems": 3}, seed=3, max_tokens=64
        ),
        SamplingParams(regex=r"[a-c]{4}", seed=4, n=3),
        SamplingParams(choice=["blue", "cyan"], seed=5, temperature=0),
    ]
    outs = _run(llm, params)
    assert outs[0].outputs[0].text in ("red", "green")
    assert outs[1].outputs[0].constraint_satisfied is None
    arr = json.loads(outs[2].outputs[0].text)
    assert isinstance(arr, list) and len(arr) <= 3 and all(isinstance(x, int) for x in arr)
    assert len(outs[3].outputs) == 3
    assert all(re.fullmatch("[a-c]{4}", c.text) for c in outs[3].outputs)
    assert outs[4].outputs[0].text in ("blue", "cyan")


def test_truncated_output_is_marked(llm: LLM) -> None:
    outs = _run(llm, [SamplingParams(json_schema=PERSON, max_tokens=3, seed=s) for s in range(3)])
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and c.constraint_satisfied is False


def test_invalid_constraints_are_request_errors(llm: LLM) -> None:
    params = [
        SamplingParams(regex="(unclosed"),
        SamplingParams(json_schema={"type": "no-such-type"}),
        SamplingParams(grammar="root ::= undefined_rule"),
        SamplingParams(choice=["ok"]),
    ]
    outs = _run(llm, params)
    for o in outs[:3]:
        assert o.error and "invalid" in o.error and o.outputs[0].finish_reason == "error"
    assert outs[3].error is None and outs[3].outputs[0].text == "ok"


def test_grammar_cache_hits(llm: LLM) -> None:
    so = llm.engine.structured
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    _run(llm, [SamplingParams(json_schema=schema, seed=0, max_tokens=4)])  # the counters need no full output
    hits, misses = so.hits, so.misses
    _run(llm, [SamplingParams(json_schema=json.dumps(schema), seed=s, max_tokens=4) for s in range(5)])
    assert so.misses == misses and so.hits == hits + 5
    _run(llm, [SamplingParams(choice=["a", "b"], max_tokens=4)])
    assert so.misses == misses + 1


def test_matchers_go_away_with_sequences(llm: LLM) -> None:
    import gc

    _run(llm, [SamplingParams(choice=["a", "b"], seed=s) for s in range(4)])
    gc.collect()
    assert llm.engine.structured.num_tracked == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"regex": "a", "choice": ["a"]}, "at most one"),
        ({"choice": []}, "non-empty"),
        ({"choice": "abc"}, "list of strings"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": [1]}, "JSON object"),
        ({"regex": "a", "beam_width": 2}, "beam search"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"regex": "a", "min_tokens": 2}, "min_tokens"),
    ],
)
def test_sampling_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_roundtrip() -> None:
    p = SamplingParams(json_schema='{"type": "object"}')
    assert p.json_schema == {"type": "object"} and p.constrained
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert not SamplingParams().constrained


# ------------------------------------------------------------------------------------------------ the job
def test_arrow_type_from_schema() -> None:
    import pyarrow as pa

    from batchgen.data.structured import arrow_type, parse_column

    t = arrow_type(PERSON)
    assert t == pa.struct(
        [
            pa.field("name", pa.string()),
            pa.field("age", pa.int64()),
            pa.field("score", pa.float64()),
            pa.field("kind", pa.string()),
            pa.field("tags", pa.list_(pa.string())),
            pa.field("address", pa.struct([pa.field("zip", pa.int64()), pa.field("city", pa.string())])),
            pa.field("alive", pa.bool_()),
        ]
    )
    col = parse_column(['{"name":"a","age":3,"kind":"cat","tags":[],"address":{"zip":1}}', None, "{bad"], t)
    assert col.to_pylist()[0]["age"] == 3 and col.to_pylist()[0]["alive"] is None
    assert col.to_pylist()[1:] == [None, None]
    assert arrow_type({"anyOf": [{"type": "string"}, {"type": "integer"}]}) == pa.string()


def test_job_per_row_constraints_and_parsed_json(llama_ckpt: str, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config

    from batchgen.job.run import EXIT_OK, run_job

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    }
    overrides = [
        None,
        json.dumps({"choice": ["left", "right"]}),
        json.dumps({"regex": "[xy]{3}"}),
        json.dumps({"regex": "(bad"}),
        json.dumps({"max_tokens": 2}),
        json.dumps(
            {"json_schema": {"type": "object", "properties": {"z": {"type": "string", "maxLength": 3}}}}
        ),
    ]
    pq.write_table(
        pa.table({"prompt": [f"row {i}" for i in range(len(overrides))], "sampling": overrides}),
        tmp_path / "in.parquet",
    )
    cfg = job_config(
        llama_ckpt,
        tmp_path / "in.parquet",
        tmp_path / "out",
        data={"parse_json": True},
        sampling={"json_schema": json.dumps(schema), "max_tokens": 48, "temperature": 1.0},
    )
    cfg.run.max_error_fraction = 1.0  # the bad-regex row is an error row on purpose
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    t = pa.concat_tables([pq.read_table(p) for p in parts]).to_pylist()
    assert [r["status"] for r in t] == ["ok", "ok", "ok", "error", "ok", "ok"]
    assert t[0]["constraint_satisfied"] is True and t[0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(t[0]["generated_text"]), schema)
    assert t[0]["generated_json"] == json.loads(t[0]["generated_text"])
    assert t[1]["generated_text"] in ("left", "right") and t[1]["generated_json"] is None
    assert re.fullmatch("[xy]{3}", t[2]["generated_text"])
    assert "invalid regex" in t[3]["error"]
    assert t[4]["finish_reason"] == "length" and t[4]["constraint_satisfied"] is False
    assert t[4]["generated_json"] is None  # cut by max_tokens: never a silent half JSON
    assert json.loads(t[5]["generated_text"]).keys() <= {"z"} and t[5]["constraint_satisfied"]


def test_cli_accepts_constraints(tmp_path) -> None:
    """Hydra overrides: a schema as a Hydra dict or a quoted JSON string, a choice list; printed by --cfg job."""
    import subprocess
    import sys

    from conftest import env_without_slurm

    def cfg(*args: str) -> str:
        p = subprocess.run(
            [sys.executable, "-m", "batchgen.cli", "--cfg", "job", *args],
            cwd=tmp_path,
            env=env_without_slurm(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
        return p.stdout

    out = cfg("sampling.json_schema={type:object,properties:{a:{type:integer}}}", "data.parse_json=true")
    assert "json_schema:\n    type: object" in out and "parse_json: true" in out
    assert 'json_schema: \'{"type":"object"}\'' in cfg('sampling.json_schema=\'{"type":"object"}\'')
    assert "choice:\n  - 'yes'\n  - 'no'" in cfg("sampling.choice=[yes,no]")


def test_hydra_sampling_config_builds_params() -> None:
    """The job's sampling config (an OmegaConf structured config) turns into SamplingParams with a dict."""
    from omegaconf import OmegaConf

    conf = OmegaConf.structured(SamplingParams)
    conf.json_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = OmegaConf.to_object(conf)
    assert isinstance(p, SamplingParams) and p.json_schema == {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
    }
    assert SamplingParams(json_schema=conf.json_schema).json_schema["type"] == "object"  # a DictConfig


def test_without_xgrammar_constrained_requests_fail_alone(llm: LLM, monkeypatch) -> None:
    import batchgen.engine.core.llm_engine as le

    monkeypatch.setattr(le, "structured_available", lambda: False)
    outs = _run(llm, [SamplingParams(regex="a+"), SamplingParams(max_tokens=2)])
    assert "xgrammar" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None


def _structured(llm: LLM):
    from batchgen.engine.features.structured import StructuredOutputs

    engine = llm.engine
    return StructuredOutputs(engine.tokenizer, engine.model.config.vocab_size, engine.eos_token_ids)


def _byte_tokens(llm: LLM, data: bytes) -> list[int]:
    """Token ids spelling `data` one byte each (a byte-level BPE vocabulary holds every single byte)."""
    from batchgen.models.tokenizer import as_transformers

    # GPT-2's byte -> character map of byte-level BPE vocabularies
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = as_transformers(llm.tokenizer).get_vocab()
    return [vocab[chars[b]] for b in data]


@pytest.mark.parametrize("string", [{"type": "string", "maxLength": 12}, {"type": "string"}])
def test_json_strings_admit_only_valid_utf8(llm: LLM, string: dict) -> None:
    """xgrammar's own string rules accept a UTF-16 surrogate (ED BB 86) and overlong forms; ours do not."""
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
    compiled = _structured(llm).compile(SamplingParams(json_schema=schema))
    for bad in (b'{"s":"ab\xed\xbb\x86', b'{"s":"\xe0\x80\xaf'):
        assert not xgr.GrammarMatcher(compiled).accept_string(bad), bad
    for good in ('{"s":"ab\u00e9\u65e5"}'.encode(), '{"s":"\U0010ffff"}'.encode()):
        assert xgr.GrammarMatcher(compiled).accept_string(good), good
    if "maxLength" not in string:  # unbounded strings keep JSON escapes
        assert xgr.GrammarMatcher(compiled).accept_string(b'{"s":"a\\n\\"\\u00e9"}')


def test_output_bytes_that_are_not_utf8_are_not_satisfied(llm: LLM) -> None:
    """Whatever a constraint lets through (here a regex's '.'), invalid UTF-8 is never constraint_satisfied."""

    class Seq:  # what StructuredOutputs reads of a sequence
        def __init__(self, ids: list[int]) -> None:
            self.params = SamplingParams(regex="a.+")
            self.token_ids, self.num_prompt_tokens, self.stop_reason = [1, *ids], 1, None

    so = _structured(llm)
    assert so.satisfied(Seq(_byte_tokens(llm, "a\u00e9".encode()))) is True
    assert so.satisfied(Seq(_byte_tokens(llm, b"a\xed\xbb\x86"))) is False


def test_structured_outputs_on_cpu_never_import_triton(llama_ckpt: str) -> None:
    """The CPU install of the structured extra leaves Triton out (README): compiling, matching and masking on
    the CPU never import it."""
    import subprocess
    import sys

    code = f"""
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError("Triton is not installed")
sys.meta_path.insert(0, NoTriton())
import torch
from batchgen.engine.features.structured import StructuredOutputs
from batchgen.models.loader import load_tokenizer
from batchgen.sampling_params import SamplingParams
tok = load_tokenizer({llama_ckpt!r})
class Seq:
    params = SamplingParams(choice=["yes", "no"])
    token_ids, num_prompt_tokens, stop_reason = [1], 1, None
so = StructuredOutputs(tok, 512, [0])
logits = torch.zeros(1, 512)
so.mask([Seq()]).apply(logits)
allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
assert allowed and len(allowed) < 512, allowed
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
