"""Shared by the image-text tests: small random images, the inputs of a batched and shuffled greedy comparison,
and transformers' greedy tokens for the same rows (the reference)."""

from __future__ import annotations

import io

import numpy as np


def random_image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def mixed_images(n: int = 4) -> list:
    """``n`` (at most 4) random images of several sizes and aspect ratios: 56x56, 120x60, 40x90, 300x200 (seeds
    0..3); the last is far larger than the tiny processors' input size."""
    return [random_image(w, h, s) for s, (w, h) in enumerate([(56, 56), (120, 60), (40, 90), (300, 200)][:n])]


def shuffled_inputs(rows, order: list[int]) -> list:
    """The LLM inputs for ``rows`` (``(text, images)`` pairs) taken in ``order``: a prompt with its images, or
    the bare text where a row has none."""
    return [
        {"prompt": rows[i][0], "multi_modal_data": {"image": rows[i][1]}} if rows[i][1] else rows[i][0]
        for i in order
    ]


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def hf_greedy(
    ckpt: str, rows, max_new_tokens: int, *, nested: bool = False, **processor_kwargs
) -> list[list[int]]:
    """transformers' greedy tokens for each ``(text, images)`` row, one row at a time (the reference).
    ``nested``: the processor takes a list of images per text (Idefics3), else a flat list;
    ``processor_kwargs`` go to each processor call."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    for text, images in rows:
        if not images:
            images = None
        elif nested:
            images = [images]
        enc = proc(text=[text], images=images, return_tensors="pt", **(processor_kwargs if images else {}))
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, enc["input_ids"].shape[1] :].tolist())
    return out


def hf_greedy_qwen_vl(ckpt: str, rows, max_new_tokens: int, **processor_kwargs) -> list[list[int]]:
    """transformers' greedy tokens for each ``(text, images)`` row of a Qwen2-VL / Qwen2.5-VL checkpoint, one
    row at a time. ``Qwen2VLProcessor`` needs torchvision, so its work is done here as it does it: the image
    processor's pixels and grids (``processor_kwargs`` given to its call), each ``<|image_pad|>`` expanded to
    ``grid_t*grid_h*grid_w / merge**2``."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    ip = AutoImageProcessor.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    pad = model.config.image_token_id
    out = []
    for text, images in rows:
        ids = tok.encode(text)
        kw = {}
        if images:
            enc = ip(images=images, return_tensors="pt", **processor_kwargs)
            grid = enc["image_grid_thw"]
            expanded, k = [], 0
            for t in ids:
                if t == pad:
                    expanded += [pad] * (int(grid[k].prod()) // ip.merge_size**2)
                    k += 1
                else:
                    expanded.append(t)
            ids = expanded
            kw = {"pixel_values": enc["pixel_values"], "image_grid_thw": grid}
        input_ids = torch.tensor([ids])
        gen = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == pad).int(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kw,
        )
        out.append(gen[0, len(ids) :].tolist())
    return out
