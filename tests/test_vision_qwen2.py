"""Qwen2-VL and Qwen2.5-VL through batchgen: dynamic resolution and M-RoPE positions; greedy output equals
transformers token for token (float32, CPU) with images of several sizes and aspect ratios, several images per
row, batched and shuffled; placeholder blocks shared by the prefix cache only for the same image."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from vision_helpers import hf_greedy_qwen_vl, random_image  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.multimodal.tiny import QWEN_IMAGE, build_qwen2_vl  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10)
IMG = QWEN_IMAGE


@pytest.fixture(scope="module", params=["2", "2.5"])
def qwen_vl(request, tmp_path_factory) -> str:
    return build_qwen2_vl(tmp_path_factory.mktemp(f"qwen{request.param}_vl"), version=request.param)


def _rows():
    a, b, c, d = (
        random_image(w, h, s) for s, (w, h) in enumerate([(56, 56), (120, 60), (40, 90), (300, 200)])
    )
    return [
        (f"<|im_start|>user\n{IMG}What is in the picture?<|im_end|>\n<|im_start|>assistant\n", [a]),
        (f"Compare {IMG} with {IMG}, please.", [b, c]),
        (f"{IMG}", [d]),  # a large image: resized within the processor's pixel bounds
        ("No image here, only text.", []),
        (f"Two of them: {IMG} and then {IMG} at the end", [d, b]),
        (f"{IMG} again, other text", [a]),
    ]


def test_greedy_equals_transformers_batched_and_shuffled(qwen_vl):
    rows = _rows()
    ref = hf_greedy_qwen_vl(qwen_vl, rows, GREEDY.max_tokens)
    llm = LLM(qwen_vl, kv_cache_memory="32MiB", max_num_seqs=8)
    order = [4, 0, 3, 2, 5, 1]
    inputs = [
        {"prompt": rows[i][0], "multi_modal_data": {"image": rows[i][1]}} if rows[i][1] else rows[i][0]
        for i in order
    ]
    outs = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(rows)
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in order]
    # an image the processor refuses (aspect ratio over 200) is that prompt's error; the others run
    thin = {"prompt": rows[0][0], "multi_modal_data": {"image": random_image(2000, 5, 7)}}
    refused, fine = llm.generate([thin, inputs[1]], GREEDY, use_tqdm=False)
    assert refused.error.startswith(
        "image 0: the image processor cannot take this 2000x5 image (ValueError: "
    )
    assert fine.error is None and fine.outputs[0].token_ids == ref[order[1]]
    # M-RoPE matters: the same rows with plain 1-D positions answer differently
    tables = llm.engine.builder.input_batch.token_inputs
    tables.remove(llm.engine.images.token_positions)
    plain = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [ref[i] for i in order]


def test_rope_positions_equal_transformers_rope_index(qwen_vl):
    import torch
    from transformers import AutoModelForImageTextToText

    from batchgen.multimodal.prepare import image_prompts_for

    llm = LLM(qwen_vl, kv_cache_memory="16MiB")
    text, images = _rows()[4]
    side = image_prompts_for(llm.engine)
    ready = side.build(llm.engine.tokenizer.encode(text), images)
    pos, delta = llm.engine.model.rope_positions(len(ready.token_ids), ready.images)
    hf = AutoModelForImageTextToText.from_pretrained(qwen_vl, dtype=torch.float32)
    ids = torch.tensor([ready.token_ids])
    grid = torch.stack([im.pixels["image_grid_thw"] for im in ready.images])
    ref, ref_delta = hf.model.get_rope_index(ids, (ids == side.image_token_id).int(), image_grid_thw=grid)
    assert np.array_equal(pos, ref[:, 0].numpy()) and delta == int(ref_delta)
    assert delta < 0  # text after an image advances by max(grid)/merge, not its tokens


def test_each_image_encoded_once_and_blocks_shared_by_image(qwen_vl):
    llm = LLM(qwen_vl, kv_cache_memory="32MiB", max_num_seqs=8, block_size=8)
    a, b = random_image(112, 112, 10), random_image(112, 112, 11)  # 16 placeholder tokens each
    prompt = f"{IMG} and the question is long enough to fill blocks"
    q = [{"prompt": prompt + f" number {i}", "multi_modal_data": {"image": a}} for i in range(3)]
    first = llm.generate(q[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(q[1:], GREEDY, use_tqdm=False)
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (3, 1, 1)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 16 for o in rest)
    other = llm.generate(
        {"prompt": prompt + " number 0", "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False
    )
    assert other[0].num_cached_tokens == 0  # a different image shares no placeholder block
    ref = hf_greedy_qwen_vl(qwen_vl, [(prompt + " number 1", [a]), (prompt + " number 0", [b])], 10)
    assert [rest[0].outputs[0].token_ids, other[0].outputs[0].token_ids] == ref


def test_chat_with_image_parts(qwen_vl):
    llm = LLM(qwen_vl, kv_cache_memory="16MiB")
    im = random_image(84, 56, 5)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": im}, {"type": "text", "text": "What is it?"}],
        }
    ]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = f"<|im_start|>user\n{IMG}What is it?<|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == hf_greedy_qwen_vl(qwen_vl, [(text, [im])], 10)[0]


def test_flat_config_of_the_first_releases_parses():
    """Qwen2-VL's hub checkpoints keep the text settings at the top level, M-RoPE in ``rope_scaling``."""
    from batchgen.models.config import ModelConfig
    from batchgen.models.vision_qwen2 import _mrope_section

    flat = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 4160,
        "max_position_embeddings": 1024,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": 4098,
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
    }
    cfg = ModelConfig.from_dict(flat)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.multimodal) == ("default", 1000000.0, True)
    assert (cfg.num_layers, cfg.hidden_size) == (2, 64)
    assert _mrope_section(flat) == [2, 3, 3]


def test_preemption_and_async_scheduling_keep_positions_exact(qwen_vl):
    """Preempted rows recompute their prompt and generated tokens with the same M-RoPE positions; async
    scheduling builds a step's positions while the previous one runs: same tokens as transformers."""
    imgs = [random_image(56 + 28 * i, 56, 50 + i) for i in range(3)]
    rows = [(f"{IMG} question {i}", [imgs[i % 3]]) for i in range(6)]
    ref = hf_greedy_qwen_vl(qwen_vl, rows, 20)
    params = SamplingParams(temperature=0, max_tokens=20)
    inputs = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in rows]
    small = LLM(qwen_vl, num_blocks=8, block_size=8, max_num_seqs=6, encoder_cache_memory="1KiB")
    outs = small.generate(inputs, params, use_tqdm=False)
    assert small.engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    pipelined = LLM(qwen_vl, kv_cache_memory="32MiB", async_scheduling=True)
    assert [o.outputs[0].token_ids for o in pipelined.generate(inputs, params, use_tqdm=False)] == ref


def test_image_job_equals_transformers(qwen_vl, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config, read_parts
    from vision_helpers import png_bytes

    from batchgen.job.run import run_job

    rows = _rows()
    table = pa.table(
        {
            "prompt": [t for t, _ in rows],
            "image": [[png_bytes(im) for im in ims] for _, ims in rows],
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    sampling = {"max_tokens": 8, "temperature": 0.0}
    cfg = job_config(
        qwen_vl, tmp_path / "in.parquet", tmp_path / "out", data={"image_column": "image"}, sampling=sampling
    )
    assert run_job(cfg).exit_code == 0
    got = read_parts(tmp_path / "out").to_pylist()
    assert [r["status"] for r in got] == ["ok"] * len(rows)
    assert [r["token_ids"] for r in got] == hf_greedy_qwen_vl(qwen_vl, rows, 8)


def test_mm_processor_kwargs_bound_the_image_tokens_as_transformers_does(qwen_vl):
    """``mm_processor_kwargs`` (vLLM's name) go to the processor for every image: ``max_pixels`` shrinks a large
    image's grid, and the greedy tokens equal transformers' with the same processor options."""
    rows = [_rows()[2], _rows()[4]]
    bounded = {"max_pixels": 56 * 56}
    ref = hf_greedy_qwen_vl(qwen_vl, rows, GREEDY.max_tokens, **bounded)
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in rows]
    plain = LLM(qwen_vl, kv_cache_memory="16MiB").generate(inputs[:1], GREEDY, use_tqdm=False)
    outs = LLM(qwen_vl, kv_cache_memory="16MiB", mm_processor_kwargs=bounded).generate(
        inputs, GREEDY, use_tqdm=False
    )
    assert [o.error for o in outs] == [None, None]
    assert len(outs[0].prompt_token_ids) < len(plain[0].prompt_token_ids)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_an_option_the_processor_does_not_take_is_refused_by_name(qwen_vl):
    with pytest.raises(ValueError, match="takes no option 'max_pixel'.*max_pixels"):
        LLM(qwen_vl, kv_cache_memory="16MiB", mm_processor_kwargs={"max_pixel": 3136})
    with pytest.raises(ValueError, match="batchgen sets 'return_tensors' itself"):
        LLM(qwen_vl, kv_cache_memory="16MiB", mm_processor_kwargs={"return_tensors": "np"})


def test_per_prompt_processor_options_never_share_features_with_others(qwen_vl):
    """A prompt's own ``mm_processor_kwargs`` (vLLM's prompt key) apply to its images alone: the same image
    with and without them is two encodings whose features and KV blocks are never mixed; an option the
    processor does not take fails that prompt alone."""
    text, images = _rows()[2]
    bounded = {"max_pixels": 56 * 56}
    ref_bounded = hf_greedy_qwen_vl(qwen_vl, [(text, images)], GREEDY.max_tokens, **bounded)[0]
    ref_plain = hf_greedy_qwen_vl(qwen_vl, [(text, images)], GREEDY.max_tokens)[0]
    llm = LLM(qwen_vl, kv_cache_memory="16MiB")
    row = {"prompt": text, "multi_modal_data": {"image": images}}
    outs = llm.generate(
        [{**row, "mm_processor_kwargs": bounded}, row, {**row, "mm_processor_kwargs": {"max_pixel": 1}}],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs[:2]] == [ref_bounded, ref_plain]
    assert outs[2].error is not None and "takes no option 'max_pixel'" in outs[2].error
    assert llm.engine.images.stats.encoded == 2
    with pytest.raises(ValueError, match="only beside 'multi_modal_data'"):
        llm.generate({"prompt": text, "mm_processor_kwargs": bounded}, GREEDY)
