"""The encoder cache and image inputs of image-text models (batchgen.models.vision), model-free."""

from __future__ import annotations

import torch

from batchgen.models import vision
from batchgen.models.vision import IMAGE_ID_BASE, OFFSET_BITS, EncoderCache, ImageInputs, image_token_ids


def _encoder(calls: list[int]):
    def encode(pixels):
        calls.append(len(pixels))
        return [p["pixel_values"].sum() * torch.ones(4, 2) for p in pixels]

    return encode


def test_each_image_encoded_once_while_cached_and_again_after_eviction():
    inputs = ImageInputs(EncoderCache(capacity_bytes=2 * 4 * 2 * 4))  # room for two images' features
    keys = [inputs.acquire(h, {"pixel_values": torch.full((1,), float(i + 1))}) for i, h in enumerate("abc")]
    assert inputs.acquire("a", {"pixel_values": torch.ones(1)}) == keys[0]  # the same content, the same key
    calls: list[int] = []
    out = inputs.features(keys[:2], _encoder(calls))
    assert calls == [2] and float(out[keys[1]][0, 0]) == 2.0  # one batch for both
    inputs.features(keys[:2], _encoder(calls))
    assert calls == [2]  # both cached
    inputs.features([keys[2]], _encoder(calls))  # evicts the least recently used (a)
    inputs.features([keys[0]], _encoder(calls))
    assert calls == [2, 1, 1]
    s = inputs.stats
    assert (s.references, s.distinct, s.encoded) == (4, 3, 4)


def test_released_images_keep_their_key_and_are_skipped_once_gone():
    inputs = ImageInputs(EncoderCache(capacity_bytes=1))  # nothing fits: every use encodes
    k = inputs.acquire("ef", {"pixel_values": torch.ones(1)})
    inputs.release("ef")
    assert inputs.features([k], _encoder([])) == {}  # no pixels left: a discarded in-flight row
    assert inputs.acquire("ef", {"pixel_values": torch.ones(1)}) == k


def test_short_key_collisions_are_probed(monkeypatch):
    monkeypatch.setattr(vision, "_KEY_MASK", 1)  # keys 0 and 1 only: two even hashes collide on key 0
    inputs = ImageInputs(EncoderCache(1 << 20))
    a = inputs.acquire("a0" * 32, {"pixel_values": torch.ones(1)})
    b = inputs.acquire("c0" * 32, {"pixel_values": torch.full((1,), 2.0)})
    assert (a, b) == (0, 1)
    out = inputs.features([a, b], _encoder([]))
    assert float(out[a][0, 0]) == 1.0 and float(out[b][0, 0]) == 2.0


def test_image_token_ids_encode_key_and_offset():
    ids = image_token_ids(5, 3)
    assert ids == [IMAGE_ID_BASE + (5 << OFFSET_BITS) + i for i in range(3)]
    assert all(i < 2**63 for i in image_token_ids((1 << (62 - OFFSET_BITS)) - 1, 4))
