"""Load a Hugging Face checkpoint directory for the engine: into our native `CausalLM` (streaming safetensors
tensor by tensor), or through transformers' modeling code (`batchgen.models.transformers_backend`).

Invariants:
- Only `*.safetensors` files are ever opened (through `safetensors.safe_open`); pickle checkpoints
  (`*.bin`, `*.pt`, `*.pth`) are refused, and `trust_remote_code` is never used.
- The model is built on the meta device and materialised once, empty, in the target dtype on the
  target device; then each checkpoint tensor is read, copied into its (slice of a) parameter and
  dropped, so peak memory is the model plus one tensor, never a second full state dict. Float32 CPU weights
  are then re-laid out one module at a time for faster GEMMs (`batchgen.models.packed_linear`: oneDNN-packed
  projections, column-major expert stacks).
- Every parameter element is written exactly once; anything missing, unexpected or misshapen is a
  `ValueError` naming the tensor and the file. Checkpoint tensors are mapped onto our parameters by
  `_checkpoint_names` (q/k/v and gate/up fused, per-expert tensors stacked, Mixtral's `block_sparse_moe`).
- Tensor parallelism (`tp_size > 1`): the model is built with one rank's shapes
  (`batchgen.models.parallel.shard_config`) and each tensor is read sliced (`batchgen.models.sharding`):
  a rank reads only its share of the checkpoint from disk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchgen.kernels import cpu_kernel
from batchgen.models.config import IMAGE_TEXT_ARCHITECTURES, ModelConfig, NativeUnsupportedError, parse_dtype
from batchgen.models.llama import CausalLM
from batchgen.models.meta_init import materialize, skip_init
from batchgen.models.packed_linear import fast_cpu_weights
from batchgen.models.parallel import check_divisible, shard_config
from batchgen.models.quant.compressed_tensors import (
    IntScheme,
    quantization_scheme,
    replace_linears,
    tensor_parallel_refusal,
)
from batchgen.models.quant.gguf_checkpoint import (
    UnsupportedCheckpoint,
    gguf_path,
    load_gguf_model,
    load_gguf_tokenizer,
)
from batchgen.models.quant.gguf_checkpoint import read_config as read_gguf_config
from batchgen.models.quant.kv_scales import attach_kv_scales
from batchgen.models.quant.linear_loader import TensorReader, kv_scale_names, load_quantized_linears
from batchgen.models.quant.weight_dtype import compute_dtype
from batchgen.models.sharding import read_shard

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "native", "transformers")

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Checkpoint tensors we know and do not need (old checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a directory: pass a local Hugging Face checkpoint directory "
            "(batchgen never downloads from a hub)"
        )
    return p


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: from `model.safetensors.index.json` if present, else `*.safetensors`."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) missing from {path}: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        hint = (
            f" (found {', '.join(pickles)}: pickle checkpoints are never loaded; convert them to safetensors)"
            if pickles
            else ""
        )
        raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")
    return files


def _resolve_dtype(config_dtype: torch.dtype, dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str) and dtype.lower() == "auto":
        return config_dtype
    return parse_dtype(dtype)


@dataclass(frozen=True)
class _Source:
    """Where one checkpoint tensor goes: `param[expert]` (when not None), rows `offset:offset+rows` (all if -1)."""

    param: str
    offset: int = 0
    rows: int = -1
    expert: int | None = None


def expert_prefixes(config: ModelConfig, experts: str, e: int) -> tuple[list[str], str]:
    """The checkpoint prefixes of expert `e` of our stacked `experts` module (``model.layers.N.mlp.experts``):
    ``([gate, up], down)``, Mixtral's ``block_sparse_moe.experts.e.w1 / w3 / w2``, else ``experts.e.gate_proj /
    up_proj / down_proj``."""
    if config.model_type == "mixtral":
        base = f"{experts.replace('.mlp.', '.block_sparse_moe.')}.{e}"
        return [f"{base}.w1", f"{base}.w3"], f"{base}.w2"
    base = f"{experts}.{e}"
    return [f"{base}.gate_proj", f"{base}.up_proj"], f"{base}.down_proj"


def _checkpoint_names(
    config: ModelConfig, name: str, shape: tuple[int, ...]
) -> list[list[tuple[str, _Source]]]:
    """Alternative ways a checkpoint may store our parameter `name`: each a list of (HF tensor name, source).

    The first alternative is the canonical one (named in "missing tensor" errors).
    """
    prefix, _, leaf = name.rpartition(".")  # leaf: weight / bias / gate_up_proj / down_proj
    head, _, module = prefix.rpartition(".")
    if head.endswith((".experts.gate_up", ".experts.down")) and module.isdigit():  # PackedExperts' expert
        gate_up, down = expert_prefixes(config, head.rpartition(".")[0], int(module))
        if head.endswith(".down"):
            return [[(f"{down}.{leaf}", _Source(name))]]
        rows = shape[0] // 2
        return [
            [
                (f"{gate_up[0]}.{leaf}", _Source(name, 0, rows)),
                (f"{gate_up[1]}.{leaf}", _Source(name, rows, rows)),
            ]
        ]
    moe_prefix = head.replace(".mlp", ".block_sparse_moe") if config.model_type == "mixtral" else head
    if module == "experts" and leaf in ("gate_up_proj", "down_proj"):
        num_experts, inter = shape[0], (shape[1] // 2 if leaf == "gate_up_proj" else shape[2])
        per_expert: list[tuple[str, _Source]] = []
        for e in range(num_experts):
            base = f"{moe_prefix}.experts.{e}"
            if config.model_type == "mixtral":
                parts = {
                    "gate_up_proj": [("w1", 0, inter), ("w3", inter, inter)],
                    "down_proj": [("w2", 0, -1)],
                }
            else:
                parts = {
                    "gate_up_proj": [("gate_proj", 0, inter), ("up_proj", inter, inter)],
                    "down_proj": [("down_proj", 0, -1)],
                }
            per_expert += [
                (f"{base}.{w}.weight", _Source(name, off, rows, e)) for w, off, rows in parts[leaf]
            ]
        return [per_expert, [(f"{moe_prefix}.experts.{leaf}", _Source(name))]]
    if config.model_type == "mixtral" and name.endswith(".mlp.gate.weight"):
        return [[(f"{moe_prefix}.gate.weight", _Source(name))]]
    if module == "qkv_proj" and not config.fused_checkpoint:
        q, kv = config.q_size, config.kv_size
        return [
            [
                (f"{head}.q_proj.{leaf}", _Source(name, 0, q)),
                (f"{head}.k_proj.{leaf}", _Source(name, q, kv)),
                (f"{head}.v_proj.{leaf}", _Source(name, q + kv, kv)),
            ]
        ]
    if module == "gate_up_proj" and not config.fused_checkpoint:
        inter = shape[0] // 2
        return [
            [
                (f"{head}.gate_proj.{leaf}", _Source(name, 0, inter)),
                (f"{head}.up_proj.{leaf}", _Source(name, inter, inter)),
            ]
        ]
    return [[(name, _Source(name))]]


_MULTIMODAL_PREFIXES = (  # (checkpoint prefix, ours): transformers 4.x and 5.x layouts of the language model
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),
)
_VISION_PREFIXES = (
    "visual.",
    "model.visual.",
    "model.vision_model.",
    "model.connector.",
    "vision_tower.",
    "multi_modal_projector.",
    "image_newline",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.image_newline",
)


def _text_model_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor name as the text-only model names it; None for vision weights."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for theirs, ours in _MULTIMODAL_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


def _weight_map(
    config: ModelConfig, params: dict[str, torch.nn.Parameter]
) -> tuple[dict[str, _Source], dict[str, list[str]]]:
    """(HF tensor name -> source for every accepted name, our param -> its canonical HF names)."""
    lookup: dict[str, _Source] = {}
    canonical: dict[str, list[str]] = {}
    for name, param in params.items():
        alternatives = _checkpoint_names(config, name, tuple(param.shape))
        canonical[name] = [hf for hf, _ in alternatives[0]]
        for alt in alternatives:
            lookup.update(alt)
    return lookup, canonical


@torch.no_grad()
def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    implementation: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
):
    """Load a checkpoint directory (config.json + safetensors), or a GGUF file (`path` ending in ``.gguf``:
    `batchgen.models.quant.gguf_checkpoint`), for the engine.

    `implementation`: ``native`` (our own decoders; fails for an architecture we have no code for),
    ``transformers`` (transformers' modeling code over our paged attention, any decoder-only architecture),
    or ``auto`` (native when we have it, else transformers). `dtype`: 'auto' (the checkpoint's
    `dtype`/`torch_dtype`, float32 if absent), 'float32', 'bfloat16', 'float16' or a torch.dtype: the dtype the
    weights are held in. A native model on the CPU computes a bfloat16/float16 model in float32
    (`batchgen.models.quant.weight_dtype`); `model.config.dtype` reports the dtype computed in,
    `model.config.weight_dtype` the weights', `model.config.implementation` the path taken.
    `tp_rank` / `tp_size`: load rank `tp_rank`'s shard for tensor parallelism over `tp_size` ranks (native
    architectures only; anything else is a ValueError naming `engine.tensor_parallel_size`).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown model implementation {implementation!r}: use one of {', '.join(IMPLEMENTATIONS)}"
        )
    gguf_file = gguf_path(path)
    if gguf_file is not None:  # a GGUF file: its own loader (batchgen.models.quant.gguf_checkpoint)
        if implementation == "transformers":
            raise UnsupportedCheckpoint(
                "a GGUF checkpoint runs on batchgen's native code: set model.implementation auto or native"
            )
        if torch.device(device).type == "cpu":
            cpu_kernel.start_build()
        if tp_size > 1:
            check_tensor_parallel(gguf_file, implementation, tp_size)
        return load_gguf_model(gguf_file, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size)
    ckpt = _checkpoint_dir(path)
    if torch.device(device).type == "cpu":
        cpu_kernel.start_build()  # the C kernels (linear layers, attention) compile while the weights load
    if tp_size > 1:
        config = check_tensor_parallel(ckpt, implementation, tp_size)
        return load_native_model(ckpt, shard_config(config, tp_rank, tp_size), dtype=dtype, device=device)
    if _transformers_image_text(ckpt, implementation):
        from batchgen.models.vision_transformers_lm import load as load_image_text

        return load_image_text(ckpt, dtype=dtype, device=device)
    if implementation == "transformers":
        if quantization_scheme(ckpt) is not None:
            raise UnsupportedCheckpoint(
                f"quantized checkpoint {ckpt} runs on batchgen's native code: use model.implementation auto or "
                "native"
            )
        from batchgen.models.transformers_backend import load_transformers_model

        return load_transformers_model(ckpt, dtype=dtype, device=device)
    try:
        config = ModelConfig.from_pretrained(ckpt)
    except NativeUnsupportedError as e:
        if quantization_scheme(ckpt) is not None:
            raise UnsupportedCheckpoint(
                f"{e}: quantized checkpoints run on batchgen's native code only"
            ) from e
        if implementation == "native":
            raise e.for_native_only() from e
        from batchgen.models.transformers_backend import load_transformers_model

        logger.info("no native implementation (%s): using the transformers backend", e)
        return load_transformers_model(ckpt, dtype=dtype, device=device)
    if config.architecture in IMAGE_TEXT_ARCHITECTURES:
        import importlib

        family = importlib.import_module(IMAGE_TEXT_ARCHITECTURES[config.architecture])
        return family.load(ckpt, config, dtype, device)
    return load_native_model(ckpt, config, dtype=dtype, device=device)


def _transformers_image_text(ckpt: Path, implementation: str) -> bool:
    """Whether ``ckpt`` (unquantized) loads as an image-text model on transformers' modeling code
    (:func:`batchgen.models.config.runs_whole_on_transformers`)."""
    from batchgen.models.config import read_config_files, runs_whole_on_transformers

    try:
        config = read_config_files(ckpt)[0]
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") or []
    return (
        runs_whole_on_transformers(list(archs), implementation, config) and quantization_scheme(ckpt) is None
    )


def check_tensor_parallel(path: str | os.PathLike, implementation: str, tp_size: int) -> ModelConfig:
    """The checkpoint's (whole-model) config if it can be sharded over `tp_size` ranks; else a ValueError
    naming `engine.tensor_parallel_size` (the transformers backend and non-native architectures run on one
    device; heads and intermediate sizes must split). An image-text checkpoint shards its language model and
    runs text only: its images run on one device."""
    refused = (
        f"engine.tensor_parallel_size={tp_size} needs a natively implemented architecture "
        "(batchgen.models.NATIVE_ARCHITECTURES) and model.implementation auto or native: the transformers "
        "backend runs on one device; set engine.tensor_parallel_size=1"
    )
    if implementation == "transformers":
        raise ValueError(refused)
    if (gguf_file := gguf_path(path)) is not None:  # split by load_gguf_model
        config = read_gguf_config(gguf_file)
        if config.moe is not None:
            raise UnsupportedCheckpoint(
                f"engine.tensor_parallel_size={tp_size}: GGUF mixture-of-experts file {gguf_file.name} runs on "
                "one rank; set engine.tensor_parallel_size=1"
            )
        check_divisible(config, tp_size)
        return config
    if quantization_scheme(_checkpoint_dir(path)) is not None:  # split by batchgen.models.sharding
        problem = tensor_parallel_refusal(_checkpoint_dir(path))
        if problem:
            raise UnsupportedCheckpoint(
                f"engine.tensor_parallel_size={tp_size}: {problem}; set engine.tensor_parallel_size=1"
            )
    try:
        config = ModelConfig.from_pretrained(_checkpoint_dir(path))
    except NativeUnsupportedError as e:
        raise ValueError(f"{refused} ({e})") from e
    check_divisible(config, tp_size)  # an image-text checkpoint: its language model, text only
    return config


@torch.no_grad()
def load_native_model(
    ckpt: Path,
    config: ModelConfig,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    rename: Callable[[str], str | None] | None = None,
) -> CausalLM:
    """Build our `CausalLM` for `config` (one rank's shard when `config.tp_size > 1`) and stream the
    checkpoint's safetensors into it. `rename` maps a stored tensor name to ours (None: not this model's, e.g.
    a classification head read by the caller)."""
    weight_dtype = _resolve_dtype(config.dtype, dtype)
    device = torch.device(device)
    config = dataclasses.replace(
        config, dtype=compute_dtype(weight_dtype, device), weight_dtype=weight_dtype
    )  # narrow weights on the CPU compute in float32 (batchgen.models.quant.weight_dtype)
    files = safetensors_files(ckpt)

    model = meta_model(config)  # quantized projections are swapped in before the rest is given storage
    scheme = quantization_scheme(ckpt)  # quantized projections (batchgen.models.quant)
    replaced: tuple[str, ...] = ()
    if scheme is not None:  # on a GPU, the Triton weight-only kernels (batchgen.kernels.quant_linear_triton)
        if isinstance(scheme, IntScheme):  # compressed-tensors' packed tensors stream in like float ones
            replace_linears(model, config, scheme, TensorReader(files).where, device)  # names only
            rename = _without_shapes(rename)
        else:  # GPTQ, AWQ, fp8: read and repacked per projection first
            read, modules = load_quantized_linears(model, config, files, scheme, device)
            replaced = tuple(f"{m}." for m in modules)
            rename = _skipping(read, rename)
    materialize_rest(model, config, device)
    if scales := kv_scale_names(files):  # fp8 KV-cache scales, kept by the attention layers
        get = TensorReader(files)
        rename = _skipping(attach_kv_scales(model, get, scales), rename)
    params = {  # tied lm_head is deduplicated: only embed_tokens
        n: p for n, p in model.named_parameters() if not n.startswith(replaced)
    }
    lookup, canonical = _weight_map(config, params)
    written = dict.fromkeys(params, 0)  # elements written per parameter
    seen: dict[str, str] = {}  # HF tensor name -> file it came from
    for file in files:
        _copy_file(file, config, params, lookup, written, seen, rename)
    _check_complete(ckpt, files, params, canonical, written, seen)
    fast_cpu_weights(model, keep=[model.model.embed_tokens.weight], narrow=config.dtype != weight_dtype)
    return model


def _skipping(names: set[str], rename: Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    """`rename`, also skipping the tensors already read into quantized projections."""

    def skip(name: str) -> str | None:
        if name in names:
            return None
        return name if rename is None else rename(name)

    return skip


def _without_shapes(rename: Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    """`rename`, also skipping compressed-tensors' `*.weight_shape` records (the shapes are the model's)."""

    def skip(name: str) -> str | None:
        if name.endswith(".weight_shape"):
            return None
        return name if rename is None else rename(name)

    return skip


def _empty_model(config: ModelConfig, device: torch.device) -> CausalLM:
    """An uninitialised `CausalLM` in eval mode, no grads, on `device` (a tied head shares the embedding)."""
    return materialize_rest(meta_model(config), config, device)


def meta_model(config: ModelConfig) -> CausalLM:
    """A `CausalLM` on the meta device (no storage), in eval mode, no grads: a quantized checkpoint's loader
    swaps its quantized projections for packed modules on the target device before :func:`materialize_rest`
    gives the rest storage, so the dense weights they replace are never allocated (on a GPU they would be, at
    once)."""
    with torch.device("meta"), skip_init():  # meta parameters hold no data: nothing to initialise
        model = CausalLM(config)
    return model.eval().requires_grad_(False)


def materialize_rest(model: CausalLM, config: ModelConfig, device: torch.device) -> CausalLM:
    """`model` with every tensor still on the meta device given uninitialised storage on `device` (floating
    point in the weight dtype); tensors already on a device are kept. A tied head still a plain projection
    shares the embedding again (materializing gives each module its own copy of a shared parameter)."""
    materialize(model, config.weight_dtype or config.dtype, device)
    if config.tie_word_embeddings and type(model.lm_head) is torch.nn.Linear:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _copy_file(
    file: Path,
    config: ModelConfig,
    params: dict[str, torch.nn.Parameter],
    lookup: dict[str, _Source],
    written: dict[str, int],
    seen: dict[str, str],
    rename: Callable[[str], str | None] | None = None,
) -> None:
    """Copy each tensor of one safetensors file into its parameter (slice), counting the elements written
    per parameter in `written` and recording each tensor's file in `seen`; refuses unknown, repeated or
    misshapen tensors."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for stored in f.keys():
            name = _text_model_name(stored) if config.multimodal else stored
            if rename is not None and name is not None:
                name = rename(name)
            if name is None or name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            src = lookup.get(name)
            if src is None:
                raise ValueError(
                    f"unexpected tensor {name!r} in {file.name} (no matching parameter in {config.architecture})"
                )
            if name in seen:
                raise ValueError(f"tensor {name!r} appears in both {seen[name]} and {file.name}")
            param = params[src.param]
            dest = param if src.expert is None else param[src.expert]
            if src.rows >= 0:
                dest = dest.narrow(0, src.offset, src.rows)
            tensor = f.get_tensor(stored) if config.tp_size == 1 else read_shard(f, stored, name, config)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(dest.shape)} from config.json"
                )
            dest.copy_(tensor)
            written[src.param] += tensor.numel()
            del tensor
            seen[name] = file.name


def _check_complete(
    ckpt: Path,
    files: list[Path],
    params: dict[str, torch.nn.Parameter],
    canonical: dict[str, list[str]],
    written: dict[str, int],
    seen: dict[str, str],
) -> None:
    """Every parameter written exactly once over: none twice, none short of its size."""
    over = sorted(p for p, n in written.items() if n > params[p].numel())
    if over:
        raise ValueError(
            f"checkpoint {ckpt} writes parameter(s) {', '.join(over)} twice (two tensor layouts?)"
        )
    missing = sorted(
        hf for p, n in written.items() if n < params[p].numel() for hf in canonical[p] if hf not in seen
    )
    if missing:
        shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        raise ValueError(
            f"checkpoint {ckpt} is missing tensor(s) {shown}; searched {', '.join(p.name for p in files)}"
        )


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer: a `batchgen.models.tokenizer.FastTokenizer` read from tokenizer.json where that is
    known to give exactly transformers' ids and text (no transformers import), else `AutoTokenizer` (local
    files only, no remote code)."""
    from batchgen.models.tokenizer import load_checkpoint_tokenizer

    gguf_file = gguf_path(path)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file)
    return load_checkpoint_tokenizer(_checkpoint_dir(path))
