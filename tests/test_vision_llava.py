"""LLaVA through batchgen: greedy output equals transformers token for token (float32, CPU) with images of
several sizes and aspect ratios, several images per row, batched; each distinct image encoded once; placeholder
blocks shared by the prefix cache only for the same image; a bad image fails its row alone."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from vision_helpers import hf_greedy, png_bytes, random_image  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.multimodal.tiny import build_llava  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llm(llava) -> LLM:
    return LLM(llava, kv_cache_memory="32MiB", max_num_seqs=8)


def _chat(text: str, n_images: int = 1) -> str:
    return f"<|im_start|>user\n{'<image>' * n_images}\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_equals_transformers_batched(llava, llm, tmp_path):
    a, b, c, d = (
        random_image(w, h, s) for s, (w, h) in enumerate([(56, 56), (120, 60), (40, 90), (300, 200)])
    )
    path = tmp_path / "d.jpg"  # a JPEG far larger than the processor's 56 px: decoded at full scale
    d.save(path, format="JPEG")
    from PIL import Image

    jpeg = Image.open(path).convert("RGB")
    rows = [
        (_chat("What is in the picture?"), [a]),
        ("Compare <image> with <image>, please.", [b, c]),
        (_chat("Describe it."), [a]),  # the same image again, other text
        ("<image>", [jpeg]),
        ("No image here, only text.", []),
        (_chat("Two of them", 2), [c, d]),
    ]
    ref = hf_greedy(llava, rows, GREEDY.max_tokens)
    inputs = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in rows]
    inputs[3] = {"prompt": "<image>", "multi_modal_data": {"image": str(path)}}  # a path, not a PIL image
    outs = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(rows)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert outs[1].prompt == rows[1][0]
    # the images matter: the same question about another image answers differently
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]


def test_encoder_runs_only_the_layers_it_reads_with_transformers_features(llava, llm):
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    encoder = llm.engine.model.encoder
    tower = getattr(encoder.vision_tower, "vision_model", encoder.vision_tower)  # transformers 4.x / 5.x
    # the tiny checkpoint reads the second-to-last layer: the last one is never run
    assert len(tower.encoder.layers) == hf.config.vision_config.num_hidden_layers - 1
    images = [random_image(56, 56, 20), random_image(90, 40, 21)]
    pixels = AutoProcessor.from_pretrained(llava)(text=["<image>"] * 2, images=images, return_tensors="pt")
    with torch.inference_mode():
        ref = hf.model.get_image_features(pixels["pixel_values"]).pooler_output
    ours = encoder.encode([{"pixel_values": p} for p in pixels["pixel_values"]])
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_each_distinct_image_decoded_and_processed_once_across_worker_threads(llava):
    import torch

    from batchgen.multimodal.images import ImageLoader
    from batchgen.multimodal.inputs import ImagePrompts
    from batchgen.multimodal.prepare import prepare

    class Counting(ImageLoader):
        decoded: list[str] = []

        def decode(self, data, name="<bytes>", digest=None):
            image = super().decode(data, name, digest)
            Counting.decoded.append(image.hash)
            return image

    side = ImagePrompts(llava, _image_token_id(llava), loader=Counting())
    images = [png_bytes(random_image(40 + 10 * i, 50, 30 + i)) for i in range(3)]
    ids = side.processor.tokenizer.encode(_chat("What is it?"))
    rows = [(ids, [images[i % 3]]) for i in range(20)] + [(ids, [images[0][:70]])]  # and a truncated one
    ready = prepare(side, rows)
    assert len(Counting.decoded) == len(set(Counting.decoded)) == 3  # each distinct image decoded once
    assert "image 0: image '<70 bytes>': corrupt or truncated" in ready[-1]
    fresh = ImagePrompts(llava, _image_token_id(llava))
    for (t, ims), got in zip(rows[:3], ready):
        want = fresh.build(t, ims)
        assert got.token_ids == want.token_ids and got.images[0].hash == want.images[0].hash
        assert torch.equal(got.images[0].pixels["pixel_values"], want.images[0].pixels["pixel_values"])


def _image_token_id(ckpt: str) -> int:
    import json
    from pathlib import Path

    return json.loads((Path(ckpt) / "config.json").read_text())["image_token_index"]


def test_the_engine_steps_while_later_images_are_still_prepared(llava, monkeypatch):
    import threading

    from batchgen.multimodal.prepare import image_prompts_for

    llm = LLM(llava, kv_cache_memory="32MiB", max_num_seqs=8)
    stepped = threading.Event()
    llm.engine.add_step_listener(lambda info: stepped.set())
    side = image_prompts_for(llm.engine)
    build, slow = side.build, random_image(60, 60, 41)

    def late_build(token_ids, images):
        if images[0] is slow:  # ready only once the engine has run the rows before it
            assert stepped.wait(60), "the engine waited for every image before its first step"
        return build(token_ids, images)

    monkeypatch.setattr(side, "build", late_build)
    rows = [(_chat(f"row {i}"), [random_image(56, 56, 40)]) for i in range(3)] + [(_chat("late"), [slow])]
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in rows], GREEDY, use_tqdm=False
    )
    assert [o.error for o in outs] == [None] * 4
    assert outs[3].outputs[0].token_ids == hf_greedy(llava, rows[3:], GREEDY.max_tokens)[0]


def test_each_distinct_image_encoded_once_and_blocks_shared_by_image(llava):
    llm = LLM(llava, kv_cache_memory="32MiB", max_num_seqs=8, block_size=8)
    a, b = random_image(64, 64, 10), random_image(64, 64, 11)
    prompt = "<image> " + "and the question is long enough to fill blocks"
    q = [{"prompt": prompt + f" number {i}", "multi_modal_data": {"image": a}} for i in range(4)]
    first = llm.generate(q[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(q[1:], GREEDY, use_tqdm=False)
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (4, 1, 1)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 16 for o in rest)  # the image's 16 placeholder tokens: 2 full blocks
    # a different image with the same text shares no placeholder block
    other = llm.generate(
        {"prompt": prompt + " number 0", "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False
    )
    assert other[0].num_cached_tokens == 0
    assert llm.engine.images.stats.encoded == 2


def test_evicted_features_are_encoded_again_and_still_exact(llava):
    llm = LLM(llava, kv_cache_memory="32MiB", encoder_cache_memory="1KiB", enable_prefix_caching=False)
    a = random_image(56, 56, 3)
    rows = [(_chat("first"), [a]), (_chat("second"), [a])]
    outs = [
        llm.generate({"prompt": t, "multi_modal_data": {"image": ims}}, GREEDY, use_tqdm=False)[0]
        for t, ims in rows
    ]
    assert llm.engine.images.stats.encoded == 2  # 16 x 64 float32 features never fit 1 KiB
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llava, rows, GREEDY.max_tokens)


def test_bad_images_fail_their_row_alone(llava, tmp_path):
    llm = LLM(llava, kv_cache_memory="32MiB", max_model_len=40, limit_mm_per_prompt={"image": 2})
    good = random_image(56, 56, 1)
    rows = [
        {"prompt": "<image> ok", "multi_modal_data": {"image": good}},
        {"prompt": "<image> corrupt", "multi_modal_data": {"image": png_bytes(good)[:80]}},
        {"prompt": "<image> missing", "multi_modal_data": {"image": str(tmp_path / "nope.png")}},
        {"prompt": "<image><image><image> three", "multi_modal_data": {"image": [good] * 3}},
        {
            "prompt": "<image><image> is too long for forty tokens once both images are expanded",
            "multi_modal_data": {"image": [good, good]},
        },
        {"prompt": "no placeholder", "multi_modal_data": {"image": good}},
        {"prompt": "<image> <image> one image", "multi_modal_data": {"image": good}},
        {"prompt": "<image> a <image> b <image> c", "multi_modal_data": {"image": good}},
    ]
    outs = llm.generate(rows, GREEDY, use_tqdm=False)
    errors = [o.error for o in outs]
    assert errors[0] is None and len(outs[0].outputs[0].token_ids) > 0
    assert "image 0" in errors[1] and "corrupt or truncated" in errors[1]
    assert "no such file" in errors[2]
    assert "at most 2 per prompt" in errors[3]
    assert "engine.max_model_len is 40" in errors[4]
    assert "0 image placeholder(s)" in errors[5]
    assert "more image placeholder(s)" in errors[6] and "more image placeholder(s)" in errors[7]
    assert all(o.outputs[0].finish_reason == "error" for o in outs[1:])


def test_a_text_model_refuses_images(llama_ckpt):
    llm = LLM(llama_ckpt, kv_cache_memory="16MiB")
    out = llm.generate(
        {"prompt": "hi", "multi_modal_data": {"image": random_image(8, 8, 0)}}, GREEDY, use_tqdm=False
    )
    assert "takes no images" in out[0].error


def test_chat_with_image_parts_uses_the_processor_template(llava, llm, tmp_path):
    a, b = random_image(70, 50, 21), random_image(50, 70, 22)
    import base64

    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(b)).decode()
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(a))
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"file://{path}"}},
                    {"type": "text", "text": "What is shown?"},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image_url", "image_url": {"url": data_url}},
                    {"type": "image", "image": a},
                ],
            }
        ],
        [{"role": "user", "content": "plain text turn"}],
        [  # vLLM's other part shapes, over turns after a system message
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "image_pil", "image_pil": b}, {"type": "text", "text": "This?"}],
            },
            {"role": "assistant", "content": "A picture."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "And"},
                    {"type": "input_image", "image_url": data_url},
                    {"image_url": f"file://{path}"},
                ],
            },
        ],
    ]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(llava)
    rows = []
    for conv, images in zip(conversations, [[a], [b, a], [], [b, b, a]]):
        hf_conv = [
            {
                **m,
                "content": [
                    {"type": "text", "text": p["text"]} if "text" in p else {"type": "image"}
                    for p in m["content"]
                ],
            }
            if isinstance(m["content"], list)
            else m
            for m in conv
        ]
        rows.append((proc.apply_chat_template(hf_conv, add_generation_prompt=True), images))
    assert [o.prompt for o in outs] == [r[0] for r in rows]
    assert [o.error for o in outs] == [None] * 4
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llava, rows, GREEDY.max_tokens)


def test_chat_takes_transformers_image_parts_as_its_processor_does(llava, llm, tmp_path):
    """The image parts of transformers' chat format (``url``, ``path``, ``base64``): the same messages through
    the processor's own ``apply_chat_template``, which loads the images, give the same tokens."""
    import base64

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    a, b = png_bytes(random_image(70, 50, 85)), png_bytes(random_image(50, 70, 86))
    (tmp_path / "a.png").write_bytes(a)
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "image", "path": str(tmp_path / "a.png")},
                {"type": "text", "text": "and"},
                {"type": "image", "url": (tmp_path / "a.png").as_uri()},
                {"type": "image", "base64": base64.b64encode(b).decode()},
            ],
        },
    ]
    out = llm.chat([conversation], GREEDY, use_tqdm=False)[0]
    assert out.error is None
    hf_conversation = [dict(m, content=list(m["content"])) for m in conversation]
    hf_conversation[1]["content"][2] = {"type": "image", "path": str(tmp_path / "a.png")}  # no file:// there
    enc = AutoProcessor.from_pretrained(llava).apply_chat_template(
        hf_conversation, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    gen = model.generate(**enc, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    assert out.prompt_token_ids == enc["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == gen[0, enc["input_ids"].shape[1] :].tolist()


def test_llava_next_any_resolution_equals_transformers(tmp_path_factory):
    """LLaVA-NeXT: the token count follows each image's size and aspect ratio (tiles, unpadding, newlines)."""
    ckpt = build_llava(tmp_path_factory.mktemp("llava_next"), next_grid=[[56, 112], [112, 56], [112, 112]])
    imgs = [
        random_image(w, h, 30 + i) for i, (w, h) in enumerate([(56, 56), (120, 60), (60, 130), (300, 200)])
    ]
    rows = [
        ("<image> what is it?", [imgs[0]]),
        ("Compare <image> and <image>", [imgs[1], imgs[2]]),
        (_chat("Describe it."), [imgs[3]]),
        (_chat("Again"), [imgs[1]]),
    ]
    llm = LLM(ckpt, kv_cache_memory="32MiB")
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in rows], GREEDY, use_tqdm=False
    )
    assert [o.error for o in outs] == [None] * len(rows)
    counts = [o.prompt_token_ids.count(llm.engine.model.image_token_id) for o in outs]
    assert counts[0] != counts[3] and counts[2] != counts[3]  # each image's size gives its own token count
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ckpt, rows, GREEDY.max_tokens)
    assert llm.engine.images.stats.encoded == 4


@pytest.mark.parametrize("next_grid", [None, [[56, 112], [112, 56]]])
def test_a_qwen2_language_model_equals_transformers(tmp_path, next_grid):
    """LLaVA and LLaVA-NeXT over another native family (LLaVA-Interleave's Qwen2: q/k/v biases): the language
    model is the one ``text_config`` names, not a Llama."""
    ckpt = build_llava(tmp_path / "ckpt", next_grid=next_grid, text_model_type="qwen2")
    llm = _equals_transformers_on_two_images(ckpt, 80)
    assert llm.engine.model.language_model.config.qkv_bias


def _equals_transformers_on_two_images(ckpt: str, seed: int) -> LLM:
    """Greedy output on one image, two images and none equals transformers'; the LLM."""
    imgs = [random_image(56, 56, seed), random_image(120, 40, seed + 1)]
    rows = [("<image> what is it?", [imgs[0]]), ("Compare <image> and <image>", imgs), ("text only", [])]
    llm = LLM(ckpt, kv_cache_memory="16MiB")
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in rows],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(ckpt, rows, GREEDY.max_tokens)
    return llm


def test_numpy_pixels_and_path_objects_equal_transformers(llava, llm, tmp_path):
    """A numpy array of pixels is one image, as transformers' processor takes it; a ``pathlib.Path`` is a path."""
    import numpy as np

    a, b = np.asarray(random_image(70, 50, 83)), random_image(40, 90, 84)
    (tmp_path / "b.png").write_bytes(png_bytes(b))
    rows = [("<image> an array", [a]), ("<image> and <image>", [a, b])]
    inputs = [
        {"prompt": rows[0][0], "multi_modal_data": {"image": a}},
        {"prompt": rows[1][0], "multi_modal_data": {"image": [a, tmp_path / "b.png"]}},
    ]
    outs = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llava, rows, GREEDY.max_tokens)


def test_the_processors_own_ids_for_adjacent_images_equal_transformers(llava, llm):
    """Adjacent images the processor expanded already are one run of feature tokens: it is split by the images'
    lengths, not taken for one placeholder per token."""
    from transformers import AutoProcessor

    rows = [("Two <image><image> adjacent", [random_image(56, 56, 87), random_image(90, 40, 88)])]
    ids = AutoProcessor.from_pretrained(llava)(text=[rows[0][0]], images=rows[0][1])["input_ids"][0]
    out = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": rows[0][1]}}, GREEDY, use_tqdm=False
    )
    assert out[0].error is None and out[0].prompt_token_ids == list(ids)
    assert [out[0].outputs[0].token_ids] == hf_greedy(llava, rows, GREEDY.max_tokens)


def test_none_for_the_image_options_is_none_given(llava):
    """``mm_processor_kwargs=None`` and ``limit_mm_per_prompt=None`` (vLLM's defaults) mean no options."""
    llm = LLM(llava, kv_cache_memory="16MiB", mm_processor_kwargs=None, limit_mm_per_prompt=None)
    image = random_image(56, 56, 82)
    out = llm.generate({"prompt": "<image> hi", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    assert out[0].error is None and out[0].outputs[0].token_ids


def test_preemption_and_async_scheduling_keep_image_rows_exact(llava):
    """A pool too small for every row at once preempts (recompute: the image's features come back from the
    encoder cache or are encoded again), and async scheduling runs forwards in a worker thread: same tokens."""
    imgs = [random_image(56 + 8 * i, 56, 50 + i) for i in range(4)]
    rows = [(_chat(f"question {i}"), [imgs[i % 4]]) for i in range(8)]
    ref = hf_greedy(llava, rows, 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=False)
    inputs = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in rows]
    small = LLM(llava, num_blocks=12, block_size=8, max_num_seqs=8, encoder_cache_memory="5KiB")
    outs = small.generate(inputs, params, use_tqdm=False)
    assert small.engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    pipelined = LLM(llava, kv_cache_memory="32MiB", async_scheduling=True)
    assert [o.outputs[0].token_ids for o in pipelined.generate(inputs, params, use_tqdm=False)] == ref


def _transparent(mode: str):
    """A random image in ``mode`` with transparency: an alpha band (RGBA, LA) or a palette's transparent index."""
    import numpy as np
    from PIL import Image

    rgb = random_image(70, 50, 60)
    if mode == "P":
        image = rgb.convert("P", palette=Image.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        return image
    base = np.array(rgb.convert(mode[:-1]))
    alpha = np.random.default_rng(61).integers(0, 255, base.shape[:2], dtype=np.uint8)
    return Image.fromarray(np.dstack([base, alpha]), mode)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_get_the_processors_pixels(llava, mode, tmp_path):
    """Transparency is composited onto white, as transformers' processor does with the opened file."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    path = tmp_path / f"{mode}.png"
    _transparent(mode).save(path, **({"transparency": 3} if mode == "P" else {}))
    from batchgen.multimodal.inputs import ImagePrompts

    want = AutoProcessor.from_pretrained(llava).image_processor(
        images=[Image.open(path)], return_tensors="pt"
    )

    side = ImagePrompts(llava, _image_token_id(llava))
    for source in (str(path), Image.open(path)):  # the file, and the opened image passed as it is
        got = side.pixels(side.loader.read(source)).pixels["pixel_values"]
        assert torch.equal(got, want["pixel_values"][0]), source


def test_an_image_the_encoder_fails_on_fails_its_requests_alone(llava):
    """The vision tower raising on one image (its batch fails, then it fails alone) fails the requests that
    show it, with the reason; the other requests of the same steps answer as without it, and the image is not
    encoded again for a later request."""
    good, bad, other = random_image(60, 60, 31), random_image(70, 50, 32), random_image(50, 70, 33)
    rows = [(_chat("What is it?"), [good]), (_chat("And this?"), [bad]), (_chat("This one?"), [other])]
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in rows]
    want = LLM(llava, kv_cache_memory="16MiB").generate(inputs, GREEDY, use_tqdm=False)
    llm = LLM(llava, kv_cache_memory="16MiB")
    encoder = llm.engine.model.encoder
    marker = float(encoder_input_sum(llm, bad))
    real = encoder.encode

    def fragile(pixels):
        if any(abs(float(p["pixel_values"].sum()) - marker) < 1e-3 for p in pixels):
            raise RuntimeError("tower\nfailed")
        return real(pixels)

    encoder.encode = fragile
    outs = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [
        want[0].outputs[0].token_ids,
        want[2].outputs[0].token_ids,
    ]
    assert outs[1].error == "image 0: the vision encoder failed on this image: RuntimeError: tower failed"
    assert outs[1].outputs[0].finish_reason == "error"
    again = llm.generate(inputs[1], GREEDY, use_tqdm=False)[0]
    assert again.error == outs[1].error and llm.engine.images.stats.encoded == 2


def encoder_input_sum(llm: LLM, image) -> float:
    """The sum of the processor's pixels for ``image`` (what the encoder is given for it)."""
    from batchgen.multimodal.prepare import image_prompts_for

    side = image_prompts_for(llm.engine)
    return float(side.pixels(side.load([image])[0]).pixels["pixel_values"].sum())


def test_a_language_model_without_a_native_implementation_runs_on_transformers(tmp_path):
    """LLaVA over a family batchgen does not run natively (Phi) runs whole on transformers' modeling code with
    model.implementation=auto (it was read as a Llama), and is refused by name with native."""
    from batchgen.models.config import NativeUnsupportedError

    ckpt = build_llava(tmp_path / "ckpt", text_model_type="phi")
    _equals_transformers_on_two_images(ckpt, 85)
    with pytest.raises(NativeUnsupportedError, match="'phi', which has no native implementation"):
        LLM(ckpt, kv_cache_memory="16MiB", model_impl="native")
