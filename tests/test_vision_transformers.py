"""An image-text architecture whose vision side runs on transformers' own ``get_image_features`` (VipLLaVA:
features of several vision layers concatenated, its own projector) before batchgen's native decoder: greedy
output equals transformers token for token (float32, CPU), batched and shuffled; images encoded once."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from vision_helpers import hf_greedy, mixed_images, shuffled_inputs  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.multimodal.tiny import build_llava  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def test_vipllava_equals_transformers(tmp_path):
    ckpt = build_llava(tmp_path / "vip", vip_layers=[-2, -1])
    a, b, c = mixed_images(3)
    rows = [
        ("<image> What is it?", [a]),
        ("Compare <image> with <image>", [b, c]),
        ("text only", []),
        ("<image> again, other words", [a]),
    ]
    ref = hf_greedy(ckpt, rows, GREEDY.max_tokens)
    llm = LLM(ckpt, kv_cache_memory="32MiB")
    order = [3, 1, 2, 0]
    outs = llm.generate(shuffled_inputs(rows, order), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(rows)
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in order]
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (4, 3, 3)
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)
    assert other[0].outputs[0].token_ids != ref[0]
