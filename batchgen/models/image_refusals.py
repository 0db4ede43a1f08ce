"""Why batchgen does not run an image-text architecture's images: one clause per architecture, for the one-line
refusal (:func:`batchgen.models.config.no_images_reason`) that an image prompt or an image job gets.

An image-text checkpoint runs here when its language model has plain causal attention (optionally
sliding-window) and 1-D positions, and the vision side's output takes the place of placeholder tokens that its
processor writes into the prompt, computed from the image alone: with a native language model
(:mod:`batchgen.models.vision_transformers`) or, for the architectures whose output has been checked that way,
on transformers' modeling code over the paged cache (:mod:`batchgen.models.vision_transformers_lm`). The
architectures below break one of those conditions; another architecture gets the statement that its output has
not been checked against transformers here (naming its language model's type when ``config.json`` does).
"""

from __future__ import annotations

from typing import Any

_BIDIRECTIONAL = "its language model attends bidirectionally over the image and the prompt, as a prefix LM"
_CROSS_ATTENTION = "its language model reads the image through cross-attention layers, not prompt tokens"
_ENCODER_DECODER = "an encoder-decoder model: batchgen runs decoder-only language models"
_MROPE = (
    "its language model takes 3-D (M-RoPE) positions over the image grid and image features inside its layers"
)
_MROPE_POSITIONS = (
    "its language model takes multi-axis (M-RoPE) positions over the image grid, which batchgen computes for "
    "Qwen2-VL and Qwen2.5-VL only"
)
_TORCHVISION = (
    "its processor needs torchvision, whose wheels are built against CUDA torch and do not load beside the "
    "CPU build"
)
_VQ = "its images are discrete tokens of a VQ image tokenizer that the language model also generates"

REFUSED: dict[str, str] = {
    "PaliGemmaForConditionalGeneration": _BIDIRECTIONAL,
    "MllamaForConditionalGeneration": _CROSS_ATTENTION,
    "IdeficsForVisionText2Text": _CROSS_ATTENTION,
    "Llama4ForConditionalGeneration": "its language model (Llama 4) attends in fixed chunks on most layers, "
    "which the paged kernels cannot apply, and its image processor needs torchvision",
    "InstructBlipForConditionalGeneration": "its Q-Former reads the prompt's text with the image, so an image's "
    "features depend on the prompt and cannot be encoded once and cached by the image",
    "InstructBlipVideoForConditionalGeneration": "its Q-Former reads the prompt's text with the image, so an "
    "image's features depend on the prompt and cannot be encoded once and cached by the image",
    "FuyuForCausalLM": "its processor rewrites the whole prompt around the image (the image's rows first, "
    "then BOS, and a beginning-of-answer token appended), which batchgen's placeholder expansion does not "
    "reproduce",
    "Lfm2VlForConditionalGeneration": "its language model (LFM2) has short-convolution layers, whose state "
    "batchgen's KV cache cannot hold",
    "Cohere2VisionForConditionalGeneration": _TORCHVISION + " (Cohere2VisionImageProcessor)",
    "Mistral3ForConditionalGeneration": _TORCHVISION + " (PixtralProcessor)",
    "MistralLarge4ForConditionalGeneration": _TORCHVISION + " (PixtralProcessor)",
    "LlavaOnevisionForConditionalGeneration": _TORCHVISION + " (its video processor)",
    "InternVLForConditionalGeneration": _TORCHVISION + " (its video processor)",
    "SmolVLMForConditionalGeneration": _TORCHVISION + " (its video processor)",
    "Qwen3VLForConditionalGeneration": _MROPE,
    "Qwen3VLMoeForConditionalGeneration": _MROPE,
    "Glm4vForConditionalGeneration": _MROPE,
    "Glm4vMoeForConditionalGeneration": _MROPE,
    "Glm46VForConditionalGeneration": _MROPE,
    "PaddleOCRVLForConditionalGeneration": _MROPE_POSITIONS,
    "HunYuanVLForConditionalGeneration": _MROPE_POSITIONS,
    "Granite4VisionForConditionalGeneration": "its image features are added inside its language model's layers "
    "(deepstack and spatial injection), not only in place of prompt tokens",
    "Ovis2ForConditionalGeneration": "its image indicator tokens take embeddings from its visual embedding table, "
    "not from the language model's",
    "ChameleonForConditionalGeneration": _VQ,
    "Emu3ForConditionalGeneration": _VQ,
    "Florence2ForConditionalGeneration": _ENCODER_DECODER,
    "Pix2StructForConditionalGeneration": _ENCODER_DECODER,
    "UdopForConditionalGeneration": _ENCODER_DECODER,
    "VisionEncoderDecoderModel": _ENCODER_DECODER,
    "T5Gemma2ForConditionalGeneration": _ENCODER_DECODER,
    "BlipForConditionalGeneration": _ENCODER_DECODER,
}


def refusal_reason(architecture: str, config: dict[str, Any] | None = None) -> str:
    """The clause saying why ``architecture``'s images are not run (``config``: its ``config.json``, when
    known, names the language model's type)."""
    if architecture in REFUSED:
        return REFUSED[architecture]
    text = (config or {}).get("text_config") or {}
    text_type = text.get("model_type") if isinstance(text, dict) else None
    if text_type:
        return f"its output (language model: {text_type}) has not been checked against transformers here"
    return "its output has not been checked against transformers here"
