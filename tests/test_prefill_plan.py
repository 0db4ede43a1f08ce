"""The dry run of the prompt-only jobs, pooling (task=embed / task=classify) and scoring (task=score): rows and
error rows as the job makes them, prompt tokens, the prefix hit rate on the paged engine, a calibrated wall time,
and the report's prediction after the job runs."""

from __future__ import annotations

import dataclasses
import json
import random

import pooling_zoo as zoo
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config

from batchgen.job.config import PlanOptions, PoolingOptions
from batchgen.job.run import run_job

INSTRUCTION = (
    "Instruct: find the passages that answer the question, a long instruction every row shares. Query: "
)


def _texts(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    words = "alpha beta gamma delta passage query token".split()
    rows: list = [
        INSTRUCTION + " ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(n)
    ]
    rows[3], rows[8] = "", None  # error rows: not a non-empty string
    rows[5] = " ".join(["alpha"] * 600)  # error row: longer than the model takes
    return rows


def _job(ckpt, tmp_path, task, dry_run, data=None, **plan):  # noqa: ANN001
    data = {"window_rows": 16, "id_column": "key", **(data or {})}
    job = job_config(ckpt, tmp_path / "in.parquet", tmp_path / "out", data=data)
    return dataclasses.replace(
        job,
        task=task,
        pooling=PoolingOptions(),
        plan=PlanOptions(**plan),
        run=dataclasses.replace(job.run, dry_run=dry_run, max_error_fraction=1.0),
    )


def _plan_then_job(
    ckpt, tmp_path, task="embed", table=None, data=None, **plan
) -> tuple[dict, dict, pa.Table]:  # noqa: ANN001
    if table is None:
        texts = _texts(60)
        table = pa.table({"key": [f"k{i}" for i in range(len(texts))], "prompt": texts})
    pq.write_table(table, tmp_path / "in.parquet")
    res = run_job(_job(ckpt, tmp_path, task, True, data, **plan), print_summary=False, handle_signals=False)
    assert res.exit_code == 0, res.message
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["_plan.json"]  # nothing but the plan written
    planned = json.loads((tmp_path / "out" / "_plan.json").read_text())
    res = run_job(_job(ckpt, tmp_path, task, False, data, **plan), print_summary=False, handle_signals=False)
    assert res.exit_code == 0, res.message
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    out = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out").glob("part-*.parquet"))])
    return planned, report, out


def _check_rows_and_tokens(planned: dict, report: dict, out: pa.Table) -> None:
    rows = out.to_pydict()
    bad = [k for k, s in zip(rows["id"], rows["status"]) if s == "error"]
    assert planned["task"] in ("embed", "classify")
    assert planned["rows"] == {"total": 60, "sampled": 60, "valid": 57, "error": 3}
    assert (
        sorted(i for e in planned["errors"].values() for i in e["first_ids"])
        == sorted(bad)
        == ["k3", "k5", "k8"]
    )
    pooled = sum(n for n, s in zip(rows["num_prompt_tokens"], rows["status"]) if s == "ok")
    assert report["pooling"]["prompt_tokens"] == pooled == planned["predicted"]["prompt_tokens"]
    pred = report["prediction"]
    assert pred["prompt_tokens"] == {"predicted": pooled, "actual": pooled}
    w = pred["wall_time_s"]
    assert 0 < w["range"][0] < w["predicted"] < w["range"][1] and w["actual"] > 0
    # the threads each computed with (the engine's policy follows the machine's other load)
    load = pred["load"]
    assert load["threads_plan"] >= 1 and load["threads_run"] >= 1
    cal = planned["calibration"]
    assert cal["rows"] > 0 and cal["chunks"] >= 2 and sum(cal["seconds_per"].values()) > 0


def test_embed_dry_run_on_an_encoder_then_the_job(tmp_path):
    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=11)
    planned, report, out = _plan_then_job(path, tmp_path)
    _check_rows_and_tokens(planned, report, out)
    # an encoder computes every token: no prefix cache
    assert planned["predicted"]["prefix_hit_rate"] == 0.0
    assert (
        report["prediction"]["prompt_tokens_computed"]["actual"]
        == planned["predicted"]["prompt_tokens_to_compute"]
    )


def test_classify_dry_run_on_a_decoder_predicts_its_prefix_hit_rate(tmp_path):
    labels = {"id2label": zoo.LABELS3, "label2id": {v: k for k, v in zoo.LABELS3.items()}}
    path = zoo.decoder(tmp_path / "cls", "qwen3", "Qwen3ForSequenceClassification", seed=5, **labels)
    planned, report, out = _plan_then_job(path, tmp_path, task="classify")
    _check_rows_and_tokens(planned, report, out)
    # the decoder pools in token order on the paged engine: the shared instruction's blocks are reused
    hit = report["prediction"]["prefix_hit_rate"]
    assert hit["predicted"] > 0.3 and hit["difference"] == pytest.approx(0.0, abs=0.05)
    computed = report["prediction"]["prompt_tokens_computed"]
    assert computed["predicted"] == pytest.approx(computed["actual"], rel=0.05)


def test_pooling_dry_run_without_calibration(tmp_path):
    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=11)
    pq.write_table(
        pa.table({"key": ["a", "b"], "prompt": ["one text", "another text"]}), tmp_path / "in.parquet"
    )
    res = run_job(
        _job(path, tmp_path, "embed", True, calibrate=False), print_summary=False, handle_signals=False
    )
    assert res.exit_code == 0, res.message
    planned = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert planned["predicted"]["wall_time_s"] is None and "calibration" not in planned
    assert planned["rows"]["valid"] == 2 and planned["predicted"]["prompt_tokens"] > 0


def test_a_pooling_dry_run_on_a_started_output_plans_what_is_left(tmp_path, monkeypatch):
    from batchgen.data.output_dir import OutputDir

    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=11)
    texts = _texts(40)
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(40)], "prompt": texts}), tmp_path / "in.parquet")
    real_commit = OutputDir.commit

    def dying_commit(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        real_commit(self, *a, **kw)
        raise RuntimeError("simulated crash after the first window's commit")

    monkeypatch.setattr(OutputDir, "commit", dying_commit)
    job = _job(path, tmp_path, "embed", False)
    assert run_job(job, print_summary=False, handle_signals=False).exit_code == 1
    monkeypatch.setattr(OutputDir, "commit", real_commit)
    job = _job(path, tmp_path, "embed", True, calibrate=False)
    assert run_job(job, print_summary=False, handle_signals=False).exit_code == 0
    planned = json.loads((tmp_path / "out" / "_plan.json").read_text())
    assert planned["resume"]["windows_done"] == 1 and planned["resume"]["rows_done"] == 16
    # rows 16..39 are left; the error rows 3, 5 and 8 were in the window done
    assert planned["rows"] == {"total": 24, "sampled": 24, "valid": 24, "error": 0}


@pytest.mark.parametrize("rolling", [False, True], ids=["continuations", "rolling"])
def test_score_dry_run_then_the_job(llama_ckpt, tmp_path, rolling):
    rng = random.Random(3)
    contexts = [INSTRUCTION + f"case {i % 6}." for i in range(40)]
    conts: list = [
        " " + " ".join(rng.choice(["yes", "no", "maybe so"]) for _ in range(rng.randint(1, 6)))
        for _ in contexts
    ]
    contexts[2], conts[9] = None, ""  # error rows
    table = pa.table({"key": [f"k{i}" for i in range(40)], "ctx": contexts, "cont": conts})
    data = {"prompt_column": "ctx", "continuation_column": None if rolling else "cont"}
    planned, report, out = _plan_then_job(llama_ckpt, tmp_path, "score", table, data)
    rows = out.to_pydict()
    bad = sorted(k for k, s in zip(rows["id"], rows["status"]) if s == "error")
    assert bad == (["k2"] if rolling else ["k2", "k9"])
    assert planned["task"] == "score" and planned["rows"]["error"] == len(bad)
    assert sorted(i for e in planned["errors"].values() for i in e["first_ids"]) == bad
    pred = report["prediction"]
    # every row's context and continuation (or rolling windows), fed as the engine takes them: the tokens and
    # the prefix cache's hits as the job's
    assert pred["prompt_tokens"]["predicted"] == pred["prompt_tokens"]["actual"] > 0
    # the shared contexts hit the cache; rolling windows score every token after the first (none can be served)
    hit = pred["prefix_hit_rate"]["predicted"]
    assert hit < 0.05 if rolling else hit > 0.3
    assert pred["prefix_hit_rate"]["difference"] == pytest.approx(0.0, abs=0.05)
    w = pred["wall_time_s"]
    assert 0 < w["range"][0] < w["predicted"] < w["range"][1] and w["actual"] > 0
