"""Image-text architectures whose language model has no native implementation run whole on transformers'
modeling code, the language model over batchgen's paged attention (Aya Vision: a Cohere2 decoder with a
sliding-window layer, images tiled by aspect ratio; BLIP-2: OPT after a Q-Former; Aria: a mixture of experts):
greedy output equals transformers token for token (float32, CPU), images of several sizes, two images a row,
batched and shuffled, through the API and a job; each distinct image encoded once. Architectures that still
cannot run are refused by name, with the reason."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from conftest import job_config, read_parts  # noqa: E402
from vision_helpers import hf_greedy, mixed_images, png_bytes, shuffled_inputs  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.job.run import run_job  # noqa: E402
from batchgen.models.config import no_images_reason  # noqa: E402
from batchgen.multimodal.tiny import build_llava  # noqa: E402
from batchgen.multimodal.tiny_transformers import build_idefics2  # noqa: E402
from batchgen.multimodal.tiny_transformers_lm import (  # noqa: E402
    build_aria,
    build_aya_vision,
    build_blip2,
    build_qianfan_ocr,
)

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _check(ckpt: str, rows, order: list[int], job: list[int], tmp_path, **llm_options):
    """batchgen's greedy tokens for ``rows`` (given in ``order``, through ``LLM.generate``) and an image job's
    (rows ``job``, a list of images each) equal transformers'; returns the LLM and the reference."""
    ref = hf_greedy(ckpt, rows, GREEDY.max_tokens)
    llm = LLM(ckpt, kv_cache_memory="32MiB", max_num_seqs=8, **llm_options)
    assert llm.engine.model.config.implementation == "transformers"
    outs = llm.generate(shuffled_inputs(rows, order), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(order)
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in order]
    if job:
        images = pa.array([[png_bytes(im) for im in rows[i][1]] for i in job], type=pa.list_(pa.binary()))
        table = pa.table({"prompt": [rows[i][0] for i in job], "image": images})
        pq.write_table(table, tmp_path / "in.parquet")
        sampling = {"max_tokens": GREEDY.max_tokens, "temperature": 0.0}
        data = {"image_column": "image"}
        cfg = job_config(ckpt, tmp_path / "in.parquet", tmp_path / "o", data=data, sampling=sampling)
        assert run_job(cfg).exit_code == 0
        assert [r["token_ids"] for r in read_parts(tmp_path / "o").to_pylist()] == [ref[i] for i in job]
    return llm, ref


@pytest.fixture(scope="module")
def aya(tmp_path_factory):
    return build_aya_vision(tmp_path_factory.mktemp("aya") / "ckpt")


def test_aya_vision_equals_transformers(aya, tmp_path):
    """Tiles of one image and a global view (one to five tiles by aspect ratio), each after a text marker;
    logits scaled by the head's ``logit_scale``; the same image in two rows encoded once."""
    a, b, c, d = mixed_images(4)
    rows = [
        ("<image> What is in the picture?", [a]),
        ("Compare <image> with <image>, please.", [b, c]),
        ("No image here, only text.", []),
        ("<image> a large one", [d]),
        ("<image> What is in the picture? Say more.", [a]),
    ]
    llm, ref = _check(aya, rows, [3, 1, 4, 2, 0], [1, 2, 3], tmp_path)
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (5, 4, 4)
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]


def test_qianfan_ocr_equals_transformers(tmp_path):
    """Qianfan-OCR: tensors in the original layout that transformers converts when it loads them; the prompt's
    ``<image>`` (not the processor's feature token) marks an image; up to 4 tiles and a thumbnail flattened
    into the batch axis, each image's tiles its own rows."""
    ckpt = build_qianfan_ocr(tmp_path / "ckpt")
    a, b, c, d = mixed_images(4)
    rows = [
        ("User: <image> Read it.", [a]),
        ("Compare <image> with <image>, please.", [b, c]),
        ("No image here, only text.", []),
        ("<image> a large one", [d]),
    ]
    llm, ref = _check(ckpt, rows, [3, 1, 2, 0], [1, 3], tmp_path)
    assert llm.engine.images.stats.encoded == 4
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]


def test_blip2_equals_transformers(tmp_path):
    """An OPT decoder; the Q-Former's query tokens go before the whole prompt (BLIP-2 takes one image a row,
    and the prompt names no place for it), so the prefix cache keys a row's first blocks by its image."""
    a, b, c, d = mixed_images(4)
    rows = [
        ("Question: what is in the picture? Answer:", [a]),
        ("A photo of", [b]),
        ("", [c]),
        ("Question: what is in the picture? Answer: it is", [a]),
        ("Describe it.", [d]),
    ]
    llm, _ = _check(build_blip2(tmp_path / "blip2"), rows, [4, 0, 2, 3, 1], [0, 2, 3, 4], tmp_path)
    assert llm.engine.images.stats.encoded == 4
    two = llm.generate({"prompt": "x", "multi_modal_data": {"image": [a, b]}}, GREEDY, use_tqdm=False)
    assert "one per prompt" in two[0].error
    # the image's tokens come first: the same image shares its KV blocks, another image with the same text none
    same, other = (
        llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": im}}, GREEDY, use_tqdm=False)[0]
        for im in (a, b)
    )
    assert same.num_cached_tokens > 0 and other.num_cached_tokens == 0
    assert llm.engine.images.stats.encoded == 4


def test_an_empty_prompt_needs_an_image(tmp_path):
    """In an image job an empty prompt is a caption request when the row has an image, and an error row
    naming the problem when it has none."""
    ckpt = build_blip2(tmp_path / "blip2")
    (a,) = mixed_images(1)
    ref = hf_greedy(ckpt, [("", [a])], GREEDY.max_tokens)
    images = pa.array([[png_bytes(a)], [], None], type=pa.list_(pa.binary()))
    pq.write_table(pa.table({"prompt": ["", "", ""], "image": images}), tmp_path / "in.parquet")
    sampling = {"max_tokens": GREEDY.max_tokens, "temperature": 0.0}
    cfg = job_config(
        ckpt, tmp_path / "in.parquet", tmp_path / "o", data={"image_column": "image"}, sampling=sampling
    )
    cfg.run.max_error_fraction = 1.0
    assert run_job(cfg).exit_code == 0
    out = read_parts(tmp_path / "o").to_pylist()
    assert out[0]["token_ids"] == ref[0]
    assert [r["error"] for r in out] == [None, "prompt is empty", "prompt is empty"]


def test_aria_equals_transformers(tmp_path):
    """A mixture-of-experts text model; images resized into 980 px and padded under a pixel mask."""
    a, b, c, d = mixed_images(4)
    rows = [
        ("<|img|> What is in the picture?", [d]),
        ("Compare <|img|> with <|img|>, please.", [b, c]),
        ("No image here.", []),
        ("<|img|> again", [a]),
    ]
    _check(build_aria(tmp_path / "aria"), rows, [3, 1, 2, 0], [1], tmp_path)


@pytest.mark.parametrize("family", ["llava_next", "idefics2"])
def test_native_families_run_whole_on_transformers_with_model_impl(tmp_path, family):
    """``model_impl="transformers"`` on an image-text checkpoint with a native language model runs it whole on
    transformers' code too: LLaVA-NeXT (each image's token count set by its aspect ratio, taken from the
    model's own per-image split), Idefics2 (its ``text_model``, crops under a pixel mask)."""
    a, b, c, d = mixed_images(4)
    if family == "llava_next":
        ckpt = build_llava(tmp_path / family, next_grid=[[56, 112], [112, 56], [112, 112]])
        rows = [
            ("USER: <image>\nWhat is it? ASSISTANT:", [a]),
            ("Compare <image> with <image>", [b, c]),
            ("<image> big", [d]),
        ]
    else:
        ckpt = build_idefics2(tmp_path / family)
        rows = [("User:<image>What is in the picture?", [a]), ("Two <image><image> adjacent", [d, b])]
    _check(ckpt, rows, list(range(len(rows)))[::-1], [], tmp_path, model_impl="transformers")


def test_native_only_is_refused_with_the_way_out(aya):
    with pytest.raises(ValueError, match="model.implementation=transformers"):
        LLM(aya, model_impl="native")


def test_architectures_that_cannot_run_are_refused_by_name():
    for arch, why in [
        ("Llama4ForConditionalGeneration", "fixed chunks"),
        ("InstructBlipForConditionalGeneration", "Q-Former reads the prompt"),
        ("MllamaForConditionalGeneration", "cross-attention"),
        ("FuyuForCausalLM", "rewrites the whole prompt"),
        ("Granite4VisionForConditionalGeneration", "inside its language model's layers"),
        ("PaddleOCRVLForConditionalGeneration", "M-RoPE"),
        ("HunYuanVLForConditionalGeneration", "M-RoPE"),
    ]:
        assert why in no_images_reason(arch), arch
    assert "short-convolution" in no_images_reason("Lfm2VlForConditionalGeneration")
    exaone = {
        "architectures": ["Exaone4_5_ForConditionalGeneration"],
        "text_config": {"model_type": "exaone4"},
    }
    assert "(language model: exaone4) has not been checked" in no_images_reason(
        exaone["architectures"][0], exaone
    )
