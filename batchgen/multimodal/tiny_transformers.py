"""Tiny random checkpoints of image-text families whose vision side runs on transformers' own model code
(:mod:`batchgen.models.vision_transformers`), built offline with the real processors (tests).

Each has a 2-layer language model of a native family, a tiny vision side of its own classes, our byte-level
BPE tokenizer with the family's image tokens added, and weights drawn with ``initializer_range=0.08`` so greedy
output does not collapse into a repeated token.
"""

from __future__ import annotations

import os
from pathlib import Path

from batchgen.models.tiny import build_tokenizer
from batchgen.multimodal.tiny import draw_image_newline, save_random, text_fields, vision_fields


def _tokenizer_naming(out: Path, vocab_size: int, names: dict[str, str]):
    """Our tokenizer with ``names``' tokens added as special tokens and readable as its attributes
    (``tokenizer.image_token``...), as the processors of some families expect."""
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens(list(names.values()), special_tokens=True)
    specials = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token")}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, extra_special_tokens=names, **specials
    )


def build_idefics2(
    out_dir: str | os.PathLike,
    *,
    splitting: bool = True,
    hidden_size: int = 64,
    vocab_size: int = 4096,
    seed: int = 0,
) -> str:
    """An ``Idefics2ForConditionalGeneration`` (a 2-layer SigLIP-style tower on images of at most 56 px in
    14-px patches, the perceiver resampler: 8 latent tokens per image or crop, a 2-layer Mistral) saved with
    the real ``Idefics2Processor`` (``Idefics2ImageProcessor``'s PIL implementation; with ``splitting`` each
    image becomes 4 crops and the whole, padded to the largest with a pixel mask); returns its path."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens(["<fake_token_around_image>", "<image>", "<end_of_utterance>"], special_tokens=True)
    cfg = transformers.Idefics2Config(
        text_config=transformers.MistralConfig(
            **text_fields(tok, vocab_size, hidden_size, sliding_window=None)
        ),
        vision_config=vision_fields(initializer_range=0.08),
        perceiver_config=dict(
            hidden_size=hidden_size,
            resampler_n_latents=8,
            resampler_depth=2,
            resampler_n_heads=4,
            resampler_head_dim=16,
            num_key_value_heads=2,
            initializer_range=0.08,
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    save_random(transformers.Idefics2ForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.Idefics2ImageProcessorPil(
        size={"shortest_edge": 28, "longest_edge": 56}, do_image_splitting=splitting
    )
    processor = transformers.Idefics2Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=8
    )
    processor.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def build_llava_onevision(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """A ``LlavaOnevisionForConditionalGeneration`` (a 2-layer SigLIP tower on 56-px crops of 14-px patches:
    16 tokens per crop, any-resolution tiling over 56/112-px grids with unpadding and ``image_newline``, a
    2-layer Qwen2) saved with the real ``LlavaOnevisionProcessor`` (its image processor's PIL
    implementation); returns its path."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens(["<image>", "<video>"], special_tokens=True)
    grid = [[56, 56], [56, 112], [112, 56], [112, 112]]
    cfg = transformers.LlavaOnevisionConfig(
        text_config=transformers.Qwen2Config(**text_fields(tok, vocab_size, hidden_size)),
        vision_config=transformers.SiglipVisionConfig(**vision_fields()),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=grid,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=False,
    )
    save_random(transformers.LlavaOnevisionForConditionalGeneration, cfg, tok, out, seed, draw_image_newline)
    image_processor = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": 56, "width": 56}, crop_size={"height": 56, "width": 56}, image_grid_pinpoints=grid
    )
    processor = transformers.LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        num_image_tokens=16,
        vision_feature_select_strategy="full",
    )
    processor.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def build_lighton_ocr(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """A ``LightOnOcrForConditionalGeneration`` (a 2-layer Pixtral tower: 2-D RoPE over 14-px patches of
    images resized to at most 112 px and any aspect ratio, the 2x2 patch merger and projector; a 2-layer
    Qwen3) saved with the real ``LightOnOcrProcessor`` (``PixtralImageProcessor``'s PIL implementation: an
    image becomes ``(h / 28) * (w / 28)`` tokens); returns its path."""
    import transformers

    out = Path(out_dir)
    names = {
        "image_token": "<|image_pad|>",
        "image_break_token": "<|vision_pad|>",
        "image_end_token": "<|vision_end|>",
    }
    tok = _tokenizer_naming(out, vocab_size, names)
    cfg = transformers.LightOnOcrConfig(
        text_config=transformers.Qwen3Config(**text_fields(tok, vocab_size, hidden_size, head_dim=16)),
        vision_config=transformers.PixtralVisionConfig(**vision_fields(image_size=112)),
        spatial_merge_size=2,
        image_token_id=tok.convert_tokens_to_ids(names["image_token"]),
        tie_word_embeddings=False,
    )
    save_random(transformers.LightOnOcrForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.PixtralImageProcessorPil(
        size={"longest_edge": 112}, patch_size={"height": 28, "width": 28}
    )
    processor = transformers.LightOnOcrProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14, spatial_merge_size=2
    )
    processor.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def build_paligemma(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """A ``PaliGemmaForConditionalGeneration`` (a 2-layer SigLIP tower on 56-px images, a 2-layer Gemma that
    attends bidirectionally over the image and the prompt) saved with the real ``PaliGemmaProcessor``: an
    architecture whose images batchgen refuses; returns its path."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens(["<image>"], special_tokens=True)
    cfg = transformers.PaliGemmaConfig(
        text_config=transformers.GemmaConfig(**text_fields(tok, vocab_size, hidden_size, head_dim=16)),
        vision_config=transformers.SiglipVisionConfig(**vision_fields(projection_dim=hidden_size)),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        projection_dim=hidden_size,
    )
    save_random(transformers.PaliGemmaForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.SiglipImageProcessorPil(size={"height": 56, "width": 56})
    transformers.PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)


def _draw_high_res_alpha(model) -> None:
    """DeepSeek-VL hybrid's weight of the SAM tower's global features (zero at init) drawn."""
    model.model.high_res_vision_alpha.normal_(0.0, 0.5)


def build_deepseek_vl(
    out_dir: str | os.PathLike,
    *,
    janus: bool = False,
    hybrid: bool = False,
    hidden_size: int = 64,
    vocab_size: int = 4096,
    seed: int = 0,
) -> str:
    """A ``DeepseekVLForConditionalGeneration`` (a 2-layer SigLIP tower on 56-px images: 16 tokens each, its
    aligner, a 2-layer Llama) or, with ``janus``, a ``JanusForConditionalGeneration`` (the same understanding
    path beside a tiny VQ image generator that image-to-text never runs) or, with ``hybrid``, a
    ``DeepseekVLHybridForConditionalGeneration`` (beside the SigLIP tower a 2-layer SAM tower on a 256-px copy
    of the image, its neck and downsampling to the same 4x4 grid, both mixed by the hybrid aligner; the
    high-resolution mixing weight drawn, as it starts at zero), saved with the family's real processor (its
    image processor's PIL implementation); returns its path."""
    import transformers

    out = Path(out_dir)
    names = {"image_token": "<image_placeholder>"}
    if janus:
        names.update(boi_token="<begin_of_image>", eoi_token="<end_of_image>")
    tok = _tokenizer_naming(out, vocab_size, names)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56
    )
    init = None
    common = dict(
        text_config=transformers.LlamaConfig(**text_fields(tok, vocab_size, hidden_size)),
        image_token_id=tok.convert_tokens_to_ids(names["image_token"]),
        tie_word_embeddings=False,
    )
    if janus:
        cfg = transformers.JanusConfig(
            vision_config=dict(vision, patch_size=14, projection_dim=hidden_size),
            vq_config=dict(
                embed_dim=8,
                num_embeddings=32,
                base_channels=32,
                channel_multiplier=[1, 1],
                num_res_blocks=1,
                projection_dim=hidden_size,
                image_token_embed_dim=hidden_size,
                num_patches=4,
            ),
            **common,
        )
        model_class, processor_class = transformers.JanusForConditionalGeneration, transformers.JanusProcessor
        image_processor = transformers.JanusImageProcessorPil(size={"height": 56, "width": 56})
    elif hybrid:
        high_res = transformers.SamVisionConfig(
            hidden_size=32,
            output_channels=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=256,
            patch_size=16,
            mlp_dim=64,
            global_attn_indexes=[1],
            window_size=4,
        )
        cfg = transformers.DeepseekVLHybridConfig(
            vision_config=transformers.SiglipVisionConfig(**vision, patch_size=14),
            high_res_vision_config=high_res,
            **common,
        )
        model_class, processor_class = (
            transformers.DeepseekVLHybridForConditionalGeneration,
            transformers.DeepseekVLHybridProcessor,
        )
        image_processor = transformers.DeepseekVLHybridImageProcessorPil(
            size={"height": 56, "width": 56}, high_res_size={"height": 256, "width": 256}
        )
        init = _draw_high_res_alpha
    else:
        cfg = transformers.DeepseekVLConfig(
            vision_config=transformers.SiglipVisionConfig(**vision, patch_size=14), **common
        )
        model_class, processor_class = (
            transformers.DeepseekVLForConditionalGeneration,
            transformers.DeepseekVLProcessor,
        )
        image_processor = transformers.DeepseekVLImageProcessorPil(size={"height": 56, "width": 56})
    save_random(model_class, cfg, tok, out, seed, init)
    processor_class(image_processor=image_processor, tokenizer=tok, num_image_tokens=16).save_pretrained(
        str(out)
    )
    tok.save_pretrained(str(out))
    return str(out)


def build_got_ocr2(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, vocab_size: int = 4096, seed: int = 0
) -> str:
    """A ``GotOcr2ForConditionalGeneration`` (a 2-layer SAM-style tower, windowed then global attention with
    relative positions, over 128-px images in 2-px patches; two stride-2 convolutions make its 64x64 patches
    the 256 tokens GOT-OCR2's processor writes; a 2-layer Qwen2) saved with the real ``GotOcr2Processor``
    (``GotOcr2ImageProcessor``'s PIL implementation); returns its path."""
    import transformers

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    tok.add_tokens(["<img>", "</img>", "<imgpad>"], special_tokens=True)
    cfg = transformers.GotOcr2Config(
        text_config=transformers.Qwen2Config(**text_fields(tok, vocab_size, hidden_size)),
        vision_config=dict(
            hidden_size=16,
            output_channels=8,
            num_hidden_layers=2,
            num_attention_heads=1,
            image_size=128,
            patch_size=2,
            window_size=8,
            global_attn_indexes=[1],
            mlp_dim=32,
            initializer_range=0.08,
        ),
        image_token_index=tok.convert_tokens_to_ids("<imgpad>"),
        image_seq_length=256,
        tie_word_embeddings=False,
    )
    save_random(transformers.GotOcr2ForConditionalGeneration, cfg, tok, out, seed)
    image_processor = transformers.GotOcr2ImageProcessorPil(size={"height": 128, "width": 128})
    transformers.GotOcr2Processor(image_processor=image_processor, tokenizer=tok).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return str(out)
