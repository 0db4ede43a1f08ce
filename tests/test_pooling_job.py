"""task=embed / task=classify jobs: output columns and types, error rows, resume after a crash, --help."""

from __future__ import annotations

import dataclasses
import json
import re

import pooling_zoo as zoo
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import batchgen_cli, job_config

from batchgen import LLM
from batchgen.data.output_dir import OutputDir
from batchgen.job.config import PoolingOptions
from batchgen.job.run import run_job

TEXTS = [
    "short",
    "a longer passage about paged attention and caches",
    None,
    "",
    "x y z",
    "more text here",
    "q",
]


def _read(d):
    return pa.concat_tables([pq.read_table(p) for p in sorted(d.glob("*.parquet"))]).sort_by("id")


def _job(ckpt, tmp_path, out, task, **pooling):
    job = job_config(ckpt, tmp_path / "in.parquet", tmp_path / out, data={"window_rows": 3})
    return dataclasses.replace(
        job,
        task=task,
        pooling=PoolingOptions(**pooling),
        run=dataclasses.replace(job.run, max_error_fraction=1.0),  # two rows are errors on purpose
    )


def test_embed_job_writes_embeddings_and_resumes(tmp_path, monkeypatch):
    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=11)
    pq.write_table(pa.table({"prompt": TEXTS}), tmp_path / "in.parquet")
    job = _job(path, tmp_path, "out", "embed", method="mean", dimensions=32)
    res = run_job(job, print_summary=False, handle_signals=False)
    assert res.exit_code == 0, res.message
    t = _read(tmp_path / "out")
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), 32)
    out = t.to_pydict()
    assert out["status"] == ["ok", "ok", "error", "error", "ok", "ok", "ok"]
    assert out["embedding"][2] is None and "non-empty string" in out["error"][3]
    want = LLM(path).embed([TEXTS[i] for i in (0, 1, 4, 5, 6)], pooling="mean", dimensions=32, use_tqdm=False)
    got = [out["embedding"][i] for i in (0, 1, 4, 5, 6)]
    for g, w in zip(got, want):
        assert g == pytest.approx(w.outputs.embedding, abs=1e-5)

    # a crash after the first window's commit: the rerun does the rest, the output equals the full run's
    real_commit = OutputDir.commit
    calls = []

    def dying_commit(self, *a, **kw):
        real_commit(self, *a, **kw)
        calls.append(1)
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(OutputDir, "commit", dying_commit)
    crashed = dataclasses.replace(job, data=dataclasses.replace(job.data, output=str(tmp_path / "crash")))
    assert run_job(crashed, print_summary=False, handle_signals=False).exit_code == 1
    monkeypatch.setattr(OutputDir, "commit", real_commit)
    assert len(list((tmp_path / "crash").glob("_windows/part-*.arrow"))) == 1  # committed, in no part yet
    assert run_job(crashed, print_summary=False, handle_signals=False).exit_code == 0
    assert _read(tmp_path / "crash").to_pydict() == out


def test_classify_job_on_a_decoder_reward_and_labels(tmp_path):
    labels = {"id2label": zoo.LABELS3, "label2id": {v: k for k, v in zoo.LABELS3.items()}}
    path = zoo.decoder(
        tmp_path / "cls", "qwen3", "Qwen3ForSequenceClassification", seed=12, num_labels=3, **labels
    )
    pq.write_table(pa.table({"prompt": TEXTS}), tmp_path / "in.parquet")
    res = run_job(_job(path, tmp_path, "out", "classify"), print_summary=False, handle_signals=False)
    assert res.exit_code == 0, res.message
    t = _read(tmp_path / "out")
    assert t.schema.field("probs").type == pa.list_(pa.float32(), 3)
    out = t.to_pydict()
    want = LLM(path, num_blocks=64).classify([TEXTS[i] for i in (0, 1, 4)], use_tqdm=False)
    for i, w in zip((0, 1, 4), want):
        assert out["probs"][i] == pytest.approx(w.outputs.probs, abs=1e-5)
        assert out["label"][i] == w.outputs.label in zoo.LABELS3.values()
    assert out["probs"][3] is None and out["status"][3] == "error"


def test_classify_job_refuses_an_embedder(tmp_path):
    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=11)
    pq.write_table(pa.table({"prompt": TEXTS}), tmp_path / "in.parquet")
    res = run_job(_job(path, tmp_path, "out", "classify"), print_summary=False, handle_signals=False)
    assert res.exit_code == 2 and "ForSequenceClassification" in res.message


def test_generation_over_a_classifier_or_encoder_names_the_task(tmp_path):
    """The default task (generate) over a checkpoint that is not a language model: one line saying which task
    it is for, exit status 2, nothing written."""
    pq.write_table(pa.table({"prompt": ["hello there"]}), tmp_path / "in.parquet")
    cases = {
        "classify": zoo.encoder(tmp_path / "cls", "bert", "BertForSequenceClassification", num_labels=3),
        "embed": zoo.encoder(tmp_path / "enc", "bert", "BertModel"),
    }
    for task, path in cases.items():
        p = batchgen_cli([f"model.path={path}", "data.input=in.parquet", "data.output=out"], tmp_path)
        said = (p.stdout + p.stderr).strip().splitlines()
        assert p.returncode == 2 and len(said) == 1, p.stdout + p.stderr
        kind = "a sequence classifier" if task == "classify" else "an encoder"
        assert f"this is {kind}" in said[0] and said[0].endswith(f"use task={task}"), said
        assert "native:" not in said[0]
    assert not (tmp_path / "out").exists()


def test_embed_job_summary_shows_the_pooling_run(tmp_path):
    """`batchgen task=embed` prints the rows, the tokens it pooled and its rate, not generation figures."""
    path = zoo.encoder(tmp_path / "enc", "bert", "BertModel")
    pq.write_table(
        pa.table({"prompt": ["hello there", "", "a longer passage of text"]}), tmp_path / "in.parquet"
    )
    args = [
        "task=embed",
        f"model.path={path}",
        "data.input=in.parquet",
        "data.output=out",
        "run.progress=off",
    ]
    p = batchgen_cli([*args, "run.max_error_fraction=0.5"], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    tokens = sum(x for x in pq.read_table(tmp_path / "out").column("num_prompt_tokens").to_pylist() if x)
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    assert report["task"] == "embed" and report["pooling"]["prompt_tokens"] == tokens > 0
    rate = report["pooling"]["prompt_tokens_per_s"]
    assert rate == pytest.approx(tokens / report["run"]["wall_time_s"], rel=0.05)
    body = p.stdout.split("\n-")[1].splitlines()[1:]  # the rows between the table's two rules
    table = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in body if line[:1].isalpha())
    assert table["rows ok / error"].startswith("2 / 1") and table["prompt tokens pooled"] == str(tokens)
    assert float(table["rows/s"]) > 0 and float(table["prompt tok/s"]) > 0
    assert not any(k.startswith(("generated", "KV", "peak", "preemptions")) for k in table), p.stdout


def test_help_documents_the_task_keys():
    from batchgen.job.help import render_options

    text = render_options()
    assert "task=generate" in text and "'embed'" in text and "'classify'" in text
    assert "pooling.method=null" in text and "pooling.dimensions=null" in text


@pytest.mark.slow
def test_embed_job_killed_with_sigkill_resumes_identically(tmp_path):
    import signal
    import subprocess
    import sys

    from conftest import env_without_slurm, wait_for_rows_done

    path = zoo.encoder(tmp_path / "bert", "bert", "BertModel", seed=11)
    texts = [f"row {i} " + "word " * (i % 17) for i in range(24)]
    pq.write_table(pa.table({"prompt": texts}), tmp_path / "in.parquet")
    ref = _job(path, tmp_path, "ref", "embed")
    assert run_job(ref, print_summary=False, handle_signals=False).exit_code == 0
    out = tmp_path / "killed"
    cmd = [
        sys.executable, "-m", "batchgen.cli", "task=embed", f"model.path={path}",
        f"data.input={tmp_path / 'in.parquet'}", f"data.output={out}", "data.window_rows=3",
        "data.shard.index=0", "data.shard.count=1", "run.progress=off", "engine.device=cpu",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env_without_slurm(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_rows_done(proc, out, 6)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    resumed = dataclasses.replace(ref, data=dataclasses.replace(ref.data, output=str(out)))
    assert run_job(resumed, print_summary=False, handle_signals=False).exit_code == 0
    parts = sorted(p.name for p in (tmp_path / "ref").glob("part-*.parquet"))
    assert sorted(p.name for p in out.glob("part-*.parquet")) == parts
    for name in parts:
        got, want = pq.read_table(out / name).to_pylist(), pq.read_table(tmp_path / "ref" / name).to_pylist()
        assert [r["id"] for r in got] == [r["id"] for r in want]
        for a, b in zip(got, want):
            assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-5)
