"""OpenAI batch files of /v1/embeddings requests in a task=embed job: OpenAI's embeddings response shape,
list-of-one inputs, dimensions, base64 encoding; lines the task cannot serve are per-line errors."""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
from pathlib import Path

import pooling_zoo as zoo
import pytest
from conftest import batchgen_cli, job_config

from batchgen import LLM
from batchgen.job.run import EXIT_CONFIG, EXIT_OK, run_job

EMB = "/v1/embeddings"


def _req(cid: str, body: dict, url: str = EMB) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "emb-1", **body}})


def _job(ckpt: str, inp: Path, out: Path, task: str = "embed"):
    job = job_config(ckpt, inp, out, data={"window_rows": 2})
    return dataclasses.replace(job, task=task, run=dataclasses.replace(job.run, max_error_fraction=1.0))


def test_embeddings_batch_file_in_an_embed_job(tmp_path: Path) -> None:
    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=21)
    texts = ["a short query", "a longer passage about paged attention and caches", "x y z"]
    lines = [
        _req("a", {"input": texts[0], "dimensions": 16}),
        _req("chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
        _req("b", {"input": [texts[1]], "dimensions": 16, "encoding_format": "base64"}),
        _req("c", {"input": texts[2], "dimensions": 16, "encoding_format": "float"}),
        _req("d", {"input": texts[2], "dimensions": 8}),
        _req("e", {"input": ["x", "y"], "dimensions": 16}),
        _req("f", {"input": "x", "dimensions": 16, "encoding_format": "int8"}),
    ]
    inp = tmp_path / "requests.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"
    res = run_job(_job(path, inp, out), print_summary=False, handle_signals=False)
    assert res.exit_code == EXIT_OK, res.message
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert list(got) == ["a", "chat", "b", "c", "d", "e", "f"]
    want = LLM(path).embed(texts, dimensions=16, use_tqdm=False)
    for cid, w in zip("abc", want):
        body = got[cid]["response"]["body"]
        assert got[cid]["error"] is None and got[cid]["response"]["status_code"] == 200
        assert body["object"] == "list" and body["model"] == "emb-1"
        assert [d["object"] for d in body["data"]] == ["embedding"] and body["data"][0]["index"] == 0
        vec = body["data"][0]["embedding"]
        if cid == "b":
            vec = list(struct.unpack("<16f", base64.b64decode(vec)))
        assert vec == pytest.approx(w.outputs.embedding, abs=1e-5)
        n = len(w.prompt_token_ids)
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert "needs a job with task=generate" in got["chat"]["error"]["message"]
    assert "dimensions=8 differs" in got["d"]["error"]["message"]
    assert "list of one string" in got["e"]["error"]["message"]
    assert "encoding_format" in got["f"]["error"]["message"]
    openai_types = pytest.importorskip("openai.types", reason="the openai package is not installed")
    for cid in "ac":
        openai_types.CreateEmbeddingResponse.model_validate(got[cid]["response"]["body"])


def test_classify_jobs_refuse_batch_files(tmp_path: Path) -> None:
    inp = tmp_path / "requests.jsonl"
    inp.write_text(_req("a", {"input": "x"}) + "\n")
    res = run_job(
        _job("unused", inp, tmp_path / "r.jsonl", task="classify"), print_summary=False, handle_signals=False
    )
    assert res.exit_code == EXIT_CONFIG and "task=embed" in res.message


def test_documented_embed_command_writes_the_results_file(tmp_path: Path) -> None:
    """README's /v1/embeddings command as a subprocess: the results file is a file, not Hydra's log directory."""
    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=21)
    work = tmp_path / "work"
    work.mkdir()
    (work / "requests.jsonl").write_text(_req("a", {"input": "a short query"}) + "\n")
    p = batchgen_cli(
        ["task=embed", f"model.path={path}", "data.input=requests.jsonl", "data.output=results.jsonl"], work
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (line,) = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()]
    assert line["custom_id"] == "a" and line["error"] is None
    want = LLM(path).embed(["a short query"], use_tqdm=False)[0].outputs.embedding
    assert line["response"]["body"]["data"][0]["embedding"] == pytest.approx(want, abs=1e-5)
