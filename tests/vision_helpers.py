"""Shared by the image-text tests: the tiny LLaVA checkpoint (built once per session) and small random images."""

from __future__ import annotations

import io

import numpy as np


def random_image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def hf_greedy(ckpt: str, rows, max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each ``(text, images)`` row, one row at a time (the reference)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    for text, images in rows:
        enc = proc(text=[text], images=images or None, return_tensors="pt")
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, enc["input_ids"].shape[1] :].tolist())
    return out
