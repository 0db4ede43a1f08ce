"""Tiny random checkpoints of image-text families whose language model runs on transformers' own modeling code
over batchgen's paged attention (:mod:`batchgen.models.vision_transformers_lm`), built offline with the real
processors (tests).

Each has a 2-layer language model of a family batchgen has no native decoder for, a tiny vision side of its own
classes, our byte-level BPE tokenizer with the family's image tokens added, and weights drawn with
``initializer_range=0.08`` so greedy output does not collapse into a repeated token.
"""

from __future__ import annotations

import os
from pathlib import Path

from batchgen.models.tiny import build_tokenizer
from batchgen.multimodal.tiny import save_random, text_fields, vision_fields

AYA_TOKENS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]


def build_aya_vision(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """An ``AyaVisionForConditionalGeneration`` (a 2-layer SigLIP tower on 56-px tiles of 14-px patches, the
    pixel-shuffle projector: 4 tokens per tile; a 2-layer Cohere2 with a sliding-window layer and a global
    one) saved with the real ``AyaVisionProcessor`` (``GotOcr2ImageProcessor``'s PIL implementation: an image
    becomes up to 4 tiles by its aspect ratio and a global view, each tile's tokens after a ``TILE_k`` text
    marker); returns its path."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens(AYA_TOKENS, special_tokens=True)
    text = transformers.Cohere2Config(
        **text_fields(tok, vocab_size, hidden_size, head_dim=16),
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        logit_scale=0.5,
    )
    cfg = transformers.AyaVisionConfig(
        text_config=text,
        vision_config=transformers.SiglipVisionConfig(**vision_fields()),
        downsample_factor=2,
        image_token_index=tok.convert_tokens_to_ids("<|IMG_PATCH|>"),
        tie_word_embeddings=False,
    )
    save_random(transformers.AyaVisionForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    processor = transformers.AyaVisionProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14, img_size=56, downsample_factor=2
    )
    processor.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def build_blip2(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """A ``Blip2ForConditionalGeneration`` (a 2-layer BLIP vision tower on 56-px images in 14-px patches, a
    2-layer Q-Former of 8 query tokens, its projection, a 2-layer OPT) saved with the real ``Blip2Processor``
    (``BlipImageProcessor``'s PIL implementation; the image's 8 tokens go before the prompt); returns its
    path."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens(["<image>"], special_tokens=True)
    text = transformers.OPTConfig(
        vocab_size=vocab_size + 64,
        hidden_size=hidden_size,
        ffn_dim=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
        word_embed_proj_dim=hidden_size,
        init_std=0.08,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    cfg = transformers.Blip2Config(
        vision_config=vision_fields(initializer_range=0.08),
        qformer_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            encoder_hidden_size=32,
            initializer_range=0.08,
        ),
        text_config=text,
        num_query_tokens=8,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
    )
    save_random(transformers.Blip2ForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.BlipImageProcessorPil(size={"height": 56, "width": 56})
    transformers.Blip2Processor(
        image_processor=image_processor, tokenizer=tok, num_query_tokens=8
    ).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def build_aria(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """An ``AriaForConditionalGeneration`` (a 2-layer Idefics3-style tower on 980-px images in 70-px patches,
    the cross-attention projector: 4 query tokens per image; a 2-layer Aria text model, a mixture of 4 experts,
    top 2, and a shared one) saved with the real ``AriaProcessor`` (``AriaImageProcessor``'s PIL
    implementation: each image resized to fit 980 px and padded, under a pixel mask); returns its path."""
    import transformers

    from batchgen.multimodal.tiny_transformers import _tokenizer_naming

    out = Path(out_dir)
    tok = _tokenizer_naming(out, vocab_size, {"image_token": "<|img|>"})
    text = transformers.AriaTextConfig(
        **text_fields(tok, vocab_size, hidden_size, head_dim=16),
        moe_num_experts=4,
        moe_topk=2,
        moe_num_shared_experts=1,
    )
    cfg = transformers.AriaConfig(
        text_config=text,
        vision_config=vision_fields(model_type="idefics3_vision", image_size=980, patch_size=70),
        projector_patch_to_query_dict={196: 4, 49: 2},
        image_token_index=tok.convert_tokens_to_ids("<|img|>"),
        tie_word_embeddings=False,
    )
    save_random(transformers.AriaForConditionalGeneration, cfg, tok, out, seed)
    processor = transformers.AriaProcessor(
        image_processor=transformers.AriaImageProcessorPil(), tokenizer=tok, size_conversion={980: 4, 490: 2}
    )
    processor.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def build_qianfan_ocr(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """A ``QianfanOCRForConditionalGeneration`` (a 2-layer InternViT-style tower on 56-px tiles of 14-px
    patches, pixel shuffle to 4 tokens per tile, the MLP projector; a 2-layer Qwen3) saved as transformers saves
    it (the original InternVL tensor layout, renamed and split by transformers' conversion mapping when loaded)
    with the real ``QianfanOCRProcessor`` (``GotOcr2ImageProcessor``'s PIL implementation: up to 4 tiles by
    aspect ratio and a thumbnail; the prompt's ``<image>`` becomes ``<img>``, the feature tokens and
    ``</img>``); returns its path."""
    import transformers
    from transformers.models.qianfan_ocr.processing_qianfan_ocr import QianfanOCRProcessor

    from batchgen.multimodal.tiny_transformers import _tokenizer_naming

    out = Path(out_dir)
    names = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "image_token": "<image>",
    }
    tok = _tokenizer_naming(out, vocab_size, names)
    cfg = transformers.QianfanOCRConfig(
        text_config=transformers.Qwen3Config(**text_fields(tok, vocab_size, hidden_size, head_dim=16)),
        vision_config=transformers.QianfanOCRVisionConfig(**vision_fields(32)),
        image_token_id=tok.convert_tokens_to_ids(names["context_image_token"]),
        image_seq_length=4,
    )
    save_random(transformers.QianfanOCRForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    QianfanOCRProcessor(image_processor=image_processor, tokenizer=tok, image_seq_length=4).save_pretrained(
        str(out)
    )
    tok.save_pretrained(str(out))
    return str(out)
