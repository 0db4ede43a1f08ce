"""Image jobs over several engine replicas: ``engine.data_parallel_size=2`` (local processes, and Ray actors with
``run.executor=ray``) writes what one engine writes (greedy), each replica's encoder cache keyed by the same
image hashes, the report and the printed summary counting the job's images; the Ray Data stage
(``batchgen.ray.Generator``) takes an image column too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from conftest import batchgen_cli, job_config, part_contents  # noqa: E402
from vision_helpers import png_bytes, random_image  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.job.run import EXIT_OK, run_job  # noqa: E402
from batchgen.multimodal.tiny import build_llava  # noqa: E402

GREEDY = {"max_tokens": 6, "temperature": 0.0}
N = 12


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return build_llava(tmp_path_factory.mktemp("llava_dp"))


@pytest.fixture(scope="module")
def image_rows(tmp_path_factory) -> Path:
    """12 rows over 3 images (by path), one row whose image is missing; windows of 4 rows."""
    root = tmp_path_factory.mktemp("dp_images")
    paths = []
    for i, (w, h) in enumerate([(56, 56), (90, 60), (60, 90)]):
        p = root / f"img{i}.png"
        p.write_bytes(png_bytes(random_image(w, h, 70 + i)))
        paths.append(str(p))
    table = pa.table(
        {
            "prompt": [f"<image> question {i % 4}" for i in range(N)],
            "image": [paths[i % 3] if i != 7 else str(root / "gone.png") for i in range(N)],
        }
    )
    pq.write_table(table, root / "in.parquet")
    return root / "in.parquet"


@pytest.fixture(scope="module")
def one_engine(llava: str, image_rows: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp1") / "out"
    cfg = _cfg(llava, image_rows, out, dp=1)
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    return out


def _cfg(ckpt: str, inp: Path, out: Path, dp: int, executor: str = "local"):
    cfg = job_config(ckpt, inp, out, data={"image_column": "image", "window_rows": 4},
                     engine={"data_parallel_size": dp}, sampling=GREEDY)  # fmt: skip
    cfg.run.max_error_fraction = 1.0
    cfg.run.executor = executor
    return cfg


def test_cli_image_job_on_two_replicas_equals_one_engine(llava, image_rows, one_engine, tmp_path) -> None:
    args = [f"model.path={llava}", f"data.input={image_rows}", "data.output=out", "data.image_column=image",
            "data.window_rows=4", "engine.data_parallel_size=2", "engine.num_blocks=256", "engine.max_num_seqs=8",
            "sampling.max_tokens=6", "sampling.temperature=0", "run.max_error_fraction=1",
            "run.progress=off"]  # fmt: skip
    p = batchgen_cli(args, tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert part_contents(tmp_path / "out") == part_contents(one_engine)
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    images = report["images"]
    assert images["references"] == N - 1 and images["distinct"] == 3
    assert 3 <= images["encoded"] <= 6  # each replica encodes the images of its windows once
    assert 0.0 <= images["encoder_share"] <= 1.0
    assert 0.0 <= report["kv"]["peak_fragmentation"] <= 1.0  # the replicas' KV figures combined
    assert f"{N - 1} references, 3 distinct, {images['encoded']} encoded" in p.stdout
    assert "image encoder" in p.stdout and "replica 1" in p.stdout


@pytest.mark.slow
def test_ray_executor_image_job_equals_one_engine(llava, image_rows, one_engine, tmp_path) -> None:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'batchgen[ray]')")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        res = run_job(_cfg(llava, image_rows, tmp_path / "ray", dp=2, executor="ray"), handle_signals=False,
                      print_summary=False)  # fmt: skip
    finally:
        ray.shutdown()
    assert res.exit_code == EXIT_OK, res.message
    assert part_contents(tmp_path / "ray") == part_contents(one_engine)
    assert res.report["images"]["distinct"] == 3 and res.report["executor"] == "ray"


def test_ray_generator_takes_an_image_column(llava, image_rows) -> None:
    from batchgen.ray import Generator

    t = pq.read_table(image_rows).slice(4, 5)  # rows 4..8: row 7's image is missing
    gen = Generator(llava, sampling=GREEDY, engine={"device": "cpu", "num_blocks": 256}, image_column="image")
    out = gen({name: np.array(t.column(name).to_pylist(), dtype=object) for name in t.column_names})
    assert list(out["status"]) == ["ok", "ok", "ok", "error", "ok"] and "gone.png" in out["error"][3]
    llm = LLM(llava, kv_cache_memory="32MiB")
    rows = t.to_pylist()
    want = llm.generate(
        [
            {"prompt": r["prompt"], "multi_modal_data": {"image": r["image"]}}
            for i, r in enumerate(rows)
            if i != 3
        ],
        SamplingParams(**GREEDY),
        use_tqdm=False,
    )
    got = [list(x) for i, x in enumerate(out["token_ids"]) if i != 3]
    assert got == [o.outputs[0].token_ids for o in want]
    with pytest.raises(ValueError, match="not an image-text checkpoint"):
        Generator(None, image_column="image")
