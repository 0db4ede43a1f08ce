"""A checkpoint's fp8 KV-cache scales, attached to the attention layers that use them
(:class:`~batchgen.attention.KVScales`).

The names checkpoints store them under: compressed-tensors' ``kv_cache_scheme`` and vLLM's
``self_attn.k_scale`` / ``self_attn.v_scale`` (one value per tensor, or one per KV head with strategy
``attn_head``), AutoFP8's ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale`` and the older single
``self_attn.kv_scale`` (both K and V). ``q_scale`` / ``prob_scale`` (fp8 attention arithmetic, which batchgen does
not do: it attends in float32) are read and not used. A layer without scales stores K/V unscaled (scale 1,
vLLM's default).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from batchgen.attention import KVScales

logger = logging.getLogger(__name__)

_NAME = re.compile(
    r"^(?P<layer>.*layers\.\d+\.self_attn)\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.output_scale|"
    r"(?P<both>kv_scale)|(?P<unused>q_scale|prob_scale))$"
)


def is_kv_scale(name: str) -> bool:
    return _NAME.match(name) is not None


@torch.no_grad()
def attach_kv_scales(model: nn.Module, get, names) -> set[str]:
    """Set ``kv_scales`` on each attention layer the checkpoint has scales for (`get(name)` reads a tensor;
    `names`: the checkpoint's tensor names). Returns the names read."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    read = set()
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        read.add(name)
        if m["unused"]:
            continue
        layer = found.setdefault(m["layer"], {})
        if m["both"]:
            layer.setdefault("k", get(name))
            layer.setdefault("v", get(name))
        else:
            layer[m["kv"] or m["proj"]] = get(name)
    if not found:
        return read
    modules = dict(model.named_modules())
    tp = getattr(getattr(model, "config", None), "tp_size", 1)
    for prefix, scales in sorted(found.items()):
        attn = modules.get(prefix)
        if attn is None or not hasattr(attn, "kv_scales"):
            raise ValueError(
                f"KV-cache scales {prefix}.k_scale/v_scale belong to no attention layer of the model"
            )
        if set(scales) != {"k", "v"}:
            raise ValueError(f"{prefix} has a {'k' if 'k' in scales else 'v'} scale without the other")
        if tp > 1 and any(s.numel() > 1 for s in scales.values()):
            raise ValueError(
                "per-head KV-cache scales with engine.tensor_parallel_size > 1 are not supported; set "
                "engine.tensor_parallel_size=1"
            )
        attn.kv_scales = KVScales.of(scales["k"], scales["v"], attn.num_kv_heads)
    logger.info("fp8 KV-cache scales read for %d attention layers", len(found))
    return read
