"""The batch job end to end on CPU with a tiny checkpoint (in-process).

Covers: output equal to ``LLM.generate``; grouping on/off identical with a higher prefix hit rate when on;
bad rows; chat templates; n > 1; sharding; resume after a signal; refusing another configuration or another
checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import env_without_slurm, job_config, part_contents, signal_after

from batchgen.data.prompts import row_seed
from batchgen.job.run import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_TOO_MANY_ERRORS, run_job
from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams

TEMPLATES = [
    "Classify the sentiment of the review as positive or negative. Review: the food was great. Sentiment: "
    "positive. Review: the room was dirty. Sentiment: negative. Review:",
    "Translate from English to French. English: good morning. French: bonjour. English: thank you. French: "
    "merci. English:",
    "Answer the question using the handbook. Staff may work remotely three days a week after probation. "
    "Holidays are twenty seven days a year. Question:",
    "Write a docstring for the following Python function. def add(a, b): return a + b. Docstring:",
]
WORDS = (
    "apple river stone cloud garden window yellow quiet music paper silver forest lamp bridge tiger".split()
)


def make_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        t = TEMPLATES[i % len(TEMPLATES)]
        tail = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 4))
        rows.append({"uid": f"r{i:03d}", "prompt": f"{t} {tail}", "cat": f"c{i % len(TEMPLATES)}"})
    return rows


def write_rows(path: Path, rows: list[dict], **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, **kw)
    return path


def read_output(directory: Path) -> pa.Table:
    parts = sorted(directory.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]) if parts else pa.table({})


def without_cached(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "num_cached_tokens"} for r in rows]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("job_data")
    rows = make_rows(30)
    write_rows(root / "in" / "a.parquet", rows[:17], row_group_size=5)
    write_rows(root / "in" / "b.parquet", rows[17:])
    return root / "in"


def test_output_equals_llm_generate(llama_ckpt: str, dataset: Path, tmp_path: Path) -> None:
    cfg = job_config(
        llama_ckpt, dataset, tmp_path / "out", data={"id_column": "uid", "keep_columns": ["cat"]}
    )
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK and res.status == "complete"
    out = read_output(tmp_path / "out")
    rows = make_rows(30)
    assert out.column("id").to_pylist() == [r["uid"] for r in rows]
    assert out.column("cat").to_pylist() == [r["cat"] for r in rows]
    assert set(out.column("status").to_pylist()) == {"ok"}
    assert out.column_names == [
        "id", "cat", "generated_text", "token_ids", "num_prompt_tokens", "num_generated_tokens",
        "num_cached_tokens", "finish_reason", "status", "error",
    ]  # fmt: skip

    llm = LLM(llama_ckpt, device="cpu", num_blocks=256, max_num_seqs=8)
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=row_seed(0, r["uid"])) for r in rows]
    ref = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    assert out.column("token_ids").to_pylist() == [o.outputs[0].token_ids for o in ref]
    assert out.column("generated_text").to_pylist() == [o.outputs[0].text for o in ref]
    assert out.column("num_prompt_tokens").to_pylist() == [len(o.prompt_token_ids) for o in ref]
    assert out.column("finish_reason").to_pylist() == [o.outputs[0].finish_reason for o in ref]

    meta = json.loads(pq.read_schema(tmp_path / "out" / "part-000000.parquet").metadata[b"batchgen"])
    assert meta["sampling"]["temperature"] == 0.8 and meta["id_column"] == "uid"
    assert meta["model"]["path"] == llama_ckpt and meta["input"]["num_rows"] == 30
    assert meta["part"] == {
        "index": 0,
        "windows": [0, 3],
        "row_start": 0,
        "row_end": 30,
    }  # one part: 4 windows
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    assert report["rows"]["ok"] == 30 and report["status"] == "complete"
    assert report["tokens"]["generated"] == sum(len(o.outputs[0].token_ids) for o in ref)
    assert 0 < report["kv"]["min_utilization"] <= 1 and "min_utilisation" not in report["kv"]

    # a rerun has nothing to do; another configuration is refused; overwrite=true redoes it
    again = run_job(cfg, handle_signals=False, print_summary=False)
    assert again.exit_code == EXIT_OK and "nothing to do" in again.message
    other = job_config(llama_ckpt, dataset, tmp_path / "out", data={"id_column": "uid", "keep_columns": ["cat"]},
                       sampling={"temperature": 0.5})  # fmt: skip
    refused = run_job(other, handle_signals=False, print_summary=False)
    assert refused.exit_code == EXIT_CONFIG and "sampling.temperature: 0.8 -> 0.5" in refused.message
    narrow = job_config(llama_ckpt, dataset, tmp_path / "out", data={"id_column": "uid", "keep_columns": ["cat"]},
                        sampling={"temperature": 0.8}, engine={"kv_cache_dtype": "bfloat16"})  # fmt: skip
    refused = run_job(narrow, handle_signals=False, print_summary=False)  # rounded K/V: other output
    assert refused.exit_code == EXIT_CONFIG and "engine.kv_cache_dtype" in refused.message, refused.message
    other.data.overwrite = True
    assert run_job(other, handle_signals=False, print_summary=False).exit_code == EXIT_OK


def test_grouping_keeps_generations_and_raises_hit_rate(llama_ckpt: str, tmp_path: Path) -> None:
    # Long shared templates, interleaved; a KV pool too small to keep every template cached at once.
    heads = [
        f"Template {j}: " + " ".join(WORDS[(j * 5 + k * 3) % len(WORDS)] for k in range(70)) for j in range(6)
    ]
    rows = [{"prompt": f"{heads[i % 6]} {WORDS[i % len(WORDS)]} {i}"} for i in range(24)]
    inp = write_rows(tmp_path / "in.parquet", rows)
    reports, tables = {}, {}
    for on in (True, False):
        out = tmp_path / f"out-{on}"
        cfg = job_config(llama_ckpt, inp, out, data={"group_by_prefix": on, "window_rows": 24},
                         engine={"num_blocks": 24, "max_num_seqs": 2}, sampling={"max_tokens": 3})  # fmt: skip
        assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
        reports[on] = json.loads((out / "_report.json").read_text())
        tables[on] = read_output(out)
    for col in ("id", "generated_text", "token_ids", "finish_reason", "num_prompt_tokens"):
        assert tables[True].column(col).to_pylist() == tables[False].column(col).to_pylist(), col
    hit_on, hit_off = reports[True]["tokens"]["prefix_hit_rate"], reports[False]["tokens"]["prefix_hit_rate"]
    print(f"prefix hit rate: grouped {hit_on:.1%}, input order {hit_off:.1%}")
    assert hit_on > hit_off + 0.2, (hit_on, hit_off)


def test_report_counts_prefix_tokens_copied_from_inside_a_block(llama_ckpt: str, tmp_path: Path) -> None:
    # rows: a shared template that ends inside a block, then each row's own words
    head = "Template: " + " ".join(WORDS[(k * 7) % len(WORDS)] for k in range(40))
    rows = [
        {"prompt": f"{head} {' '.join(WORDS[(i + k) % len(WORDS)] for k in range(12))} {i}"} for i in range(8)
    ]
    inp = write_rows(tmp_path / "in.parquet", rows)
    reports, tables = {}, {}
    for caching in (True, False):
        out = tmp_path / f"out-{caching}"
        cfg = job_config(llama_ckpt, inp, out, engine={"enable_prefix_caching": caching},
                         sampling={"max_tokens": 4, "temperature": 0.0})  # fmt: skip
        assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
        reports[caching] = json.loads((out / "_report.json").read_text())["tokens"]
        tables[caching] = read_output(out)
    t = reports[True]
    assert t["prompt_copied"] > 0 and t["prompt_reused"] % 16 == 0, t
    assert t["prompt_computed"] + t["prompt_reused"] + t["prompt_copied"] == t["prompt_admitted"], t
    assert reports[False]["prompt_copied"] == 0
    assert all(n % 16 == 0 for n in tables[True].column("num_cached_tokens").to_pylist())
    for col in ("id", "token_ids", "finish_reason"):
        assert tables[True].column(col).to_pylist() == tables[False].column(col).to_pylist(), col


def test_every_kind_of_bad_row(llama_ckpt: str, tmp_path: Path) -> None:
    long_prompt = "word " * 200
    st = pa.struct([("max_tokens", pa.int32()), ("temperature", pa.float64())])
    table = pa.table(
        {
            "uid": ["ok1", "null", "empty", "space", "long", "badtemp", None, "ok2"],
            "prompt": ["fine prompt", None, "", "  ", long_prompt, "x y z", "no id", "another fine prompt"],
            "sampling": pa.array(
                [{"max_tokens": 2, "temperature": None}, None, None, None, None,
                 {"max_tokens": None, "temperature": -1.0}, None, None],
                type=st,
            ),
        }
    )  # fmt: skip
    inp = tmp_path / "bad.parquet"
    pq.write_table(table, inp)
    out = tmp_path / "out"
    cfg = job_config(
        llama_ckpt, inp, out, data={"id_column": "uid", "window_rows": 3}, engine={"max_model_len": 64}
    )
    res = run_job(cfg, handle_signals=False, print_summary=False)
    # 6 of 8 rows fail: the output is complete, but that many errors make the job a failure (exit 3)
    assert res.exit_code == EXIT_TOO_MANY_ERRORS and res.status == "failed", res.message
    assert "6 of 8 rows (75.0%) are error rows, more than run.max_error_fraction=0.1" in res.message
    got = read_output(out).to_pylist()
    assert [r["id"] for r in got] == table.column("uid").to_pylist()  # nothing dropped, input order
    by = {r["id"]: r for r in got}
    assert by["ok1"]["status"] == "ok" and by["ok1"]["num_generated_tokens"] <= 2
    assert by["ok2"]["status"] == "ok" and by["ok2"]["num_generated_tokens"] <= 6
    expect = {
        "null": "prompt is null",
        "empty": "prompt is empty",
        "space": "prompt is only whitespace",
        "long": "engine.max_model_len is 64",
        "badtemp": "temperature",
        None: "id column 'uid' is null",
    }
    for k, msg in expect.items():
        r = by[k]
        assert r["status"] == "error" and r["finish_reason"] == "error" and msg in r["error"], r
        assert r["generated_text"] is None and r["token_ids"] is None
    assert by["long"]["num_prompt_tokens"] >= 64
    report = json.loads((out / "_report.json").read_text())
    assert report["rows"]["ok"] == 2 and report["rows"]["error"] == 6 and report["status"] == "failed"
    assert (
        report["rows"]["retryable"] == 1
    )  # the too-long row: engine.max_model_len may be raised and retried
    assert report["errors"]["exceeded"] and report["errors"]["fraction"] == 0.75
    # the same output with a tolerance of 100%: nothing to do, exit 0
    cfg.run.max_error_fraction = 1.0
    again = run_job(cfg, handle_signals=False, print_summary=False)
    assert again.exit_code == EXIT_OK and "nothing to do" in again.message


def test_non_string_prompts_and_bad_messages(llama_ckpt: str, tmp_path: Path) -> None:
    # an int prompt column can never give a valid row: a configuration error before the model loads
    inp = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": [1, 2]}), inp)
    res = run_job(job_config(llama_ckpt, inp, tmp_path / "o1"), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_CONFIG
    assert "data.prompt_column: column 'prompt' has type int64, not string" in res.message
    assert not list((tmp_path / "o1").glob("part-*"))

    msg_t = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    good = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    table = pa.table(
        {"messages": pa.array([good, None, [], [{"role": "user", "content": None}]], type=msg_t)}
    )
    inp = tmp_path / "chat.parquet"
    pq.write_table(table, inp)
    cfg = job_config(llama_ckpt, inp, tmp_path / "o2", data={"messages_column": "messages"},
                     sampling={"temperature": 0.0})  # fmt: skip
    cfg.run.max_error_fraction = 1.0
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    got = read_output(tmp_path / "o2").to_pylist()
    assert [r["status"] for r in got] == ["ok", "error", "error", "error"]
    assert got[1]["error"] == "messages is null" and got[2]["error"] == "messages is empty"

    # chat rows are rendered with the template and generate like the rendered token ids
    llm = LLM(llama_ckpt, device="cpu", num_blocks=256)
    ids = llm.tokenizer.apply_chat_template(good, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    ref = llm.generate([list(ids)], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert got[0]["token_ids"] == ref.outputs[0].token_ids
    assert got[0]["num_prompt_tokens"] == len(ids)


def test_n_samples_give_one_row_each(llama_ckpt: str, dataset: Path, tmp_path: Path) -> None:
    cfg = job_config(llama_ckpt, dataset, tmp_path / "out", sampling={"n": 3, "max_tokens": 4},
                     data={"window_rows": 16})  # fmt: skip
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    out = read_output(tmp_path / "out")
    assert out.num_rows == 90
    assert out.column("id").to_pylist() == [i for i in range(30) for _ in range(3)]
    assert out.column("sample_index").to_pylist() == [0, 1, 2] * 30
    rows = make_rows(30)
    llm = LLM(llama_ckpt, device="cpu", num_blocks=256)
    ref = llm.generate(
        [rows[0]["prompt"]],
        SamplingParams(n=3, max_tokens=4, temperature=0.8, seed=row_seed(0, 0)),
        use_tqdm=False,
    )[0]
    assert out.column("token_ids").to_pylist()[:3] == [o.token_ids for o in ref.outputs]


def test_shards_cover_each_row_once_and_match_one_process(
    llama_ckpt: str, dataset: Path, tmp_path: Path
) -> None:
    single = tmp_path / "single"
    assert (
        run_job(job_config(llama_ckpt, dataset, single), handle_signals=False, print_summary=False).exit_code
        == 0
    )
    ref = read_output(single).to_pylist()
    out = tmp_path / "sharded"
    got = []
    for i in range(3):
        cfg = job_config(llama_ckpt, dataset, out, data={"shard": {"index": i, "count": 3}})
        res = run_job(cfg, handle_signals=False, print_summary=False)
        assert res.exit_code == EXIT_OK and res.output_dir == str(out / f"shard-{i:05d}-of-00003")
        got += read_output(Path(res.output_dir)).to_pylist()
    assert sorted(r["id"] for r in got) == list(range(30))
    assert without_cached(sorted(got, key=lambda r: r["id"])) == without_cached(ref)


def test_resume_with_another_checkpoint_is_refused(
    llama_ckpt: str, qwen2_ckpt: str, dataset: Path, tmp_path: Path
) -> None:
    """The manifest's fingerprint covers the checkpoint's files, not its path: other files under the same
    model.path are refused (exit status 2, nothing touched); the same files under another path resume."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(llama_ckpt, ckpt)
    cfg = job_config(str(ckpt), dataset, out, data={"window_rows": 16})
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    manifest, parts = (out / "_manifest.json").read_text(), part_contents(out)

    shutil.rmtree(ckpt)
    shutil.copytree(qwen2_ckpt, ckpt)  # another checkpoint, same path
    args = [f"model.path={ckpt}", f"data.input={dataset}", f"data.output={out}", "data.window_rows=16",
            "engine.device=cpu", "engine.num_blocks=256", "engine.max_num_seqs=8", "sampling.max_tokens=6",
            "sampling.temperature=0.8", "run.progress=off"]  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "batchgen.cli", *args],
        cwd=tmp_path,
        env=env_without_slurm(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = p.stdout + p.stderr
    assert p.returncode == EXIT_CONFIG == 2, text
    assert f"{str(out)!r} holds output of a different configuration" in text
    assert "model.fingerprint: '" in text and "data.overwrite=true" in text
    # names, not only hashes: what changed in the checkpoint
    assert "model: architecture LlamaForCausalLM -> Qwen2ForCausalLM; files changed: config.json" in text
    assert (out / "_manifest.json").read_text() == manifest and part_contents(out) == parts

    moved = tmp_path / "moved"
    shutil.copytree(llama_ckpt, moved)
    cfg.model.path = str(moved)
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK and "nothing to do" in res.message


@pytest.mark.parametrize("sig, grace", [(signal.SIGUSR1, 0.0), (signal.SIGTERM, 30.0), (signal.SIGINT, 0.0)])
def test_signal_stops_cleanly_and_resume_is_identical(
    llama_ckpt: str, dataset: Path, tmp_path: Path, sig: int, grace: float
) -> None:
    from batchgen.engine.core.llm_engine import LLMEngine

    ref_dir = tmp_path / "ref"
    assert (
        run_job(job_config(llama_ckpt, dataset, ref_dir), handle_signals=False, print_summary=False).exit_code
        == 0
    )
    out = tmp_path / "out"
    cfg = job_config(llama_ckpt, dataset, out)
    cfg.run.stop_grace_s = grace
    engine = signal_after(LLMEngine(llama_ckpt, cfg.engine), at=9, sig=sig)
    res = run_job(cfg, engine=engine, print_summary=False)
    assert res.exit_code == EXIT_INTERRUPTED and res.status == "incomplete"
    assert res.report["interrupted_by"] == signal.Signals(sig).name
    done = json.loads((out / "_manifest.json").read_text())
    assert 0 < len(done["windows"]) < 4 and not done["complete"]
    pieces = sorted(str(p.relative_to(out)) for p in out.glob("_windows/part-*"))
    assert pieces == sorted(w["part"] for w in done["windows"].values())
    assert not list(out.glob("part-*"))  # no part is complete yet: a dataset reader sees none
    assert signal.getsignal(sig) is not None and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    res = run_job(cfg, print_summary=False)
    assert res.exit_code == EXIT_OK
    assert res.report["windows"]["this_run"] == 4 - len(done["windows"])
    assert part_contents(out) == part_contents(ref_dir)


def test_config_errors_before_any_work(llama_ckpt: str, dataset: Path, tmp_path: Path) -> None:
    def err(**kw) -> str:
        cfg = job_config(kw.pop("model_path", llama_ckpt), kw.pop("inp", dataset), tmp_path / "o", **kw)
        res = run_job(cfg, handle_signals=False)
        assert res.exit_code == EXIT_CONFIG, res
        return res.message

    assert "does not exist" in err(inp=tmp_path / "missing.parquet")
    assert "data.prompt_column: column 'text' is missing" in err(data={"prompt_column": "text"})
    assert "data.keep_columns: column 'nope'" in err(data={"keep_columns": ["nope"]})
    assert "data.id_column" in err(data={"id_column": "nope"})
    assert "data.sampling_column" in err(data={"sampling_column": "nope"})
    assert "model.path" in err(data={}, model_path=str(tmp_path))
    assert not (tmp_path / "o" / "_manifest.json").exists()


def test_progress_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from batchgen.engine.core.stats import EngineStats
    from batchgen.job.progress import Progress, resolve_mode

    assert resolve_mode("auto", open(os.devnull, "w")) == "log" and resolve_mode("bar") == "bar"
    caplog.set_level(logging.INFO, logger="batchgen.progress")
    p = Progress(total=10, initial=2, mode="log", interval_s=1e-9)
    p.update(
        3, stats=EngineStats(prompt_tokens=10, prompt_tokens_cached=5, generated_tokens=100, kv_usage=0.25)
    )
    p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines and lines[0].startswith("progress: 5/10 rows (50.0%)")
    assert "prefix hit 50%" in lines[0] and "KV 25%" in lines[0] and "gen tok/s" in lines[0]
    bar = Progress(total=3, mode="bar")
    bar.update(3)
    bar.close()


def test_model_implementation_transformers_gives_the_same_rows(llama_ckpt: str, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["The quick brown fox", "def main():", "Once upon a time"]}), inp)
    outs = {}
    for impl in ("native", "transformers"):
        cfg = job_config(llama_ckpt, inp, tmp_path / impl, sampling={"temperature": 0.0})
        cfg.model.implementation = impl
        assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
        outs[impl] = read_output(tmp_path / impl).column("token_ids").to_pylist()
    assert outs["native"] == outs["transformers"]


def test_model_implementation_is_checked() -> None:
    from batchgen.errors import ConfigError
    from batchgen.job.config import ModelOptions

    with pytest.raises(ConfigError, match="model.implementation must be one of auto, native, transformers"):
        ModelOptions(implementation="vllm")
