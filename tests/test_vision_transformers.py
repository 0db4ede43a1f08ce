"""Image-text architectures whose vision side runs on transformers' own ``get_image_features`` before
batchgen's native decoder (VipLLaVA: several vision layers concatenated; Idefics2: image splitting into crops
padded under a pixel mask, the perceiver resampler, its processor's seams between images and text;
LightOnOCR: Pixtral's tower at each image's own size): greedy output equals transformers token for token
(float32, CPU), batched and shuffled; images encoded once. Architectures that cannot run are refused by name."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from conftest import job_config, read_parts  # noqa: E402
from vision_helpers import hf_greedy, mixed_images, png_bytes, random_image, shuffled_inputs  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.job.run import run_job  # noqa: E402
from batchgen.models.config import no_images_reason  # noqa: E402
from batchgen.multimodal.tiny import build_llava  # noqa: E402
from batchgen.multimodal.tiny_transformers import (  # noqa: E402
    build_deepseek_vl,
    build_got_ocr2,
    build_idefics2,
    build_lighton_ocr,
    build_paligemma,
)

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def _run_shuffled(ckpt: str, rows, order: list[int]):
    """batchgen's outputs for ``rows`` given in ``order``, checked against transformers' greedy tokens."""
    ref = hf_greedy(ckpt, rows, GREEDY.max_tokens)
    llm = LLM(ckpt, kv_cache_memory="32MiB", max_num_seqs=8)
    outs = llm.generate(shuffled_inputs(rows, order), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(rows)
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in order]
    return llm, ref


def test_vipllava_equals_transformers(tmp_path):
    ckpt = build_llava(tmp_path / "vip", vip_layers=[-2, -1])
    a, b, c = mixed_images(3)
    rows = [
        ("<image> What is it?", [a]),
        ("Compare <image> with <image>", [b, c]),
        ("text only", []),
        ("<image> again, other words", [a]),
    ]
    llm, ref = _run_shuffled(ckpt, rows, [3, 1, 2, 0])
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (4, 3, 3)
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]


def test_idefics2_equals_transformers(tmp_path):
    """Crops of one image differ in size (padded, masked); a word right after an image and two adjacent
    images take the processor's seams (a space; one shared fake token). An image with an alpha band is
    loaded by Idefics2's processor itself (alpha dropped, not composited onto white)."""
    import numpy as np
    from PIL import Image

    ckpt = build_idefics2(tmp_path / "idefics2", splitting=True)
    a, b, c, d = mixed_images(4)
    alpha = np.random.default_rng(5).integers(0, 255, (60, 120, 1), dtype=np.uint8)
    rgba = Image.fromarray(np.concatenate([np.asarray(b), alpha], axis=2), "RGBA")
    rows = [
        ("User:<image>What is in the picture?<end_of_utterance>\nAssistant:", [a]),
        ("Compare <image> with <image>, please.", [b, c]),
        ("No image here, only text.", []),
        ("Two <image><image> adjacent", [d, b]),
        ("<image> again, other text", [a]),
        ("<image> is see-through", [rgba]),
    ]
    llm, ref = _run_shuffled(ckpt, rows, [4, 1, 5, 3, 2, 0])
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (7, 5, 5)
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": c}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]
    # an image job (a list of images per row) writes the same tokens
    job = [0, 1, 3, 5]
    images = pa.array([[png_bytes(im) for im in rows[i][1]] for i in job], type=pa.list_(pa.binary()))
    pq.write_table(pa.table({"prompt": [rows[i][0] for i in job], "image": images}), tmp_path / "in.parquet")
    sampling = {"max_tokens": GREEDY.max_tokens, "temperature": 0.0}
    cfg = job_config(
        ckpt, tmp_path / "in.parquet", tmp_path / "o", data={"image_column": "image"}, sampling=sampling
    )
    assert run_job(cfg).exit_code == 0
    assert [r["token_ids"] for r in read_parts(tmp_path / "o").to_pylist()] == [ref[i] for i in job]


def test_lighton_ocr_equals_transformers(tmp_path):
    """Pixtral's tower takes each image at its own size and aspect ratio (``image_sizes``); a Qwen3 decoder."""
    ckpt = build_lighton_ocr(tmp_path / "lighton")
    a, b, c, d = mixed_images(4)
    rows = [
        ("User:<|image_pad|>What is in the picture?\nAssistant:", [a]),
        ("Compare <|image_pad|> with <|image_pad|>, please.", [b, c]),
        ("No image here, only text.", []),
        ("<|image_pad|> again, other text", [d]),
    ]
    llm, ref = _run_shuffled(ckpt, rows, [3, 1, 2, 0])
    assert llm.engine.images.stats.encoded == 4
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]


def _metaspace_tokenizer(legacy: bool):
    """A SentencePiece-style tokenizer (Llama's, as Idefics2 checkpoints ship): ``▁`` for spaces, one
    prepended at the start of the text (``legacy``: by the normalizer, so after every added token too)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if legacy:
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    corpus = ["What is in the picture? Compare this with that, please. again other text adjacent"] * 20
    tk.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_tokens(["<fake_token_around_image>", "<image>", "<end_of_utterance>"], special_tokens=True)
    return tok


@pytest.mark.parametrize("legacy", [False, True])
def test_idefics2_seams_equal_the_processor_with_sentencepiece_style_tokenizers(tmp_path, legacy):
    from transformers import Idefics2ImageProcessorPil, Idefics2Processor

    from batchgen.multimodal.inputs import ImagePrompts

    tok = _metaspace_tokenizer(legacy)
    image_processor = Idefics2ImageProcessorPil(size={"shortest_edge": 28, "longest_edge": 56})
    proc = Idefics2Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=8)
    proc.save_pretrained(str(tmp_path))
    side = ImagePrompts(str(tmp_path), tok.convert_tokens_to_ids("<image>"))
    a, b = mixed_images(2)
    for text, images in [
        ("User:<image>What is in the picture?", [a]),
        ("Compare <image> with <image>, please.", [a, b]),
        ("Two <image><image> adjacent", [a, b]),
        ("x <image>\nWhat", [a]),
    ]:
        want = proc(text=[text], images=[images])["input_ids"][0]
        assert side.build(tok.encode(text), images).token_ids == want, text


@pytest.mark.parametrize("variant", ["deepseek_vl", "janus", "hybrid"])
def test_deepseek_vl_and_janus_equal_transformers(tmp_path, variant):
    """Every image resized to the tower's size (the hybrid's also to its SAM tower's): a step's images are
    encoded in one call."""
    ckpt = build_deepseek_vl(tmp_path / "ds", janus=variant == "janus", hybrid=variant == "hybrid")
    a, b, c = mixed_images(3)
    rows = [
        ("User:<image_placeholder>What is it?", [a]),
        ("Compare <image_placeholder> with <image_placeholder>.", [b, c]),
        ("<image_placeholder> again", [a]),
    ]
    llm, ref = _run_shuffled(ckpt, rows, [2, 0, 1])
    assert llm.engine.images.stats.encoded == 3


def test_got_ocr2_equals_transformers(tmp_path):
    """A SAM-style tower with convolutions after it; every GOT-OCR2 prompt shows an image."""
    ckpt = build_got_ocr2(tmp_path / "got")
    a, b, c = [*mixed_images(2), random_image(300, 200, 2)]
    rows = [("<img><imgpad></img>\nOCR: ", [a]), ("Two <imgpad><imgpad>, compare.", [b, c])]
    llm, _ = _run_shuffled(ckpt, rows, [1, 0])
    assert llm.engine.images.stats.encoded == 3


def test_architectures_that_cannot_run_are_refused_by_name(tmp_path):
    """An image job on an architecture whose images cannot run here ends with exit status 2 and one line
    naming it and why; the API's image prompts get the same line as their error."""
    ckpt = build_paligemma(tmp_path / "paligemma")
    pq.write_table(pa.table({"prompt": ["<image> a"], "image": [b"x"]}), tmp_path / "in.parquet")
    result = run_job(
        job_config(ckpt, tmp_path / "in.parquet", tmp_path / "o", data={"image_column": "image"})
    )
    assert result.exit_code == 2
    assert "PaliGemmaForConditionalGeneration" in result.message and "bidirectionally" in result.message
    assert "\n" not in result.message
    for arch, why in [
        ("MllamaForConditionalGeneration", "cross-attention"),
        ("Mistral3ForConditionalGeneration", "torchvision"),
        ("Qwen3VLForConditionalGeneration", "M-RoPE"),
        ("Florence2ForConditionalGeneration", "encoder-decoder"),
    ]:
        assert why in no_images_reason(arch), arch
    ovis = {"architectures": ["Ovis2_5ForConditionalGeneration"], "text_config": {"model_type": "qwen3"}}
    assert "language model: qwen3) has not been checked" in no_images_reason(ovis["architectures"][0], ovis)


def test_loading_an_image_text_model_that_cannot_run_names_it_and_why(tmp_path):
    """``LLM(path)`` and a text job over an image-text checkpoint that runs neither with its images nor as a text
    model refuse in one line naming the architecture, why and what runs (not transformers' causal-LM mapping)."""
    import json

    from transformers import MllamaConfig

    paligemma = build_paligemma(tmp_path / "paligemma")
    with pytest.raises(ValueError, match="PaliGemmaForConditionalGeneration.*bidirectionally.*Qwen2-VL"):
        LLM(paligemma, kv_cache_memory="16MiB")
    mllama = tmp_path / "mllama"
    mllama.mkdir()
    config = MllamaConfig().to_dict() | {"architectures": ["MllamaForConditionalGeneration"]}
    (mllama / "config.json").write_text(json.dumps(config))
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "in.parquet")
    result = run_job(job_config(str(mllama), tmp_path / "in.parquet", tmp_path / "o"), print_summary=False)
    assert result.exit_code == 2 and "\n" not in result.message
    assert "MllamaForConditionalGeneration" in result.message and "cross-attention" in result.message
