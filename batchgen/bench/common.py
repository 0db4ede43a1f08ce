"""What the benchmarks share: model-shape arithmetic on :class:`~batchgen.models.config.ModelConfig`, the machine
description printed beside every figure, and the optional ``bench`` extra (psutil, matplotlib) imported lazily.

``psutil`` and ``matplotlib`` come with ``pip install 'batchgen[bench]'``; without them every benchmark still
runs: memory figures fall back to ``/proc/self/statm`` (Linux) and charts are skipped with a message.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from batchgen.models.config import ModelConfig

# ------------------------------------------------------------------------------------ model shapes
LLAMA_13B_CONFIG: dict[str, Any] = {
    # config.json of LLaMA-13B (the PagedAttention paper's model), float16
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "num_hidden_layers": 40,
    "max_position_embeddings": 2048,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "torch_dtype": "float16",
}


def llama_13b() -> ModelConfig:
    return ModelConfig.from_dict(LLAMA_13B_CONFIG, source="LLaMA-13B config.json")


def dtype_bytes(mc: ModelConfig) -> int:
    return mc.dtype.itemsize


def kv_bytes_per_token(mc: ModelConfig, itemsize: int | None = None) -> int:
    """K and V of one token over every layer (what one KV-cache token slot costs)."""
    return 2 * mc.num_layers * mc.kv_size * (itemsize or dtype_bytes(mc))


def layer_params(mc: ModelConfig) -> int:
    """Weights of one decoder layer's linear maps (q, k, v, o, gate, up, down; no norms or biases)."""
    h = mc.hidden_size
    return h * mc.q_size + 2 * h * mc.kv_size + mc.q_size * h + 3 * h * mc.intermediate_size


def num_params(mc: ModelConfig) -> int:
    """Parameters excluding norms and biases (embedding and lm_head counted once each, even if tied)."""
    return mc.num_layers * layer_params(mc) + 2 * mc.hidden_size * mc.vocab_size


def model_flops(mc: ModelConfig, prompt_len: int, cached: int, gen: int) -> float:
    """Model FLOPs to produce ``gen`` tokens after a prompt of which ``cached`` tokens were reused.

    Linear layers: 2 FLOPs per parameter per forwarded token (prompt tokens not cached, plus gen-1 decode
    tokens); lm_head once per generated token; attention: QKᵀ and PV, 4·heads·head_dim FLOPs per (query, key)
    pair per layer, causal.
    """
    first, last = cached, prompt_len + gen - 2  # positions forwarded
    fwd = max(0, last - first + 1)
    pairs = (last + 1) * (last + 2) / 2 - first * (first + 1) / 2 if fwd else 0
    linear = 2 * mc.num_layers * layer_params(mc) * fwd + 2 * mc.hidden_size * mc.vocab_size * gen
    attn = 4 * mc.q_size * mc.num_layers * pairs
    return float(linear + attn)


def matmul_shapes(mc: ModelConfig) -> list[list[Any]]:
    """``[name, K, N]`` of the model's linear maps (the MFU denominator is measured at these shapes)."""
    h, i = mc.hidden_size, mc.intermediate_size
    return [
        ["qkv", h, mc.q_size + 2 * mc.kv_size],
        ["gate_up", h, 2 * i],
        ["down", i, h],
        ["lm_head", h, mc.vocab_size],
    ]


def describe_model(mc: ModelConfig) -> dict[str, Any]:
    return {
        "architecture": mc.architecture,
        "params": num_params(mc),
        "hidden": mc.hidden_size,
        "layers": mc.num_layers,
        "heads": mc.num_heads,
        "kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "intermediate": mc.intermediate_size,
        "vocab": mc.vocab_size,
    }


# ----------------------------------------------------------------------------------------- machine
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu_name(),
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ------------------------------------------------------------------------------ optional: bench extra
def rss_bytes() -> int:
    """This process's resident set size: psutil if installed, else /proc/self/statm, else 0."""
    try:
        import psutil
    except ImportError:
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0
    return psutil.Process().memory_info().rss


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: charts skipped (pip install 'batchgen[bench]')", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
