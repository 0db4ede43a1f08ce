"""An image job: data.image_column in every layout users have (datasets' Image struct, binary, paths/URLs), chat
rows with image parts, error rows for bad images, output equal to the API's (which equals transformers)."""

from __future__ import annotations

import base64
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from conftest import job_config, read_parts  # noqa: E402
from vision_helpers import png_bytes, random_image  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.job.run import run_job  # noqa: E402
from batchgen.multimodal.tiny import build_llava  # noqa: E402

GREEDY = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return build_llava(tmp_path_factory.mktemp("llava_job"))


def _images(tmp_path):
    imgs = [random_image(w, h, 40 + i) for i, (w, h) in enumerate([(56, 56), (90, 60), (60, 90)])]
    paths = []
    for i, im in enumerate(imgs):
        p = tmp_path / f"img{i}.png"
        p.write_bytes(png_bytes(im))
        paths.append(str(p))
    return imgs, paths


def test_image_job_matches_the_api_and_bad_images_are_error_rows(llava, tmp_path):
    imgs, paths = _images(tmp_path)
    data = [png_bytes(im) for im in imgs]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    prompts = [
        "<image> What is it?",
        "<image> Describe the colours.",
        "<image> What is it?",
        "Compare <image> and <image>.",
        "<image> broken",
        "<image> missing file",
        "text only",
        "<image> What is it?",
    ]
    images = [
        {"bytes": data[0], "path": None},
        {"bytes": None, "path": paths[1]},
        {"bytes": data[0], "path": "ignored.png"},  # the same image again: encoded once
        None,
        {"bytes": data[1][:70], "path": None},
        {"bytes": None, "path": str(tmp_path / "nope.png")},
        None,
        {"bytes": data[2], "path": None},
    ]
    table = pa.table({"prompt": prompts, "image": pa.array(images, type=struct)})
    inp = tmp_path / "in.parquet"
    pq.write_table(table, inp)
    out = tmp_path / "out"
    cfg = job_config(llava, inp, out, data={"image_column": "image"}, sampling=GREEDY)
    cfg.run.max_error_fraction = 1.0
    assert run_job(cfg).exit_code == 0
    got = read_parts(out).to_pylist()
    assert [r["status"] for r in got] == ["ok", "ok", "ok", "error", "error", "error", "ok", "ok"]
    assert "but the row has no image" in got[3]["error"]  # the placeholders of row 3 with no image in 'image'
    assert "corrupt or truncated" in got[4]["error"]
    assert "no such file" in got[5]["error"]
    figures = json.loads((out / "_report.json").read_text())["images"]
    assert (figures["references"], figures["distinct"], figures["encoded"]) == (4, 3, 3)
    assert 0 < figures["encoder_share"] < 1
    llm = LLM(llava, kv_cache_memory="32MiB")
    ok = [0, 1, 2, 6, 7]
    api = llm.generate(
        [
            {"prompt": prompts[i], "multi_modal_data": {"image": images[i]}} if images[i] else prompts[i]
            for i in ok
        ],
        SamplingParams(**GREEDY),
        use_tqdm=False,
    )
    assert [got[i]["token_ids"] for i in ok] == [o.outputs[0].token_ids for o in api]
    # a list column of paths / data URLs; a path relative to the input's directory, not the working directory
    data_url = "data:image/png;base64," + base64.b64encode(data[2]).decode()
    t2 = pa.table(
        {
            "prompt": [
                "Compare <image> and <image>.",
                "<image> ok",
                "<image> relative",
                "<image> <image> null",
            ],
            "img": [[paths[1], data_url], [paths[0]], ["img0.png"], [paths[0], None]],
        }
    )
    pq.write_table(t2, tmp_path / "in2.parquet")
    (tmp_path / "cwd").mkdir()
    with pytest.MonkeyPatch.context() as m:
        m.chdir(tmp_path / "cwd")
        run_job(
            job_config(
                llava,
                tmp_path / "in2.parquet",
                tmp_path / "out2",
                data={"image_column": "img"},
                sampling=GREEDY,
            )
        )
    rows2 = read_parts(tmp_path / "out2").to_pylist()
    assert [r["status"] for r in rows2] == ["ok", "ok", "ok", "error"]
    assert rows2[3]["error"].startswith("image column 'img': image 1: null image value")
    t2_rows = t2.to_pylist()[:3]
    t2_rows[2]["img"] = [paths[0]]
    api2 = llm.generate(
        [{"prompt": r["prompt"], "multi_modal_data": {"image": r["img"]}} for r in t2_rows],
        SamplingParams(**GREEDY),
        use_tqdm=False,
    )
    assert [r["token_ids"] for r in rows2[:3]] == [o.outputs[0].token_ids for o in api2]


def test_dry_run_keys_image_tokens_by_image_and_names_an_image_first(llava, tmp_path):
    """Rows with different images before a shared instruction share nothing past the image: the plan's hit
    rate is the job's, its sharing note names the image, and undecodable images are error rows by reason."""
    imgs, _paths = _images(tmp_path)
    text = " Answer in one short sentence, be precise, cite no sources and do not repeat the question. Q"
    prompts = [f"<image>{text}{i}?" for i in range(6)] + ["<image> broken"]
    images = [png_bytes(imgs[i % 3]) for i in range(6)] + [png_bytes(imgs[0])[:70]]
    pq.write_table(pa.table({"prompt": prompts, "image": images}), tmp_path / "in.parquet")
    out = tmp_path / "out"
    cfg = job_config(llava, tmp_path / "in.parquet", out, data={"image_column": "image"}, sampling=GREEDY)
    cfg.run.max_error_fraction = 1.0
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((out / "_plan.json").read_text())
    assert plan["rows"]["error"] == 1
    (reason,) = plan["errors"].values()
    assert "corrupt or truncated" in reason["example"] and reason["first_ids"] == [6]
    assert "image 0 (from data.image_column 'image')" in plan["sharing"]["first_difference"]
    cfg.run.dry_run = False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    report = json.loads((out / "_report.json").read_text())
    assert report["prediction"]["prompt_tokens"]["predicted"] == report["tokens"]["prompt_admitted"]
    assert plan["predicted"]["prefix_hit_rate"] == pytest.approx(
        report["tokens"]["prefix_hit_rate"], abs=0.01
    )
    # the Python API: the same prompts with their images, planned as generate runs them
    llm = LLM(llava, kv_cache_memory="32MiB")
    api = [{"prompt": p, "multi_modal_data": {"image": imgs[i % 3]}} for i, p in enumerate(prompts[:6])]
    api_plan = llm.plan(api, SamplingParams(**GREEDY))
    outs = LLM(llava, kv_cache_memory="32MiB").generate(api, SamplingParams(**GREEDY), use_tqdm=False)
    assert api_plan["prompt_tokens"]["total"] == sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs) / api_plan["prompt_tokens"]["total"]
    assert api_plan.prefix_hit_rate == pytest.approx(cached, abs=0.01)
    assert "multi_modal_data" in api_plan["sharing"]["first_difference"]


def test_moving_text_before_the_images_is_advised_only_where_it_shares_more(llava, tmp_path):
    # most rows of one image share the text after it already: the text first would share less, so the plan
    # names the shared text without advising to move it
    imgs, _paths = _images(tmp_path)
    text = "Answer in one short sentence, be precise, cite no sources and do not repeat the question."
    q = [f"Q{i}: what is {i} times {i + 3}?" for i in range(36)]
    prompts = [f"{text} <image> {q[i]}" if i % 3 == 0 else f"<image> {text} {q[i]}" for i in range(36)]
    images = [png_bytes(imgs[i % 3]) for i in range(36)]
    pq.write_table(pa.table({"prompt": prompts, "image": images}), tmp_path / "in.parquet")
    cfg = job_config(llava, tmp_path / "in.parquet", tmp_path / "out", data={"image_column": "image"})
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    plan = json.loads((tmp_path / "out" / "_plan.json").read_text())
    sharing = plan["sharing"]
    assert sharing["shared_run"]["hit_rate_if_first"] < plan["predicted"]["prefix_hit_rate"]
    assert not any("the hit rate becomes about" in n for n in sharing["notes"])


def test_chat_rows_with_image_parts(llava, tmp_path):
    imgs, paths = _images(tmp_path)
    part = pa.struct(
        [("type", pa.string()), ("text", pa.string()), ("image_url", pa.struct([("url", pa.string())]))]
    )
    msg = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "text": None, "image_url": {"url": paths[0]}},
                    {"type": "text", "text": "What is it?", "image_url": None},
                ],
            }
        ],
        [{"role": "user", "content": [{"type": "text", "text": "Only text", "image_url": None}]}],
        [{"role": "user", "content": [{"type": "image_url", "text": None, "image_url": {"url": "s3:/bad"}}]}],
    ]
    pq.write_table(
        pa.table({"messages": pa.array(conversations, type=pa.list_(msg))}), tmp_path / "chat.parquet"
    )
    run_job(
        job_config(
            llava,
            tmp_path / "chat.parquet",
            tmp_path / "outc",
            data={"messages_column": "messages", "prompt_column": "messages"},
            sampling=GREEDY,
        )
    )
    rows = read_parts(tmp_path / "outc").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok", "error"]
    llm = LLM(llava, kv_cache_memory="32MiB")
    api = llm.chat(
        [
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": paths[0]}},
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ],
            [{"role": "user", "content": "Only text"}],
        ],
        SamplingParams(**GREEDY),
        use_tqdm=False,
    )
    assert [r["token_ids"] for r in rows[:2]] == [o.outputs[0].token_ids for o in api]


def test_image_column_needs_an_image_text_model(llama_ckpt, tmp_path):
    pq.write_table(pa.table({"prompt": ["a"], "image": [b"x"]}), tmp_path / "in.parquet")
    result = run_job(
        job_config(llama_ckpt, tmp_path / "in.parquet", tmp_path / "o", data={"image_column": "image"})
    )
    assert result.exit_code == 2 and "not an image-text checkpoint" in result.message


def test_processor_options_reach_the_job_and_a_bad_one_is_one_line(llava, tmp_path):
    """``engine.mm_processor_kwargs``: the job's image tokens follow them (its fingerprint records them); an
    option the processor does not take stops the job at its start with exit status 2."""
    pq.write_table(pa.table({"prompt": ["<image> What?"], "image": [png_bytes(random_image(90, 60, 3))]}),
                   tmp_path / "in.parquet")  # fmt: skip
    raw = {"do_normalize": False}
    cfg = job_config(llava, tmp_path / "in.parquet", tmp_path / "o", data={"image_column": "image"},
                     engine={"mm_processor_kwargs": raw}, sampling=GREEDY)  # fmt: skip
    assert run_job(cfg, print_summary=False).exit_code == 0
    row = [{"prompt": "<image> What?", "multi_modal_data": {"image": random_image(90, 60, 3)}}]
    api = [
        LLM(llava, kv_cache_memory="16MiB", **options).generate(row, SamplingParams(**GREEDY), use_tqdm=False)
        for options in ({"mm_processor_kwargs": raw}, {})
    ]
    got = read_parts(tmp_path / "o").to_pylist()[0]["token_ids"]
    assert got == api[0][0].outputs[0].token_ids != api[1][0].outputs[0].token_ids
    bad = job_config(llava, tmp_path / "in.parquet", tmp_path / "o2", data={"image_column": "image"},
                     engine={"mm_processor_kwargs": {"max_pixel": 1}})  # fmt: skip
    result = run_job(bad, print_summary=False)
    assert result.exit_code == 2 and "takes no option 'max_pixel'" in result.message
    assert "\n" not in result.message


def test_image_families_not_run_are_refused_by_name(tmp_path):
    """An image job on an image-text architecture batchgen does not run with images: one line naming the
    architecture and the families that do run."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({"architectures": ["PaliGemmaForConditionalGeneration"]})
    )
    from batchgen.errors import ConfigError
    from batchgen.multimodal.rows import image_options

    with pytest.raises(ConfigError) as e:  # a ConfigError ends the job with exit status 2
        image_options("image", str(tmp_path / "m"), None, None)
    assert "PaliGemmaForConditionalGeneration" in str(e.value) and "Qwen2-VL" in str(e.value)
    assert "\n" not in str(e.value)
    from batchgen.models.config import no_images_reason

    assert no_images_reason("PaliGemmaForConditionalGeneration").startswith(
        "PaliGemmaForConditionalGeneration: batchgen does not run this architecture's images"
    )
    assert "takes no images" in no_images_reason("LlamaForCausalLM")


def test_images_with_tensor_parallelism_are_one_clear_line(llava, tmp_path):
    """An image-text checkpoint shards its language model (text only): an image job with
    engine.tensor_parallel_size > 1 stops at validation with exit status 2, and an image prompt to such an
    engine is told why (one line)."""
    from batchgen.errors import ConfigError
    from batchgen.job.config import validate
    from batchgen.models.config import no_images_reason

    cfg = job_config(llava, tmp_path / "in.parquet", tmp_path / "out", data={"image_column": "image"})
    cfg.engine.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match=r"data.image_column='image' with engine.tensor_parallel_size=2"):
        validate(cfg)
    why = no_images_reason("Gemma3ForConditionalGeneration")
    assert "engine.tensor_parallel_size=1" in why and "\n" not in why


@pytest.mark.slow
def test_image_job_killed_with_sigkill_resumes_identically(llava, tmp_path):
    import dataclasses
    import signal
    import subprocess
    import sys

    from conftest import env_without_slurm, part_contents, wait_for_rows_done

    imgs, paths = _images(tmp_path)
    n = 36
    table = pa.table(
        {
            "prompt": [f"<image> question {i % 5}" for i in range(n)],
            "image": [paths[i % 3] if i % 11 else str(tmp_path / "gone.png") for i in range(n)],
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    sampling = {"max_tokens": 24, "temperature": 0.0}
    ref = job_config(
        llava,
        tmp_path / "in.parquet",
        tmp_path / "ref",
        data={"image_column": "image", "window_rows": 4},
        sampling=sampling,
    )
    ref.run.max_error_fraction = 1.0
    assert run_job(ref, print_summary=False, handle_signals=False).exit_code == 0
    out = tmp_path / "killed"
    cmd = [
        sys.executable, "-m", "batchgen.cli", f"model.path={llava}", f"data.input={tmp_path / 'in.parquet'}",
        f"data.output={out}", "data.window_rows=4", "data.image_column=image", "sampling.max_tokens=24",
        "sampling.temperature=0", "run.max_error_fraction=1.0", "data.shard.index=0", "data.shard.count=1",
        "run.progress=off", "engine.device=cpu", "engine.num_blocks=256", "engine.max_num_seqs=8",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env_without_slurm(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        done = wait_for_rows_done(proc, out, 8)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert 8 <= done < n, done  # killed mid-run
    resumed = dataclasses.replace(ref, data=dataclasses.replace(ref.data, output=str(out)))
    assert run_job(resumed, print_summary=False, handle_signals=False).exit_code == 0
    assert part_contents(out) == part_contents(tmp_path / "ref")


def test_help_documents_the_image_keys():
    from batchgen.job.help import render_options

    text = render_options()
    for key in (
        "data.image_column=null",
        "engine.encoder_cache_memory=1GiB",
        "engine.limit_mm_per_prompt={}",
    ):
        assert key in text


def test_cli_takes_the_image_limit_per_prompt():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "batchgen.cli", "--cfg", "job", "engine.limit_mm_per_prompt={image: 2}",
         "data.image_column=img"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert "limit_mm_per_prompt:\n    image: 2" in proc.stdout and "image_column: img" in proc.stdout


def test_a_window_runs_the_rows_of_one_image_together():
    from types import SimpleNamespace

    from batchgen.data.prompts import PromptRow
    from batchgen.data.reader import WindowSpec
    from batchgen.job.feeder import WindowWork

    def row(pos: int, image: str | None, ids: list[int]) -> PromptRow:
        r = PromptRow(pos, pos, pos, token_ids=ids)
        r.images = [SimpleNamespace(hash=image)] if image else None
        return r

    # the same text before different images must not interleave the rows of one image
    rows = [row(0, "b", [5, 9, 1]), row(1, "a", [5, 9, 2]), row(2, "b", [5, 9, 0]), row(3, None, [7]),
            row(4, "a", [5, 9, 0])]  # fmt: skip
    work = WindowWork.create(WindowSpec(0, 0, 5), rows, group_by_prefix=True)
    assert list(work.feed) == [3, 4, 1, 2, 0]
