"""``n`` per request in OpenAI batch files: one result line per request whose ``choices`` hold its n samples
(``choices[i].index == i``), the job's ``sampling.n`` for a request that gives none, exactly once after a
kill -9 and a rerun; Parquet jobs keep their layout (one output row per sample)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import batchgen_cli, cli_job, env_without_slurm, job_config, wait_for_rows_done

from batchgen.data.openai_batch import MAX_N, parse_requests
from batchgen.engine.sched.sequence import sample_seed
from batchgen.job.run import EXIT_OK, run_job

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _req(cid: str, body: dict, url: str = CHAT) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _chat(text: str, **body) -> dict:
    return {"messages": [{"role": "user", "content": text}], **body}


def test_parse_gives_one_row_per_sample_and_the_job_n_by_default() -> None:
    reqs = parse_requests(
        [
            _req("a", _chat("hi")),
            _req("b", _chat("hi", n=3, seed=11, temperature=0.7)),
            _req("c", _chat("hi", n=0)),
            _req("d", _chat("hi", n=MAX_N + 1)),
        ],
        n=2,
    )
    rows = reqs.table.to_pylist()
    assert [(r["custom_id"], r["n"], r["sample_index"]) for r in rows] == [
        ("a", 2, 0), ("a", 2, 1), ("b", 3, 0), ("b", 3, 1), ("b", 3, 2), ("c", 1, 0), ("d", 1, 0),
    ]  # fmt: skip
    seeds = [json.loads(r["sampling"])["seed"] for r in rows[2:5]]
    assert seeds == [11, sample_seed(11, 1), sample_seed(11, 2)]  # the engine's seeds of an n=3 request
    assert "body.n must be an integer >= 1" in rows[5]["request_error"]
    assert f"at most {MAX_N}" in rows[6]["request_error"]


def _results(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _choices(line: dict) -> list[str]:
    body = line["response"]["body"]
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c.get("text", (c.get("message") or {}).get("content")) for c in body["choices"]]


def test_cli_n_per_request_and_the_job_default(llama_ckpt: str, tmp_path: Path) -> None:
    """sampling.n=2 for requests without n; n=3 and n=1 requests beside them; a completions file too."""
    lines = [
        _req("default", _chat("Name a colour.", temperature=1.0)),
        _req("three", _chat("Name a fruit.", n=3, temperature=1.0, seed=5)),
        _req("one", _chat("Name a city.", n=1, temperature=0)),
        _req("bad", _chat("Name a city.", n=-1)),
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    comp = [_req("c2", {"prompt": "One two", "n": 2, "temperature": 1.0}, COMPLETIONS),
            _req("c1", {"prompt": "Three four", "temperature": 0}, COMPLETIONS)]  # fmt: skip
    (tmp_path / "comp.jsonl").write_text("\n".join(comp) + "\n")
    common = [f"model.path={llama_ckpt}", "sampling.max_tokens=6", "sampling.n=2", "engine.num_blocks=64",
              "run.max_error_fraction=1", "run.progress=off"]  # fmt: skip
    p = batchgen_cli([*common, "data.input=chat.jsonl", "data.output=chat_out.jsonl"], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = _results(tmp_path / "chat_out.jsonl")
    assert [x["custom_id"] for x in got] == ["default", "three", "one", "bad"]
    assert [len(_choices(x)) for x in got[:3]] == [2, 3, 1] and got[3]["error"]["code"] == "invalid_request"
    assert len(set(_choices(got[1]))) > 1  # sampled with per-sample seeds, not one sample three times
    usage = got[1]["response"]["body"]["usage"]
    assert 3 <= usage["completion_tokens"] <= 3 * 6  # the three samples' tokens
    # the completions file: the same job in process (the command itself ran above)
    comp_job = cli_job(
        [*common, f"data.input={tmp_path / 'comp.jsonl'}", f"data.output={tmp_path / 'comp_out.jsonl'}"]
    )
    res = run_job(comp_job, handle_signals=False, print_summary=False)
    assert res.exit_code == 0, res.message
    assert [len(_choices(x)) for x in _results(tmp_path / "comp_out.jsonl")] == [2, 2]


@pytest.mark.slow
def test_cli_n_per_request_killed_and_rerun_is_exactly_once(llama_ckpt: str, tmp_path: Path) -> None:
    """kill -9 mid-job, then the same command: the results file equals an uninterrupted run's (ids and
    choices; ``created`` is the writing time)."""
    lines = [_req(f"r{i}", _chat(f"Item {i}: describe it", n=1 + i % 3, max_tokens=12, temperature=0.9,
                                 seed=i)) for i in range(12)]  # fmt: skip
    (tmp_path / "req.jsonl").write_text("\n".join(lines) + "\n")
    args = [f"model.path={llama_ckpt}", "data.input=req.jsonl", "data.window_rows=2", "engine.num_blocks=64",
            "engine.max_num_seqs=2", "run.progress=off", "run.checkpoint_interval_s=0"]  # fmt: skip
    # the uninterrupted run: the same job in process
    ref_args = [a.replace("data.input=", f"data.input={tmp_path}/") for a in args]
    res = run_job(cli_job([*ref_args, f"data.output={tmp_path / 'ref.jsonl'}"]), handle_signals=False,
                  print_summary=False)  # fmt: skip
    assert res.exit_code == 0, res.message
    cmd = [sys.executable, "-m", "batchgen.cli", *args, "data.output=res.jsonl"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_without_slurm(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        done = wait_for_rows_done(proc, tmp_path / "_res.jsonl.batchgen" / "out", 4)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert 4 <= done < 24, done  # killed mid-run (24 sample rows)
    assert not (tmp_path / "res.jsonl").exists()
    p = batchgen_cli([*args, "data.output=res.jsonl"], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

    def strip(rows: list[dict]) -> list[dict]:
        for r in rows:
            r["response"]["body"].pop("created")
        return rows

    ref, res = strip(_results(tmp_path / "ref.jsonl")), strip(_results(tmp_path / "res.jsonl"))
    assert res == ref
    assert [len(_choices(x)) for x in res] == [1 + i % 3 for i in range(12)]


def test_parquet_job_with_n_keeps_one_output_row_per_sample(llama_ckpt: str, tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a b c", "d e f", "g h i"]}), tmp_path / "in.parquet")
    cfg = job_config(llama_ckpt, tmp_path / "in.parquet", tmp_path / "out", sampling={"n": 2})
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    t = pq.read_table(tmp_path / "out")
    assert t.column("id").to_pylist() == [0, 0, 1, 1, 2, 2]
    assert t.column("sample_index").to_pylist() == [0, 1] * 3
