"""PEFT adapters for tests, built offline on tiny checkpoints, and PEFT's own greedy tokens as the reference."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="LoRA equality tests compare against PEFT: pip install peft")

NEW = 12
PROMPTS = [  # token ids: two pairs share a prefix, one prompt is short
    [5, 9, 33, 7, 100, 3, 41, 8, 77, 12, 19],
    [17, 2, 250, 11, 12, 300, 6],
    [5, 9, 33, 7, 100, 3, 41, 8, 77, 12, 19, 64, 65],
    [401, 402, 7, 7, 9, 200, 150, 3, 1, 88],
    [60, 61, 62],
    [17, 2, 250, 11, 12, 300, 6, 9, 9],
]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ROOT = Path(tempfile.mkdtemp(prefix="batchgen-lora-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@cache
def adapter(
    base: str, r: int, targets: tuple[str, ...], alpha: float = 16.0, seed: int = 0, rslora: bool = False
) -> str:
    """:func:`make_adapter` built once per process for these arguments (shared by the test modules)."""
    out = _ROOT / f"{abs(hash((base, r, targets, alpha, seed, rslora)))}"
    return make_adapter(base, out, r, list(targets), alpha, seed, rslora)


def two_adapters(base: str) -> tuple[str, str]:
    """The pair the equality tests mix: rank 4 on q/v (alpha 8), and rank 16 on every projection with rsLoRA."""
    return adapter(base, 4, ("q_proj", "v_proj"), 8, 1), adapter(base, 16, ALL, 32, 2, True)


def make_adapter(
    base: str,
    out: Path,
    r: int,
    targets: list[str],
    alpha: float = 16.0,
    seed: int = 0,
    use_rslora: bool = False,
    std: float = 0.15,
) -> str:
    """A random PEFT LoRA adapter of ``base`` (rank ``r`` on ``targets``) saved as safetensors in ``out``.
    Both factors are random (normal, ``std``) so the adapter visibly changes greedy output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0)
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    pm.save_pretrained(str(out), safe_serialization=True)
    return str(out)


@cache
def _peft_model(base: str, adapter: str | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def peft_greedy(base: str, adapter: str | None, prompt: list[int], n: int = NEW) -> list[int]:
    """Greedy tokens of ``prompt`` under PEFT (base model with the adapter applied; None: the base alone)."""
    model = _peft_model(base, adapter)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def peft_logits(base: str, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    """PEFT's float32 logits ``[len(prompt), vocab]`` of a prompt."""
    model = _peft_model(base, adapter)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt])).logits[0].float()
