"""A multi-adapter job: each row under the adapter its column names (null: the base model), greedy tokens identical
to PEFT's; unknown names and unreadable adapters make error rows, not a failed job; the report counts rows per
adapter; the config refuses a LoRA column without adapters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config, read_parts
from lora_helpers import adapter, peft_greedy

from batchgen.errors import ConfigError
from batchgen.job.config import validate
from batchgen.job.feeder import WindowWork
from batchgen.job.run import EXIT_OK, run_job
from batchgen.models import load_tokenizer

TEXTS = [
    "def parse(",
    "import os",
    "class Foo:",
    "def parse(x",
    "return None",
    "for i in",
    "while True:",
    "x = 1",
]
ADAPTERS = ["a", None, "b", "a", "nope", "b", "broken", None]


@pytest.fixture(scope="module")
def adapters(llama_ckpt, tmp_path_factory):
    a = adapter(llama_ckpt, 4, ("q_proj", "v_proj"), 8, 1)
    b = adapter(llama_ckpt, 8, ("o_proj", "gate_proj", "down_proj"), 8, 3)
    return {"a": a, "b": b, "broken": str(tmp_path_factory.mktemp("job") / "missing")}


def _adapter_job(ckpt: str, adapters: dict, tmp_path: Path, window_rows: int, max_tokens: int, **engine):
    """A job over TEXTS, each row under ADAPTERS' name (2 of 8 rows fail on purpose)."""
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": TEXTS, "adapter": pa.array(ADAPTERS, pa.string())}), inp)
    cfg = job_config(
        ckpt, inp, tmp_path / "out", data={"lora_column": "adapter", "window_rows": window_rows},
        sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}, engine=engine,
    )  # fmt: skip
    cfg.model = dataclasses.replace(cfg.model, lora_modules=adapters)
    cfg.run = dataclasses.replace(cfg.run, max_error_fraction=1.0)
    return cfg


def _rows_equal_peft(ckpt: str, adapters: dict, out_dir: Path, max_tokens: int) -> None:
    """Every row of the output equals PEFT's greedy tokens under its adapter; unknown and unreadable adapters
    are error rows saying so."""
    tok = load_tokenizer(ckpt)
    for row, text, name in zip(read_parts(out_dir).to_pylist(), TEXTS, ADAPTERS):
        if name in ("nope", "broken"):
            assert row["status"] == "error"
            assert ("unknown LoRA adapter 'nope'" if name == "nope" else "not a directory") in row["error"]
            continue
        assert row["status"] == "ok", row["error"]
        want = peft_greedy(ckpt, adapters.get(name), tok.encode(text), max_tokens)
        assert row["token_ids"] == want, (text, name)


def test_job_rows_follow_their_adapter(llama_ckpt, adapters, tmp_path: Path):
    cfg = _adapter_job(llama_ckpt, adapters, tmp_path, window_rows=8, max_tokens=8)
    # the dry run first: an unknown adapter and one that cannot be read are error rows there too
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert sorted(e["first_ids"][0] for e in plan["errors"].values()) == [4, 6]
    assert any("not a directory" in e["example"] for e in plan["errors"].values())
    cfg.run.dry_run = False
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK
    hit = res.report["prediction"]["prefix_hit_rate"]
    assert hit["predicted"] == pytest.approx(hit["actual"], abs=0.05)
    _rows_equal_peft(llama_ckpt, adapters, tmp_path / "out", 8)
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    assert report["lora"]["rows_this_run"] == {
        "a": {"ok": 2, "error": 0}, "b": {"ok": 2, "error": 0}, "base model": {"ok": 2, "error": 0},
        "nope": {"ok": 0, "error": 1}, "broken": {"ok": 0, "error": 1},
    }  # fmt: skip


def test_job_over_two_replicas_rows_follow_their_adapter(llama_ckpt, adapters, tmp_path: Path):
    """engine.data_parallel_size=2: each replica serves the adapters; every row equals PEFT under its own
    adapter, and the per-adapter counts cover both replicas (invalid rows included)."""
    cfg = _adapter_job(llama_ckpt, adapters, tmp_path, window_rows=2, max_tokens=6, data_parallel_size=2)
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    assert sorted(r["replica"] for r in res.report["replicas"]) == [0, 1]
    _rows_equal_peft(llama_ckpt, adapters, tmp_path / "out", 6)
    assert res.report["lora"]["rows_this_run"]["nope"] == {"ok": 0, "error": 1}
    assert res.report["lora"]["rows_this_run"]["a"] == {"ok": 2, "error": 0}


def test_windows_group_rows_by_adapter_then_prefix():
    from batchgen.data.prompts import PromptRow
    from batchgen.data.reader import WindowSpec
    from batchgen.lora_request import LoRARequest

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    loras = [b, None, a, b, None, a]
    toks = [[3, 1], [5], [9], [1, 2], [2], [4]]
    rows = [PromptRow(i, i, i, token_ids=t, lora=lo) for i, (t, lo) in enumerate(zip(toks, loras))]
    work = WindowWork.create(WindowSpec(0, 0, 6), rows, group_by_prefix=True)
    assert list(work.feed) == [4, 1, 5, 2, 3, 0]  # base, then adapter 1, then 2; token order within each


def test_lora_column_needs_modules(llama_ckpt, tmp_path):
    cfg = job_config(llama_ckpt, tmp_path / "in.parquet", tmp_path / "out", data={"lora_column": "adapter"})
    with pytest.raises(ConfigError, match="model.lora_modules is empty"):
        validate(cfg)


def test_cli_assigns_lora_modules():
    from batchgen.cli import assign_lora_modules

    args = ["model.lora_modules={a: /x}", "model.lora_modules.b=/y", "+model.lora_modules.c=/z", "data.x=1"]
    assert assign_lora_modules(args) == [
        "+model.lora_modules={a: /x}", "+model.lora_modules.b=/y", "+model.lora_modules.c=/z", "data.x=1",
    ]  # fmt: skip


def test_score_job_scores_each_row_under_its_adapter(llama_ckpt, adapters, tmp_path: Path):
    """task=score with data.lora_column: each row's log-likelihood is PEFT's under the row's adapter (null: the
    base model); unknown and unreadable adapters make error rows; the report counts rows per adapter."""
    import torch
    from lora_helpers import peft_logits

    from batchgen.scoring import split_pair

    ctx = "def parse(x, y):"
    conts = [" return x", " return x", " pass", " return x", " pass", " return y", " pass", " x = 1"]
    inp = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"ctx": [ctx] * 8, "cont": conts, "adapter": pa.array(ADAPTERS, pa.string())}), inp
    )
    cfg = job_config(llama_ckpt, inp, tmp_path / "out", data={"window_rows": 8})
    cfg = dataclasses.replace(
        cfg,
        task="score",
        data=dataclasses.replace(
            cfg.data, prompt_column="ctx", continuation_column="cont", lora_column="adapter"
        ),
        model=dataclasses.replace(cfg.model, lora_modules=adapters),
        run=dataclasses.replace(cfg.run, max_error_fraction=1.0),  # 2 of 8 rows fail on purpose
    )
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    out = read_parts(tmp_path / "out").to_pylist()
    tok = load_tokenizer(llama_ckpt)
    lls = {}
    for row, cont, name in zip(out, conts, ADAPTERS):
        if name in ("nope", "broken"):
            assert row["status"] == "error" and row["loglikelihood"] is None
            assert ("unknown LoRA adapter 'nope'" if name == "nope" else "not a directory") in row["error"]
            continue
        assert row["status"] == "ok", row["error"]
        c, x = split_pair(tok, ctx, cont)
        logp = torch.log_softmax(peft_logits(llama_ckpt, adapters.get(name), c + x).double(), dim=-1)
        want = sum(float(logp[len(c) + j - 1, t]) for j, t in enumerate(x))
        assert row["loglikelihood"] == pytest.approx(want, abs=1e-4), (cont, name)
        lls[(cont, name)] = row["loglikelihood"]
    assert abs(lls[(" return x", "a")] - lls[(" return x", None)]) > 1e-3  # the adapter changes the score
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    assert report["lora"]["rows_this_run"] == {
        "a": {"ok": 2, "error": 0}, "b": {"ok": 2, "error": 0}, "base model": {"ok": 2, "error": 0},
        "nope": {"ok": 0, "error": 1}, "broken": {"ok": 0, "error": 1},
    }  # fmt: skip


def test_report_counts_rows_per_adapter_across_resumed_runs(llama_ckpt, adapters, tmp_path: Path):
    """A run stopped part-way and its resume: the last report's ``lora.rows`` counts every committed row of both
    runs by adapter (``rows_this_run`` only the resume's); the summary shows the totals."""
    from conftest import signal_after

    from batchgen.engine.core.llm_engine import LLMEngine
    from batchgen.job.report import format_table
    from batchgen.job.run import EXIT_INTERRUPTED

    cfg = _adapter_job(llama_ckpt, adapters, tmp_path, window_rows=2, max_tokens=8, max_num_seqs=2)
    engine_cfg = dataclasses.replace(cfg.engine, enable_lora=True)
    engine = signal_after(LLMEngine(llama_ckpt, engine_cfg), at=12)
    first = run_job(cfg, engine=engine, print_summary=False)
    assert first.exit_code == EXIT_INTERRUPTED, first.message
    second = run_job(cfg, handle_signals=False, print_summary=False)
    assert second.exit_code == EXIT_OK, second.message
    lora = second.report["lora"]
    assert lora["rows"] == {
        "a": {"ok": 2, "error": 0}, "b": {"ok": 2, "error": 0}, "base model": {"ok": 2, "error": 0},
        "nope": {"ok": 0, "error": 1}, "broken": {"ok": 0, "error": 1},
    }  # fmt: skip
    assert 0 < sum(c["ok"] + c["error"] for c in lora["rows_this_run"].values()) < len(TEXTS)
    assert "a 2, b 2, base model 2, broken 0 (+1 errors), nope 0 (+1 errors)" in format_table(second.report)
