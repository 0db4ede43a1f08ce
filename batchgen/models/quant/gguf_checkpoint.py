"""GGUF checkpoints (llama.cpp's single-file format): ``model.path=file.gguf`` (or ``model.gguf_file=`` inside a
directory) loads the model, its configuration and its tokenizer from the file.

The configuration and the tokenizer are transformers' own readings of the file's metadata (``gguf_file=``), so
they are what ``AutoModelForCausalLM.from_pretrained(..., gguf_file=)`` builds; the weights are read with the
``gguf`` package. Projections in a block format the CPU GEMM multiplies (:data:`FORMATS`: Q4_0, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS) stay packed (:class:`~batchgen.models.quant.quant_linear.QuantLinear`: a fused q/k/v or gate/up keeps each
part's format); float tensors (F32, F16, BF16) and quantized embeddings and norms are widened to float32 once, with
transformers' transforms (llama.cpp's q/k row order reversed, on the packed rows). The model computes in
float32 on the CPU: greedy output equals transformers' (which dequantizes everything to float32) token for token.
On a GPU the projections are repacked once at load into grouped integers (:mod:`.gguf_repack`) that the Triton
weight-only GEMM multiplies, still in float32. Under tensor parallelism each rank keeps its rows (column-parallel)
or its whole blocks of each row (row-parallel) of the packed tensors.

A ``qwen2moe`` / ``qwen3moe`` file's experts (``ffn_{gate,up,down}_exps``) stay packed too, one projection per
expert (:class:`~batchgen.models.moe.PackedExperts`); in a float file they are read into the stacked experts.

Invariants: every parameter is written exactly once, and a tensor in a format batchgen does not run, an
architecture it has no GGUF mapping for, expert tensors in another architecture (Mixtral's ``llama`` files) or
one part of a split model (``split.count`` > 1) is refused by name, in one line, before anything is computed
(:class:`UnsupportedCheckpoint`, a ValueError).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from batchgen.kernels.cpu_quant_linear import FORMATS
from batchgen.models.config import CAUSAL_ARCHITECTURE_OF_TYPE, ModelConfig
from batchgen.models.moe import Experts, PackedExperts
from batchgen.models.quant.group_linear import GroupQuantLinear
from batchgen.models.quant.quant_linear import QuantLinear

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe")
"""GGUF ``general.architecture`` values batchgen loads (natively implemented, plain tensor layouts)."""
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")
"""The architectures among them whose files hold packed experts (``ffn_{gate,up,down}_exps``,
``[experts, rows, blocks]``)."""
_MOE_SIZES = {"expert_feed_forward_length": "moe_intermediate_size",
              "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}  # fmt: skip
GEMMA_NORM_ARCHS = ("gemma2", "gemma3")
"""Architectures whose GGUF files store norm weights as ``1 + w`` (llama.cpp's converter adds the one,
transformers' reading takes it off)."""
_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}


class UnsupportedCheckpoint(ValueError):
    """A checkpoint format, scheme or tensor type batchgen does not run (named in the message)."""


def gguf_path(path: str | Path, gguf_file: str | None = None) -> Path | None:
    """The GGUF file a model path names (``path`` itself when it ends in ``.gguf``, or ``path/gguf_file``), else
    None."""
    if gguf_file:
        return Path(path) / gguf_file
    p = Path(path)
    return p if p.suffix.lower() == ".gguf" else None


def _require_gguf():
    try:
        import gguf
    except ImportError as e:
        raise UnsupportedCheckpoint(
            "GGUF checkpoints need the gguf package: pip install 'batchgen[gguf]'"
        ) from e
    return gguf


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")


def read_config(path: Path) -> ModelConfig:
    """The file's model configuration (transformers' reading of its metadata), computing in float32. The head
    size is the file's ``attention.key_length`` where it records one (llama.cpp's converter writes the
    checkpoint's ``head_dim`` there), and an MoE file's expert widths its ``expert_feed_forward_length`` and
    ``expert_shared_feed_forward_length``: transformers' reading of some architectures (qwen3, qwen2moe,
    qwen3moe) ignores them and keeps the config class's defaults, which are another model's whenever the
    file's sizes are not those defaults."""
    from transformers import AutoConfig

    _require_gguf()
    _check_file(path)
    arch_name, sizes = _architecture(path)
    hf = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if arch_name == "llama" and "num_local_experts" in sizes:  # Mixtral: transformers reads a dense llama
        from transformers import MixtralConfig

        hf = MixtralConfig.from_dict({**hf.to_dict(), **sizes, "model_type": "mixtral", "sliding_window": None,
                                      "architectures": ["MixtralForCausalLM"]})  # fmt: skip
    for key, value in sizes.items():
        setattr(hf, key, value)
    arch = next(iter(hf.architectures or []), None) or CAUSAL_ARCHITECTURE_OF_TYPE.get(hf.model_type)
    if arch is None:
        raise UnsupportedCheckpoint(f"GGUF architecture {arch_name!r} in {path} has no native implementation")
    config = ModelConfig.from_hf(hf, arch, None, source=str(path))
    return dataclasses.replace(config, dtype=torch.float32, weight_dtype=None)


def _architecture(path: Path) -> tuple[str, dict[str, int]]:
    """The file's architecture, once it, its expert tensors (only in :data:`MOE_ARCHITECTURES`) and every
    tensor's format are known to be runnable, and the sizes the file records that transformers' reading may
    leave at its config class's defaults: ``head_dim`` (``attention.key_length``), an MoE file's
    ``moe_intermediate_size`` and ``shared_expert_intermediate_size`` (``expert_feed_forward_length``,
    ``expert_shared_feed_forward_length``), and a Mixtral (llama) file's ``num_local_experts`` and
    ``num_experts_per_tok`` (``expert_count``, ``expert_used_count``, which transformers' reading of a llama
    file drops); absent ones are not in the dict."""
    gguf = _require_gguf()
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    split = reader.fields.get("split.count")
    if split is not None and int(split.contents()) > 1:  # llama.cpp's gguf-split parts
        part = reader.fields.get("split.no")
        raise UnsupportedCheckpoint(
            f"GGUF file {path.name} is part {int(part.contents()) + 1 if part else '?'} of {int(split.contents())} "
            "of a split model: batchgen loads a model from one GGUF file; merge the parts first with llama.cpp's "
            f"llama-gguf-split --merge {path.name} merged.gguf"
        )
    experts = next((t.name for t in reader.tensors if "_exps." in t.name), None)
    count = reader.fields.get(f"{arch}.expert_count")
    if (experts is not None and arch not in MOE_ARCHITECTURES + ("llama",)) or (
        experts is None and count is not None and int(count.contents()) > 0
    ):  # another architecture's experts, or experts one tensor each (llama.cpp's files before 2024)
        raise UnsupportedCheckpoint(
            f"GGUF file {path.name} is a mixture-of-experts model (architecture {arch!r}, "
            f"{int(count.contents()) if count else 'its'} experts) whose expert tensors batchgen does not read: it "
            "runs experts stacked as ffn_gate_exps / ffn_up_exps / ffn_down_exps in llama (Mixtral), qwen2moe and "
            "qwen3moe files; run the model's Hugging Face checkpoint (config.json and safetensors) instead"
        )
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedCheckpoint(
            f"GGUF architecture {arch!r} in {path.name} is not supported: batchgen loads GGUF files of "
            f"{', '.join(GGUF_ARCHITECTURES)}; run the model's Hugging Face checkpoint (config.json and "
            "safetensors) instead"
        )
    for t in reader.tensors:
        if int(t.tensor_type) not in FORMATS and int(t.tensor_type) not in _FLOAT_TYPES:
            raise UnsupportedCheckpoint(
                f"GGUF tensor {t.name} in {path.name} is {t.tensor_type.name}: batchgen runs "
                f"{', '.join(f.name for f in FORMATS.values())}, F32, F16 and BF16 tensors"
            )
        fmt = FORMATS.get(int(t.tensor_type))
        if fmt is not None and (int(t.shape[0]) == 0 or int(t.shape[0]) % fmt.block_values):
            raise UnsupportedCheckpoint(
                f"GGUF tensor {t.name} in {path.name} is {fmt.name} with rows of {int(t.shape[0])} values, not whole "
                f"{fmt.block_values}-value blocks: the file is malformed (llama.cpp stores such rows in a type whose "
                "blocks divide them)"
            )
    sizes = {hf: int(reader.fields[f"{arch}.{key}"].contents()) for key, hf in _MOE_SIZES.items()
             if f"{arch}.{key}" in reader.fields}  # fmt: skip
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:
        sizes["head_dim"] = int(key_length.contents())
    if arch == "llama" and experts is not None:  # Mixtral
        sizes["num_local_experts"] = int(count.contents())
        sizes["num_experts_per_tok"] = int(reader.fields[f"{arch}.expert_used_count"].contents())
    return arch, sizes


def load_gguf_tokenizer(path: Path):
    """The tokenizer stored in the file, as transformers builds it (``AutoTokenizer(..., gguf_file=)``)."""
    from transformers import AutoTokenizer

    _check_file(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def check_dtype(dtype: torch.dtype | str) -> None:
    """UnsupportedCheckpoint unless `dtype` (``model.dtype``) is auto or float32: a GGUF model computes in
    float32."""
    if not (isinstance(dtype, str) and dtype.lower() in ("auto", "float32")) and dtype != torch.float32:
        raise UnsupportedCheckpoint(f"a GGUF checkpoint computes in float32: use dtype auto, not {dtype}")


@torch.no_grad()
def load_gguf_model(
    path: Path,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
):
    """The native model of a GGUF file, projections packed in their block formats (module docstring); with
    `tp_size > 1`, rank `tp_rank`'s shard (:func:`batchgen.models.sharding.read_shard`'s rules on the file's
    tensors in Hugging Face's layout: block rows for column-parallel projections, whole blocks of each row for
    row-parallel ones)."""
    from batchgen.models.llama import CausalLM
    from batchgen.models.loader import _checkpoint_names, materialize_rest, meta_model
    from batchgen.models.packed_linear import fast_cpu_weights
    from batchgen.models.parallel import shard_config

    gguf = _require_gguf()
    device = torch.device(device)
    check_dtype(dtype)
    config = shard_config(read_config(path), tp_rank, tp_size)
    reader = gguf.GGUFReader(str(path))
    arch_name = reader.fields["general.architecture"].contents()
    tensors = {t.name: t for t in reader.tensors}
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    name_map = gguf.get_tensor_name_map(arch_id, config.num_layers)
    heads = (config.num_heads, config.num_kv_heads)

    def gguf_name(hf_name: str) -> str:
        base, _, suffix = hf_name.rpartition(".")
        mapped = name_map.get_name(base)
        if hf_name == "lm_head.weight" and "output.weight" not in tensors:
            return "token_embd.weight"  # llama.cpp drops a tied head
        if mapped is None:
            raise UnsupportedCheckpoint(f"no GGUF tensor name for {hf_name} ({arch_name})")
        return f"{mapped}.{suffix}"

    def rows(name: str, data: np.ndarray) -> np.ndarray:
        """transformers' transforms: a Gemma file's norm weights stored as ``1 + w`` back to ``w``; llama.cpp's
        q/k row order back to Hugging Face's (rows only, so it applies to packed rows as they are)."""
        if arch_name in GEMMA_NORM_ARCHS and name.endswith("norm.weight"):
            return data - 1.0
        if arch_name != "llama" or not (".attn_q." in name or ".attn_k." in name):
            return data
        n_head = heads[0] if ".attn_q." in name else heads[1]
        dim = data.shape[0] // n_head // 2
        return data.reshape(n_head, dim, 2, *data.shape[1:]).swapaxes(2, 1).reshape(data.shape)

    model: CausalLM = meta_model(config)  # packed projections swapped in first, then the rest given storage
    used: set[str] = set()
    if arch_name in MOE_ARCHITECTURES and tp_size > 1:
        raise UnsupportedCheckpoint(
            f"engine.tensor_parallel_size={tp_size}: GGUF mixture-of-experts file {path.name} runs on one rank; "
            "set engine.tensor_parallel_size=1"
        )
    for name, experts in list(model.named_modules()):
        if type(experts) is Experts:
            used.update(_pack_experts(model, name, experts, tensors, config, device))
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    for name, linear in linears.items():
        parts = _checkpoint_names(config, f"{name}.weight", tuple(linear.weight.shape))[0]
        names = [gguf_name(hf) for hf, _ in parts]
        if not all(int(tensors[n].tensor_type) in FORMATS for n in names if n in tensors):
            continue  # float tensors: read below like any parameter, packed by fast_cpu_weights
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"GGUF file {path.name} is missing tensor(s) {', '.join(missing)}")
        packed = [
            (
                torch.from_numpy(
                    np.array(rows(n, _rank_part(np.asarray(tensors[n].data), hf, config, tensors[n])))
                ),
                int(tensors[n].tensor_type),
            )
            for n, (hf, _) in zip(names, parts)
        ]
        bias = None
        if linear.bias is not None:
            biases = [hf.removesuffix(".weight") + ".bias" for hf, _ in parts]
            bias = torch.cat([_dense(tensors, rows, gguf_name(b), b, config) for b in biases])
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, quant_linear(linear.in_features, packed, bias, device))
        used.update(names)  # a tied head quantized on its own: the table stays the embedding's
    materialize_rest(
        model, config, device
    )  # float32, uninitialised (on the CPU untouched pages cost nothing)
    quantized = tuple(
        f"{q}." for q, m in model.named_modules() if isinstance(m, QuantLinear | GroupQuantLinear)
    )
    for pname, param in model.named_parameters():
        if pname.startswith(quantized):
            continue
        if pname.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # float experts: stacked tensors
            names = _expert_names(pname, "gate", "up") if "gate_up" in pname else _expert_names(pname, "down")
            param.copy_(torch.cat([_dense(tensors, rows, n, n, config) for n in names], dim=1))
            used.update(names)
            continue
        for hf, src in _checkpoint_names(config, pname, tuple(param.shape))[0]:
            n = gguf_name(hf)
            if n not in tensors:
                raise ValueError(f"GGUF file {path.name} is missing tensor {n} (for {hf})")
            value = _dense(tensors, rows, n, hf, config)
            dest = param if src.rows < 0 else param.narrow(0, src.offset, src.rows)
            if tuple(value.shape) != tuple(dest.shape):
                raise ValueError(
                    f"GGUF tensor {n} has shape {tuple(value.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(value)
            used.add(n)
    unused = sorted(set(tensors) - used)
    if unused:
        logger.info("GGUF tensors not used by %s: %s", config.architecture, ", ".join(unused))
    fast_cpu_weights(model, keep=[model.model.embed_tokens.weight])
    return model


def _expert_names(module: str, *parts: str) -> list[str]:
    """The GGUF expert tensors (``blk.N.ffn_<part>_exps.weight``) of the layer `module` (a Hugging Face name
    ``model.layers.N. ...``) belongs to."""
    block = module.split(".")[2]
    return [f"blk.{block}.ffn_{p}_exps.weight" for p in parts]


def _pack_experts(model: nn.Module, name: str, experts: Experts, tensors: dict, config, device) -> list[str]:
    """Replace the stacked `experts` at `name` by :class:`~batchgen.models.moe.PackedExperts` over the file's
    expert blocks (per expert: gate and up rows in one projection, each part its format; down) when all three
    expert tensors are in block formats; a float file's experts stay stacked (read with the parameters). The
    GGUF tensor names used."""
    names = _expert_names(name, "gate", "up", "down")
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"GGUF file is missing expert tensor(s) {', '.join(missing)}")
    types = [int(tensors[n].tensor_type) for n in names]
    if not all(t in FORMATS for t in types):
        return []
    gate, up, down = (np.asarray(tensors[n].data) for n in names)  # [experts, rows, row bytes]
    if gate.shape[0] != experts.num_experts:
        raise ValueError(
            f"GGUF tensor {names[0]} holds {gate.shape[0]} experts, expected {experts.num_experts}"
        )

    def part(data: np.ndarray, e: int, type_id: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.array(data[e])), type_id

    hidden, inter = config.hidden_size, experts.intermediate_size
    gate_up = [quant_linear(hidden, [part(gate, e, types[0]), part(up, e, types[1])], None, device)
               for e in range(experts.num_experts)]  # fmt: skip
    downs = [quant_linear(inter, [part(down, e, types[2])], None, device) for e in range(experts.num_experts)]
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, PackedExperts(gate_up, downs, inter, config.hidden_act))
    return names


def quant_linear(
    in_features: int, parts: list[tuple[torch.Tensor, int]], bias: torch.Tensor | None, device: torch.device
) -> nn.Module:
    """The projection over one fused set of GGUF tensors (``(rows, type id)`` parts) on `device`: the block bytes
    as they are for the CPU's C kernel; elsewhere repacked as grouped integers for the Triton kernel
    (:mod:`.gguf_repack`)."""
    if device.type == "cpu":
        return QuantLinear(in_features, parts, bias)
    from batchgen.models.quant.gguf_repack import repack

    layer = GroupQuantLinear(in_features, [repack(p, t, in_features) for p, t in parts], bias)
    return layer.to(device)


def _dense(tensors: dict, rows, name: str, hf: str, config: ModelConfig) -> torch.Tensor:
    """GGUF tensor `name` (Hugging Face's `hf`) widened to float32 (dequantized if quantized), in Hugging Face's
    layout: this rank's part of it, cut from the stored rows before they are widened (a quantized token
    embedding is dequantized only for the rank's vocabulary)."""
    from gguf.quants import dequantize

    t = tensors[name]
    part = _rank_part(np.asarray(t.data), hf, config, t)
    data = np.asarray(dequantize(part, t.tensor_type), dtype=np.float32)
    if hf.endswith("shared_expert_gate.weight"):  # [1, hidden], stored as [hidden]
        data = data.reshape(1, -1)
    return torch.from_numpy(np.array(rows(name, data)))


class _ArraySlice:
    """A numpy array seen as an open safetensors file holding one tensor (``get_slice``, ``get_shape``,
    indexing): what :func:`batchgen.models.sharding.read_shard` reads a rank's part from."""

    def __init__(self, name: str, data: np.ndarray) -> None:
        self.name, self.data = name, data

    def get_slice(self, name: str) -> _ArraySlice:
        if name != self.name:
            raise KeyError(name)
        return self

    def get_shape(self) -> list[int]:
        return list(self.data.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.data[index]))


def _rank_part(data: np.ndarray, hf: str, config: ModelConfig, tensor=None) -> np.ndarray:
    """Rank ``config.tp_rank``'s part of a GGUF tensor in Hugging Face's layout (all of it on one rank). For a
    block-quantized `tensor` the columns are bytes: a row-parallel projection's rows must split into whole
    blocks."""
    if config.tp_size == 1:
        return data
    from batchgen.models.sharding import read_shard, splits_inputs

    if tensor is not None and splits_inputs(hf) and int(tensor.tensor_type) in FORMATS:
        blocks = data.shape[1] // FORMATS[int(tensor.tensor_type)].block_bytes
        if blocks % config.tp_size:
            raise UnsupportedCheckpoint(
                f"GGUF tensor {tensor.name} holds {blocks} blocks per row, which do not split over "
                f"{config.tp_size} ranks; set engine.tensor_parallel_size to a divisor"
            )
    return read_shard(_ArraySlice(hf, data), hf, hf, config).numpy()
