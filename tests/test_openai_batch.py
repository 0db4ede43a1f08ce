"""OpenAI Batch API files in and out: requests.jsonl → results.jsonl, validated with the openai package's types."""

# ruff: noqa: F811 - the s3 fixture is imported from s3_server and used as an argument

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import batchgen_cli, job_config, signal_after
from s3_server import S3, s3, s3_endpoint  # noqa: F401 - fixtures

from batchgen import LLM, SamplingParams
from batchgen.data.openai_batch import parse_requests
from batchgen.job.run import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_TOO_MANY_ERRORS, run_job

CHAT = "/v1/chat/completions"


def _req(cid: str, body: dict, url: str = CHAT) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m-1", **body}})


def _chat_file(path: Path) -> Path:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    lines = [
        _req("greedy", {"messages": msgs, "max_tokens": 5, "temperature": 0}),
        _req(
            "lp",
            {"messages": msgs, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2, "seed": 7},
        ),
        "this is { not json",
        _req("json", {"messages": msgs, "max_tokens": 12, "response_format": {"type": "json_object"}}),
        _req("emb", {"input": "x"}, url="/v1/embeddings"),
        _req("tools", {"messages": msgs, "tools": [{"type": "function"}]}),
        _req("greedy", {"messages": msgs}),
        _req(
            "stop", {"messages": [{"role": "user", "content": "Count: one two"}], "stop": "x", "top_p": 0.9}
        ),
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(cfg, **kw):
    return run_job(cfg, handle_signals=kw.pop("handle_signals", False), print_summary=False, **kw)


def _config(ckpt: str, inp: Path, out: Path, **data):
    cfg = job_config(ckpt, inp, out, data={"window_rows": 2, **data}, sampling={"max_tokens": 6})
    cfg.run.max_error_fraction = 1.0
    return cfg


def test_parse_requests_maps_parameters_and_errors() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    reqs = parse_requests(
        [
            _req("a", {"messages": msgs, "max_completion_tokens": 3, "stop": "\n", "seed": 1, "temperature": 0.5,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
            _req("b", {"messages": msgs, "n": 2}),
            _req("c", {"prompt": "x"}, url="/v1/completions"),
            _req("d", {"messages": msgs, "max_tokens": -1}),
        ]
    )  # fmt: skip
    rows = reqs.table.to_pylist()
    assert reqs.endpoint == CHAT
    assert [(r["custom_id"], r["n"], r["sample_index"]) for r in rows] == [
        ("a", 1, 0), ("b", 2, 0), ("b", 2, 1), ("c", 1, 0), ("d", 1, 0),
    ]  # fmt: skip
    rows.pop(2)
    assert json.loads(rows[0]["sampling"]) == {
        "max_tokens": 3, "stop": ["\n"], "seed": 1, "temperature": 0.5, "json_schema": {"type": "object"},
    }  # fmt: skip
    assert rows[1]["request_error"] is None
    assert "differs from the file's /v1/chat/completions" in rows[2]["request_error"]
    assert "max_tokens must be an integer >= 1" in rows[3]["request_error"]


def test_chat_batch_file_runs_and_validates(llama_ckpt: str, tmp_path: Path) -> None:
    openai_types = pytest.importorskip(
        "openai.types", reason="the openai package is not installed (test extra)"
    )
    from openai.types.chat import ChatCompletion

    inp = _chat_file(tmp_path / "requests.jsonl")
    out = tmp_path / "results" / "results.jsonl"
    res = _run(_config(llama_ckpt, inp, out))
    assert res.exit_code == EXIT_OK, res.message
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["greedy", "lp", None, "json", "emb", "tools", "greedy", "stop"]
    by = {i: x for i, x in enumerate(lines)}
    for x in lines:
        assert set(x) == {"id", "custom_id", "response", "error"} and x["id"].startswith("batch_req_")
        if x["error"] is None:
            assert x["response"]["status_code"] == 200 and x["response"]["request_id"].startswith("req_")
            body = ChatCompletion.model_validate(x["response"]["body"])
            assert body.object == "chat.completion" and body.model == "m-1"
            assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
        else:
            openai_types.BatchError.model_validate(x["error"])
            assert x["response"] is None
    assert "line 3" in by[2]["error"]["message"] and "not valid JSON" in by[2]["error"]["message"]
    assert "/v1/embeddings needs a job with task=embed" in by[4]["error"]["message"]
    assert "unsupported parameter 'tools'" in by[5]["error"]["message"]
    assert "duplicate custom_id" in by[6]["error"]["message"]
    # greedy request: the chat template's tokens, generated like batchgen.LLM does
    llm = LLM(llama_ckpt, device="cpu", num_blocks=256)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ref = llm.chat([msgs], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    greedy = by[0]["response"]["body"]
    assert greedy["choices"][0]["message"]["content"] == ref.outputs[0].text
    assert greedy["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert greedy["choices"][0]["finish_reason"] in ("stop", "length")
    # logprobs: one entry per generated token, 2 alternatives each
    lp = by[1]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(lp) == by[1]["response"]["body"]["usage"]["completion_tokens"] and len(lp) <= 4
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in lp)
    assert by[0]["response"]["body"]["choices"][0]["logprobs"] is None
    # json_object: the text is a JSON object unless max_tokens cut it
    js = by[3]["response"]["body"]["choices"][0]
    if js["finish_reason"] == "stop":
        assert isinstance(json.loads(js["message"]["content"]), dict)
    # rerun: nothing to do, the same lines (ids included, except `created`)
    again = tmp_path / "results" / "results.jsonl"
    assert _run(_config(llama_ckpt, inp, out)).exit_code == EXIT_OK

    def strip(x):
        if x["response"]:
            x["response"]["body"].pop("created")
        return x

    assert [strip(json.loads(x)) for x in again.read_text().splitlines()] == [strip(x) for x in lines]
    assert not list(tmp_path.glob("results/*.parquet"))  # bookkeeping under _results.jsonl.batchgen/
    assert (tmp_path / "results" / "_results.jsonl.batchgen" / "out" / "_manifest.json").is_file()


def test_completions_file_resumes_after_a_stop(llama_ckpt: str, tmp_path: Path) -> None:
    openai_types = pytest.importorskip(
        "openai.types", reason="the openai package is not installed (test extra)"
    )
    from batchgen.engine.core.llm_engine import LLMEngine

    prompts = [f"Item {i}: the quick brown fox" for i in range(6)]
    lines = [
        _req(f"r{i}", {"prompt": p, "max_tokens": 4, "temperature": 0, "logprobs": 1}, url="/v1/completions")
        for i, p in enumerate(prompts)
    ]
    inp = tmp_path / "req.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "res.jsonl"
    cfg = _config(llama_ckpt, inp, out)
    cfg.run.checkpoint_interval_s = 0
    res = _run(cfg, engine=signal_after(LLMEngine(llama_ckpt, cfg.engine), at=3), handle_signals=True)
    assert res.exit_code == EXIT_INTERRUPTED
    assert not out.exists()  # no results file until the job is complete
    res = _run(cfg)
    assert res.exit_code == EXIT_OK, res.message
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in got] == [f"r{i}" for i in range(6)]
    for x in got:
        body = openai_types.Completion.model_validate(x["response"]["body"])
        assert body.object == "text_completion" and len(body.choices) == 1
        lp = body.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == body.usage.completion_tokens
    # the same text as an ordinary Parquet job over the same prompts (greedy)
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "p.parquet")
    ref = job_config(
        llama_ckpt, tmp_path / "p.parquet", tmp_path / "ref", sampling={"max_tokens": 4, "temperature": 0}
    )
    assert _run(ref).exit_code == EXIT_OK
    texts = pq.read_table(tmp_path / "ref").column("generated_text").to_pylist()
    assert [x["response"]["body"]["choices"][0]["text"] for x in got] == texts


def test_a_rerun_removes_the_temporary_file_of_a_killed_staging(llama_ckpt: str, tmp_path: Path) -> None:
    """A kill -9 while the request file was staged as requests.parquet left its temporary file in the
    bookkeeping directory: the rerun removes it (as it does the results file's)."""
    lines = [_req(f"r{i}", {"prompt": f"Item {i}", "max_tokens": 2}, url="/v1/completions") for i in range(3)]
    inp = tmp_path / "req.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    book = tmp_path / "_res.jsonl.batchgen"
    book.mkdir()
    (book / ".tmp-requests.parquet.k9x2ab3c").write_bytes(b"PAR1 half written")
    res = _run(_config(llama_ckpt, inp, tmp_path / "res.jsonl"))
    assert res.exit_code == EXIT_OK, res.message
    assert len((tmp_path / "res.jsonl").read_text().splitlines()) == 3
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_documented_command_writes_the_results_file(llama_ckpt: str, tmp_path: Path) -> None:
    """docs/openai-batch.md's command, typed in a fresh directory: the results file is a file (Hydra's run
    files go into the bookkeeping directory beside it), the summary counts the error lines by their own
    reasons, and the rerun finds nothing to do."""
    _chat_file(tmp_path / "requests.jsonl")
    cmd = [f"model.path={llama_ckpt}", "data.input=requests.jsonl", "data.output=results.jsonl"]
    cmd += ["sampling.max_tokens=3", "engine.num_blocks=64", "run.max_error_fraction=1", "run.progress=off"]
    p = batchgen_cli(cmd, tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    reasons = [x["error"]["message"] for x in lines if x["error"]]
    assert len(lines) == 8 and len(reasons) == 4
    assert "8 result line(s) in results.jsonl, 4 with an error" in p.stdout
    top = re.findall(r"^(?:top errors)? +(\d+) x (.*)$", p.stdout, re.MULTILINE)
    assert len(top) == 3 and all(n == "1" and r in reasons for n, r in top), p.stdout
    assert "is null" not in p.stdout
    p = batchgen_cli(cmd, tmp_path)
    assert p.returncode == 0 and "nothing to do" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()][4] == lines[4]
    names = sorted(x.name for x in tmp_path.iterdir())
    assert names == ["_results.jsonl.batchgen", "requests.jsonl", "results.jsonl"]
    assert list((tmp_path / "_results.jsonl.batchgen" / "_logs").glob("*/.hydra/config.yaml"))


def test_dry_run_plans_the_requests_then_the_job_runs(llama_ckpt: str, tmp_path: Path) -> None:
    inp = _chat_file(tmp_path / "requests.jsonl")
    out = tmp_path / "results.jsonl"
    cfg = _config(llama_ckpt, inp, out)
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    res = _run(cfg)
    assert (res.exit_code, res.status) == (EXIT_OK, "planned"), res.message
    assert not out.exists()  # no results file, no parts, no manifest
    book = tmp_path / "_results.jsonl.batchgen" / "out"
    assert sorted(p.name for p in book.iterdir()) == ["_plan.json"]
    plan = json.loads((book / "_plan.json").read_text())
    assert plan["rows"] == {"total": 8, "sampled": 8, "valid": 4, "error": 4}
    # each request that cannot run under its error line's reason, named by its custom_id or line
    ids = {e["example"]: e["first_ids"] for e in plan["errors"].values()}
    assert ids == {
        "line 3: not valid JSON (Expecting value at column 1)": ["line 3"],
        "endpoint /v1/embeddings needs a job with task=embed; this job has task=generate": ["emb"],
        "unsupported parameter 'tools'": ["tools"],
        "duplicate custom_id 'greedy' (line 7)": ["greedy"],
    }
    assert plan["output_tokens"]["bound"] == 5 + 4 + 12 + 6  # each request's max_tokens, else the job's
    cfg.run.dry_run = False
    res = _run(cfg)
    assert res.exit_code == EXIT_OK, res.message
    report = json.loads((book / "_report.json").read_text())
    assert report["prediction"]["prompt_tokens"]["predicted"] == report["tokens"]["prompt_admitted"]


def test_the_plan_names_where_requests_differ_in_the_files_words(llama_ckpt: str, tmp_path: Path) -> None:
    """The sharing notes name the requests' messages, not a data.messages_column the user never set."""
    system = "You answer questions about the solar system in one short sentence, citing no sources at all."
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "system", "content": f"{system} Ticket {i}."},
                                                             {"role": "user", "content": "Why is Mars red?"}]}})
             for i in range(4)]  # fmt: skip
    inp = tmp_path / "requests.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    cfg = _config(llama_ckpt, inp, tmp_path / "results.jsonl")
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert _run(cfg).exit_code == EXIT_OK
    plan = json.loads((tmp_path / "_results.jsonl.batchgen" / "out" / "_plan.json").read_text())
    notes = json.dumps(plan["sharing"])
    assert "the requests' body.messages" in notes and "data.messages_column" not in notes


def test_batch_file_needs_a_jsonl_output(llama_ckpt: str, tmp_path: Path) -> None:
    inp = tmp_path / "r.jsonl"
    inp.write_text(_req("a", {"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    res = _run(_config(llama_ckpt, inp, tmp_path / "outdir"))
    assert res.exit_code == EXIT_CONFIG and "data.output must name the results file" in res.message


def test_every_request_failing_still_writes_error_lines(llama_ckpt: str, tmp_path: Path) -> None:
    """Failed requests are result lines: a file of only failing requests gets its results file, and the job
    fails (exit 3) because the error fraction exceeds run.max_error_fraction."""
    inp = tmp_path / "r.jsonl"
    inp.write_text(
        "\n".join(
            [
                "{oops",
                _req("e1", {"input": "x"}, url="/v1/embeddings"),
                _req("e2", {"input": "y"}, url="/v1/embeddings"),
            ]
        )
    )
    out = tmp_path / "res.jsonl"
    cfg = job_config(llama_ckpt, inp, out, sampling={"max_tokens": 3})
    res = _run(cfg)
    assert res.exit_code == EXIT_TOO_MANY_ERRORS and "3 with an error" in res.message
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in got] == [None, "e1", "e2"] and all(x["error"] for x in got)
    assert "line 1" in got[0]["error"]["message"]


def test_request_and_results_files_on_s3(llama_ckpt: str, s3: S3) -> None:
    openai_types = pytest.importorskip(
        "openai.types", reason="the openai package is not installed (test extra)"
    )
    lines = [
        _req(f"c{i}", {"prompt": f"hello {i}", "max_tokens": 3}, url="/v1/completions") for i in range(3)
    ]
    s3.client.put_object(Bucket=s3.bucket, Key="req/requests.jsonl", Body="\n".join(lines).encode())
    cfg = _config(llama_ckpt, s3.url("req/requests.jsonl"), s3.url("res/results.jsonl"))
    res = _run(cfg)
    assert res.exit_code == EXIT_OK, res.message
    got = [json.loads(x) for x in s3.get("res/results.jsonl").decode().splitlines()]
    assert [x["custom_id"] for x in got] == ["c0", "c1", "c2"]
    for x in got:
        openai_types.Completion.model_validate(x["response"]["body"])
    assert "res/_results.jsonl.batchgen/out/_manifest.json" in s3.keys("res/")
