"""Engine configuration: one typed dataclass shared by the Python API and the Hydra job config."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: str | int | float) -> int:
    """Parse a memory size such as ``4GiB``, ``512MB``, ``1e9`` or ``4000000000`` into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"invalid memory size {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"invalid memory size {value!r}: use a number of bytes or a number with a unit "
            f"(B, KB, MB, GB, KiB, MiB, GiB, TiB), e.g. '4GiB'"
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return n


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``engine.kv_cache_dtype``'s values (vLLM's); :mod:`batchgen.kernels.kv_cache_dtype` maps each to a torch dtype.
Checked here without torch: the command builds an EngineConfig before torch may load."""


@dataclass
class EngineConfig:
    """Options of the paged-attention engine (``engine.*`` in the job config)."""

    block_size: int = 16
    """Tokens per KV-cache block (8, 16, 32 or 64)."""
    max_num_seqs: int = 256
    """Most sequences scheduled in one step."""
    max_num_batched_tokens: int = 4096
    """Token budget of one step (decodes + prefill chunks); prompts longer than this are prefilled in chunks."""
    max_model_len: int | None = None
    """Longest prompt + generation, in tokens (default: the model's max_position_embeddings)."""
    gpu_memory_utilization: float = 0.90
    """CUDA: fraction of the device's total memory the engine may use (weights + activations + KV cache)."""
    kv_cache_memory: str = "2GiB"
    """CPU: bytes for the KV cache pool, e.g. '4GiB'."""
    num_blocks: int | None = None
    """Exact number of KV blocks; overrides gpu_memory_utilization and kv_cache_memory."""
    kv_cache_dtype: str = "auto"
    """K/V element type (vLLM's names): 'auto' (the model's activation dtype: float32 on the CPU), 'float32',
    'bfloat16', 'float16', 'fp8' (= 'fp8_e4m3') or 'fp8_e5m2' (scale 1, saturating). A narrower cache fits
    proportionally more blocks in the same memory; attention widens it on load (exact over the rounded K/V)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical token prefixes across requests."""
    attention_backend: str = "auto"
    """'auto' (triton on CUDA, torch on CPU), 'torch' or 'triton'."""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu', 'cuda' or 'cuda:N'."""
    seed: int = 0
    """Seed of the engine's sampling generator for requests without their own seed."""
    preemption_mode: str = "recompute"
    """What happens to a sequence preempted when KV blocks run out: 'recompute' (free its blocks, recompute its
    prompt and output later) or 'swap' (copy its blocks to CPU memory, engine.swap_space, and back; falls back
    to recompute when the CPU pool is full). A request group is preempted as one."""
    swap_space: str = "4GiB"
    """CPU memory for swapped-out KV blocks with preemption_mode=swap, e.g. '4GiB' (pinned on CUDA)."""
    num_swap_blocks: int | None = None
    """Exact number of CPU swap blocks; overrides swap_space (preemption_mode=swap only)."""
    enforce_eager: bool = False
    """CUDA: run every step eagerly. By default decode-only steps of up to max_num_seqs sequences are padded to
    a batch-size bucket (1, 2, 4, 8, then multiples of 16) and replayed from a CUDA graph captured per bucket
    on first use; prefill/mixed steps always run eagerly. No effect on CPU."""

    max_logprobs: int = 20
    """Most log-probabilities a request may ask for per token (``logprobs`` and ``prompt_logprobs``; vLLM's
    default): each costs memory and output space for every token. -1 = no cap (up to the whole vocabulary)."""

    tensor_parallel_size: int = 1
    """Shard the model over this many devices (Megatron-style tensor parallelism, native architectures only):
    the engine starts one worker process per extra device (or joins ranks started by torchrun/srun). On CPU
    the ranks communicate with gloo (for tests); the KV pool is the smallest any rank can hold."""

    async_scheduling: bool = False
    """Overlap the engine's Python with the forward: while step N's forward and sampling run (in a worker
    thread), step N+1 is scheduled and its inputs prepared, the tokens of N standing in as placeholders
    (:mod:`batchgen.engine.worker.executor`). Token ids, texts and finish reasons are identical to it off (logprobs
    to float rounding). Steps of requests whose features need a step's output before the next step is planned
    (:meth:`~batchgen.engine.sched.request_group.RequestGroup.overlappable`), steps that swap, and steps with a
    pool too full to rule out preemption run synchronously (the pipeline drains first). Composes with
    tensor_parallel_size > 1 (each launched step is broadcast to the other ranks)."""

    data_parallel_size: int = 1
    """Job only: run this many engine replicas, each in its own process (each with tensor_parallel_size
    devices on CUDA; on the CPU the cores are split between them); a coordinator hands windows to whichever
    replica frees up and writes the output (run.executor chooses local processes or Ray actors)."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories) per request: ``LoRARequest`` in the API, ``model.lora_modules`` and
    ``data.lora_column`` in a job. Native architectures only."""
    max_loras: int = 4
    """With enable_lora: adapters resident at once (slots); the others are loaded on demand, least recently used
    first out. Rows of different resident adapters and the base model share every step."""
    max_lora_rank: int = 64
    """With enable_lora: the largest adapter rank accepted (slots are sized for it)."""
    max_cpu_loras: int | None = None
    """With enable_lora: parsed adapters kept in CPU memory for reloading (default: max_loras)."""

    encoder_cache_memory: str = "1GiB"
    """Image-text models: bytes of vision-encoder outputs kept for reuse (least recently used evicted first),
    so an image shown by many rows is encoded once while its features fit."""
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    """Image-text models: most items per prompt by modality, e.g. ``{image: 4}`` (vLLM's name); a row with
    more fails alone. A modality not named has no limit."""
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """Image-text models: options of the checkpoint's image processor for every image (vLLM's name), e.g.
    ``{max_pixels: 1003520}`` to bound Qwen2-VL's image tokens or ``{size: {shortest_edge: 448}}``; the
    processor applies them as transformers' own processor call does. A key the processor does not take is
    refused before the first image (a job: at start, exit status 2)."""

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"engine.block_size must be one of 8, 16, 32, 64, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"engine.max_model_len must be >= 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"engine.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        parse_bytes(self.kv_cache_memory)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"engine.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"engine.num_blocks must be >= 1, got {self.num_blocks}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"engine.attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"engine.preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        parse_bytes(self.swap_space)
        parse_bytes(self.encoder_cache_memory)
        # None (vLLM's default for both) means none given: no limit, no options
        self.limit_mm_per_prompt = dict(self.limit_mm_per_prompt or {})
        self.mm_processor_kwargs = dict(self.mm_processor_kwargs or {})
        if self.num_swap_blocks is not None and self.num_swap_blocks < 1:
            raise ValueError(f"engine.num_swap_blocks must be >= 1, got {self.num_swap_blocks}")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"engine.max_cpu_loras must be >= 1, got {self.max_cpu_loras}")
        if self.max_logprobs < -1:
            raise ValueError(f"engine.max_logprobs must be >= 0 (or -1: no cap), got {self.max_logprobs}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"engine.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


def logprobs_error(logprobs: int | None, prompt_logprobs: int | None, max_logprobs: int) -> str | None:
    """Why a request asking for these numbers of logprobs per token is refused (more than ``max_logprobs``,
    unless it is -1), or None."""
    if max_logprobs < 0:
        return None
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > max_logprobs:
            return (
                f"{name}={value} is more than engine.max_logprobs={max_logprobs}: ask for at most "
                f"{max_logprobs} per token, or raise engine.max_logprobs (-1: no cap)"
            )
    return None
