"""Idefics3 / SmolVLM through batchgen: image splitting into tiles and a global view, the pixel-shuffle
connector, feature tokens interleaved with the processor's tile tokens; greedy output equals transformers token
for token (float32, CPU) with images of several sizes and aspect ratios, several images per row, batched and
shuffled; each distinct image encoded once and its blocks shared by the prefix cache."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from vision_helpers import hf_greedy, mixed_images, random_image, shuffled_inputs  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.multimodal.tiny import build_idefics3  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory) -> str:
    return build_idefics3(tmp_path_factory.mktemp("idefics3"))


def test_greedy_equals_transformers_batched_and_shuffled(idefics3):
    a, b, c, d = mixed_images()
    rows = [
        ("User:<image>What is in the picture?<end_of_utterance>\nAssistant:", [a]),
        ("Compare <image> with <image>, please.", [b, c]),  # split into tiles: tokens between feature runs
        ("<image>", [d]),
        ("No image here, only text.", []),
        ("<image> again, other text", [a]),
    ]
    ref = hf_greedy(idefics3, rows, GREEDY.max_tokens, nested=True)
    llm = LLM(idefics3, kv_cache_memory="32MiB", max_num_seqs=8)
    order = [2, 0, 4, 3, 1]
    outs = llm.generate(shuffled_inputs(rows, order), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(rows)
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in order]
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (5, 4, 4)
    # the same question about another image answers differently: the features are placed
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": c}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]


def test_blocks_shared_only_for_the_same_image(idefics3):
    llm = LLM(idefics3, kv_cache_memory="32MiB", max_num_seqs=8, block_size=8)
    a, b = random_image(112, 112, 10), random_image(112, 112, 11)  # 4 tiles and a global view: 20 tokens
    prompt = "<image> and the question is long enough to fill blocks"
    first = llm.generate({"prompt": prompt + " 1", "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)
    again = llm.generate({"prompt": prompt + " 2", "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)
    other = llm.generate({"prompt": prompt + " 1", "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens >= 24
    assert other[0].num_cached_tokens == 0
    assert llm.engine.images.stats.encoded == 2


def test_the_processors_own_token_ids_equal_transformers(idefics3):
    """Token ids the processor expanded already (tile tokens among the feature runs) are kept as they are."""
    from transformers import AutoProcessor

    a, b = random_image(56, 56, 12), random_image(300, 40, 13)  # one tile; a row of tiles and a global view
    rows = [("Look <image> and <image> now", [a, b]), ("<image>", [b])]
    processor = AutoProcessor.from_pretrained(idefics3)
    inputs = [
        {
            "prompt_token_ids": processor(text=[t], images=[ims])["input_ids"][0],
            "multi_modal_data": {"image": ims},
        }
        for t, ims in rows
    ]
    llm = LLM(idefics3, kv_cache_memory="32MiB")
    outs = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [i["prompt_token_ids"] for i in inputs]
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(idefics3, rows, GREEDY.max_tokens, nested=True)


@pytest.mark.parametrize("tile", [28, 112])
def test_options_that_mismatch_features_and_tokens_fail_the_image_rows_alone(idefics3, tile):
    """Tiles of another size than the encoder's (``max_image_size`` 28 or 112 px for a 56-px tower) make fewer
    or more feature tokens than the processor writes: transformers raises; here the rows showing such an image
    end with the reason (never features cut to the token count) and the other rows of the same steps run on."""
    options = {"max_image_size": {"longest_edge": tile}, "size": {"longest_edge": 2 * tile}}
    llm = LLM(idefics3, kv_cache_memory="32MiB", mm_processor_kwargs=options)
    outs = llm.generate(
        [{"prompt": "<image> what?", "multi_modal_data": {"image": random_image(300, 100, 14)}}, "text only"],
        GREEDY,
        use_tqdm=False,
    )
    assert "image features and image tokens do not match" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == GREEDY.max_tokens
