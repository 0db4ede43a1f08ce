"""Tiny random image-text checkpoints built offline with the real processors (tests and benchmarks).

`build_llava(out)`: a LLaVA 1.5 checkpoint (``LlavaForConditionalGeneration``: a small CLIP vision tower, the
two-layer projector, a 2-layer Llama) saved with a ``LlavaProcessor`` (``CLIPImageProcessor``'s PIL
implementation, our byte-level BPE tokenizer with ``<image>`` added as a special token) and a chat template that
puts ``<image>`` where a message has an image part. Weights are drawn with ``initializer_range=0.08`` so greedy
output does not collapse into a repeated token.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchgen.models.tiny import build_tokenizer

IMAGE_TOKEN = "<image>"

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_random(
    model_class, cfg, tok, out: Path, seed: int, init: Callable[[Any], None] | None = None
) -> None:
    """``model_class(cfg)`` with random weights (``initializer_range`` 0.08, seeded by ``seed`` without touching
    the global RNG; ``init`` draws more of them, under ``no_grad``) and the tokenizer's special ids as its
    generation config, saved in ``out``."""
    cfg.initializer_range = 0.08
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(cfg)
        if init is not None:
            with torch.no_grad():
                init(model)
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out))


def draw_image_newline(model) -> None:
    """``image_newline`` drawn (it starts at zero, so tiling would not show in the outputs)."""
    model.model.image_newline.normal_(0.0, 0.5)


def build_llava(
    out_dir: str | os.PathLike,
    *,
    image_size: int = 56,
    patch_size: int = 14,
    hidden_size: int = 64,
    vision_hidden_size: int = 32,
    vocab_size: int = 4096,
    seed: int = 0,
    next_grid: list[list[int]] | None = None,
    vip_layers: list[int] | None = None,
    text_model_type: str = "llama",
    select_strategy: str = "default",
    feature_layer: int | list[int] = -2,
) -> str:
    """Build the tiny LLaVA checkpoint and processor in `out_dir`; returns its path.

    Each image becomes ``(image_size / patch_size)**2`` placeholder tokens (16 by default). With ``next_grid``
    (``image_grid_pinpoints``, multiples of ``image_size``) it is a LLaVA-NeXT checkpoint instead
    (``LlavaNextForConditionalGeneration``, any-resolution tiling: the token count depends on the image size).
    With ``vip_layers`` (vision layers whose features are concatenated) it is a VipLLaVA checkpoint
    (``VipLlavaForConditionalGeneration``: its own projector, the same processor). ``text_model_type``: the
    language model's family (``"qwen2"``: q/k/v biases, as LLaVA-Interleave's Qwen2 has).
    ``select_strategy`` and ``feature_layer``: ``vision_feature_select_strategy`` (``"full"`` keeps the CLS
    position: one more token per image) and ``vision_feature_layer`` (a list: those layers concatenated)."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = _llama_text_config(tok, vocab_size, hidden_size, text_model_type)
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden_size,
        initializer_range=0.08,
    )
    common = dict(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_select_strategy=select_strategy,
        vision_feature_layer=feature_layer,
        projector_hidden_act="gelu",
    )
    if vip_layers is not None:
        from transformers import VipLlavaConfig, VipLlavaForConditionalGeneration

        cfg = VipLlavaConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=image_token_id,
            vision_feature_layers=vip_layers,
            projector_hidden_act="gelu",
        )
        model_class = VipLlavaForConditionalGeneration
    elif next_grid is None:
        cfg, model_class = LlavaConfig(**common), LlavaForConditionalGeneration
    else:
        cfg = LlavaNextConfig(**common, image_grid_pinpoints=next_grid)
        model_class = LlavaNextForConditionalGeneration
    save_random(model_class, cfg, tok, out, seed, None if next_grid is None else draw_image_newline)
    if next_grid is not None:
        image_processor = LlavaNextImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
            image_grid_pinpoints=next_grid,
        )
        processor_class = LlavaNextProcessor
    else:
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
        processor_class = LlavaProcessor
    processor = processor_class(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=patch_size,
        vision_feature_select_strategy=select_strategy,
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return str(out)


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + QWEN_IMAGE + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2_vl(
    out_dir: str | os.PathLike,
    *,
    version: str = "2",
    hidden_size: int = 64,
    vision_hidden_size: int = 32,
    vocab_size: int = 4096,
    max_pixels: int = 28 * 28 * 16,
    seed: int = 0,
) -> str:
    """Build a tiny Qwen2-VL (``version="2"``) or Qwen2.5-VL (``"2.5"``: window attention over 2x2 merged
    patches in its first block, full attention in the last) checkpoint in `out_dir`; returns its path.

    Saved with the real ``Qwen2VLImageProcessor`` (``min_pixels`` 56², ``max_pixels`` as given: an image
    becomes 1 to ``max_pixels / 28²`` placeholder tokens depending on its size) and our byte-level BPE
    tokenizer with Qwen's vision tokens added; the chat template puts
    ``<|vision_start|><|image_pad|><|vision_end|>`` where a message has an image part. The processor class
    itself (``Qwen2VLProcessor``) needs torchvision, so only its parts are saved."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_tokens(specials, special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    head_dim = hidden_size // 4
    quarter = head_dim // 2 // 4
    text = dict(
        vocab_size=vocab_size + 64,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.08,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 2 - 2 * quarter * 3 // 2, quarter * 3 // 2, quarter * 3 // 2],
        },
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=2,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=0.08,
    )
    if version == "2":
        vision.update(embed_dim=vision_hidden_size, hidden_size=hidden_size, mlp_ratio=2)
        cfg_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    elif version == "2.5":
        vision.update(
            hidden_size=vision_hidden_size,
            intermediate_size=2 * vision_hidden_size,
            out_hidden_size=hidden_size,
            window_size=56,
            fullatt_block_indexes=[1],
        )
        cfg_class, model_class = (
            transformers.Qwen2_5_VLConfig,
            transformers.Qwen2_5_VLForConditionalGeneration,
        )
    else:
        raise ValueError(f"version must be '2' or '2.5', not {version!r}")
    cfg = cfg_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    save_random(model_class, cfg, tok, out, seed)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    image_processor.save_pretrained(str(out))
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return str(out)


def build_idefics3(
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 64,
    vision_hidden_size: int = 32,
    vocab_size: int = 4096,
    seed: int = 0,
) -> str:
    """Build a tiny Idefics3 checkpoint (``Idefics3ForConditionalGeneration``: a 2-layer vision transformer on
    56-px tiles of 14-px patches, the pixel-shuffle connector with ``scale_factor=2``: 4 tokens per tile, a
    2-layer Llama) in `out_dir`, saved with the real ``Idefics3Processor`` (``Idefics3ImageProcessor``'s PIL
    implementation: images up to 112 px split into 56-px tiles plus a global view); returns its path."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    specials = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok.add_tokens(specials, special_tokens=True)
    text = _llama_text_config(tok, vocab_size, hidden_size)
    vision = transformers.Idefics3VisionConfig(**vision_fields(vision_hidden_size, initializer_range=0.08))
    cfg = transformers.Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=False,
    )
    save_random(transformers.Idefics3ForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True
    )
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=4
    )
    processor.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def vision_fields(hidden_size: int = 32, **extra: Any) -> dict[str, Any]:
    """A tiny vision tower's config fields (2 layers of 2 heads, 56-px images in 14-px patches, the MLP twice
    the width) with ``extra`` over them."""
    return {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        **extra,
    }


def text_fields(tok, vocab_size: int, hidden_size: int, **extra: Any) -> dict[str, Any]:
    """The config fields of the tiny image-text checkpoints' 2-layer decoder, with room above the tokenizer's
    vocabulary for the image tokens (and padding), as real checkpoints have; ``extra``: the family's own."""
    return dict(
        vocab_size=vocab_size + 64,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.08,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        **extra,
    )


def _llama_text_config(tok, vocab_size: int, hidden_size: int, model_type: str = "llama"):
    """The language model of the tiny LLaVA and Idefics3 checkpoints: a Llama, or another family's
    (``model_type``) of the same size."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**text_fields(tok, vocab_size, hidden_size))


GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else "
    "message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _gemma3_wide_init(model) -> None:
    """The projection and the norms drawn wide (norms away from their (1 + 0) init), so that greedy output
    depends on the image."""
    model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.normal_(0.0, 0.3)


def build_gemma3(
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 64,
    vision_hidden_size: int = 32,
    vocab_size: int = 4096,
    sliding_window: int = 24,
    seed: int = 0,
) -> str:
    """Build a tiny Gemma 3 image-text checkpoint (``Gemma3ForConditionalGeneration``: a 2-layer SigLIP tower
    on 56-px images of 7-px patches, the projector pooling its 8x8 patches to 16 image tokens, a 2-layer
    Gemma 3 decoder with one sliding-window layer of ``sliding_window`` and one global layer) in `out_dir`,
    saved with the real ``Gemma3Processor`` (``Gemma3ImageProcessor``'s PIL implementation; our byte-level
    BPE tokenizer with Gemma 3's ``<start_of_image>``, ``<end_of_image>`` and ``<image_soft_token>``) and a
    Gemma-style chat template; returns its path. Norm weights and the projection are drawn wide enough that
    greedy output depends on the image."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    specials = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tok.add_tokens([*specials.values(), "<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    tok._set_model_specific_special_tokens(
        special_tokens=specials
    )  # tokenizer.boi_token, ... (the processor)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in specials.items()}
    text = transformers.Gemma3TextConfig(
        **text_fields(
            tok,
            vocab_size,
            hidden_size,
            head_dim=hidden_size // 4,
            sliding_window=sliding_window,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=hidden_size // 4,
        )
    )
    vision = transformers.SiglipVisionConfig(**vision_fields(vision_hidden_size, patch_size=7))
    cfg = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        initializer_range=0.08,
        tie_word_embeddings=False,
    )
    save_random(transformers.Gemma3ForConditionalGeneration, cfg, tok, out, seed, _gemma3_wide_init)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_length=16,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return str(out)
