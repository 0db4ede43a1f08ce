"""The generic path: any decoder-only architecture transformers can load, run on batchgen's engine.

transformers' own modeling code computes everything but attention. Attention goes through transformers'
`AttentionInterface` under the name ``batchgen_paged``: each layer's call stores the new K/V in our paged
cache and attends through the block tables with our kernels (`PagedAttention`), exactly like a native model.
Batches are packed the same way (one row of all the step's tokens, explicit `position_ids`, no padding); since
``batchgen_paged`` has no entry in transformers' `AttentionMaskInterface`, transformers builds no mask
(`masking_utils` returns None early) and the kernels' block tables and causal rule do the masking. Scheduler,
prefix cache, chunked prefill, preemption, sampler and the job are the engine's, unchanged.

Each layer's attention options reach the kernels: its `scaling`, `softcap`, attention sinks (`s_aux`, gpt-oss)
and `sliding_window` — read from the mask transformers builds for the layer at load time (see below), else the
keyword transformers passes, else the layer's `layer_types` entry. ALiBi or other biases in the mask,
non-causal layers and non-attention layers (Mamba / linear-attention hybrids) cannot be honoured by the kernels:
such models are refused.

Checks, all before the engine does any work: ``config.json`` is read with transformers' built-in config class
(remote code is never run: `trust_remote_code=False`, `local_files_only=True`); encoder-decoder models,
architectures without a causal-LM class and hybrid layer types are refused from the config alone. After the
weights are loaded (safetensors only), a probe forward of a few tokens records every attention call (layer
order, K/V heads, head size, options) with a plain reference attention, and checks that the split this module
uses — backbone to hidden states, then the causal-LM head — gives the same logits as the model's own forward.

`model.forward(input_ids, positions, ctx) -> hidden` runs the backbone (`hf_model.<base_model_prefix>`);
`model.compute_logits(hidden)` runs the model's own causal-LM forward with the backbone replaced by a stub
that returns `hidden`, so every head-side option (Gemma's final soft-capping, Granite's `logits_scaling`,
Cohere's `logit_scale`...) applies as transformers applies it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchgen.attention import AttentionOptions
from batchgen.models.config import (
    ContextFacts,
    eos_token_ids,
    hf_config_from_dict,
    parse_dtype,
    read_config_files,
    unrunnable_image_text,
)
from batchgen.models.packed_linear import pack_transformers_linears

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "batchgen_paged"
PROBE_IMPLEMENTATION = "batchgen_probe"
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_PROBE_TOKENS = 6


class UnsupportedModelError(ValueError):
    """The checkpoint cannot run on batchgen's engine (the message says why)."""


class WrongTaskError(UnsupportedModelError):
    """The checkpoint is not a language model but runs as another task (a sequence classifier: ``task=classify``;
    an encoder or a base model without a head: ``task=embed``); the message says which, in one line."""


def task_of_architecture(archs: list[str]) -> str | None:
    """``classify`` for a sequence classifier or reward model, ``embed`` for a base model without a head
    (``BertModel``, ``Qwen3Model``), None for anything else (a language model, or unknown)."""
    arch = archs[0] if archs else ""
    if arch.endswith(("ForSequenceClassification", "ForRewardModel")):
        return "classify"
    if arch.endswith("Model") and not arch.endswith(
        ("LMHeadModel", "ForCausalLM", "ForConditionalGeneration")
    ):
        return "embed"
    return None


def wrong_task_error(archs: list[str], source: str) -> WrongTaskError | None:
    """The one-line refusal of a generation job over a checkpoint that :func:`task_of_architecture` places
    under another task; None when it does not."""
    task = task_of_architecture(archs)
    if task == "classify":
        return WrongTaskError(f"this is a sequence classifier ({archs[0]}, {source}): use task=classify")
    if task == "embed":
        return WrongTaskError(
            f"this is an encoder or embedding model ({archs[0]}, no language-model head; {source}): use task=embed"
        )
    return None


# ------------------------------------------------------------------------------------------ attention hook
ATTENTION_STATE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "batchgen_attention_state", default=None
)


def batchgen_paged_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: `query [1, Hq, T, D]`, `key/value [1, Hkv, T, D]` ->
    (`[1, T, Hq, D]`, None). Dispatches to the forward in progress (a paged forward or the load-time probe)."""
    state = ATTENTION_STATE.get()
    if state is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} called outside a batchgen forward: this model "
            "only runs inside batchgen's engine"
        )
    return state(module, query, key, value, attention_mask, scaling, kwargs)


def register_attention() -> None:
    """Register ``batchgen_paged`` in transformers' `AttentionInterface`, and ``batchgen_probe`` (the load-time
    probe: the same dispatcher, plus a mask function so transformers tells us each layer's mask) in both the
    attention and the mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, batchgen_paged_attention)
    AttentionInterface.register(PROBE_IMPLEMENTATION, batchgen_paged_attention)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, _probe_mask)


@dataclass(frozen=True)
class _MaskInfo:
    """What a mask transformers built means: causal with an optional window, or something the kernels lack."""

    kind: str  # "causal", "noncausal" or "other" (chunked, block-wise...)
    window: int | None = None


PROBE_MASKS: dict[int, _MaskInfo] = {}  # storage address of a probe mask -> its meaning (probe only)
_FAR = 1 << 20  # query index at which mask functions are classified


def _classify_mask_function(mask_function) -> _MaskInfo:
    """Evaluate transformers' mask function for one far query against every key: causal (all keys up to the
    query, or a suffix of `w` of them: a sliding window) or not."""
    zero = torch.tensor(0)
    kv = torch.arange(_FAR + 2)
    try:
        allowed = torch.as_tensor(mask_function(zero, zero, torch.tensor(_FAR), kv)).bool().expand(_FAR + 2)
    except Exception:  # an index-based mask function (padding, blocks) we cannot evaluate out of range
        return _MaskInfo("other")
    if bool(allowed[_FAR + 1]):
        return _MaskInfo("noncausal")
    n = int(allowed[: _FAR + 1].sum())
    if n == _FAR + 1:
        return _MaskInfo("causal")
    if n > 0 and bool(allowed[_FAR + 1 - n : _FAR + 1].all()):
        return _MaskInfo("causal", n)
    return _MaskInfo("other")


def _probe_mask(**kwargs: Any) -> Tensor:
    """Mask function of ``batchgen_probe``: the real boolean mask (so the probe computes what eager attention
    computes), remembered with its meaning."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(**{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})
    PROBE_MASKS[mask.untyped_storage().data_ptr()] = _classify_mask_function(kwargs["mask_function"])
    return mask


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer as the kernels see it: its KV-cache index and attention options."""

    index: int
    options: AttentionOptions
    sinks: bool = (
        False  # the layer passes attention sinks (`s_aux`, one logit per head), forwarded as `sinks`
    )


class PagedState:
    """A paged forward: each call stores K/V in its layer's cache and attends with the engine's kernels."""

    def __init__(self, ctx: Any, layers: dict[int, LayerAttention]) -> None:
        self.ctx = ctx
        self.layers = layers

    def __call__(self, module, query, key, value, attention_mask, scaling, kwargs):
        layer = self.layers.get(id(module))
        if layer is None:
            raise RuntimeError(
                f"attention module {type(module).__name__} was not seen by the load-time probe"
            )
        ctx = self.ctx
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        kv = ctx.kv_cache[layer.index]
        options = layer.options
        if layer.sinks:
            options = dataclasses.replace(options, sinks=kwargs["s_aux"])
        out = ctx.attn.forward(q, k, v, kv[0], kv[1], ctx.meta, options)
        return out[None], None


@dataclass
class _Call:
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: Tensor | None
    mask: _MaskInfo | None  # None: no mask (plain causal); kind "foreign": a mask transformers did not build
    extra: dict[str, Any]


class ProbeState:
    """The load-time probe: records every attention call and computes plain causal attention (one sequence)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def __call__(self, module, query, key, value, attention_mask, scaling, kwargs):
        d = query.shape[-1]
        scale = float(scaling) if scaling is not None else d**-0.5
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        sinks = kwargs.get("s_aux")
        extra = {
            k: v for k, v in kwargs.items() if k in ("position_bias", "alibi", "is_causal") and v is not None
        }
        if getattr(module, "is_causal", True) is False:
            extra["is_causal"] = False
        mask_info = None
        if attention_mask is not None:
            ptr = attention_mask.untyped_storage().data_ptr() if isinstance(attention_mask, Tensor) else None
            mask_info = PROBE_MASKS.get(ptr, _MaskInfo("foreign"))  # type: ignore[arg-type]
        self.calls.append(
            _Call(
                module,
                query.shape[1],
                key.shape[1],
                key.shape[-1],
                value.shape[-1],
                scale,
                None if window is None else int(window),
                None if softcap is None else float(softcap),
                sinks,
                mask_info,
                extra,
            )
        )
        mask = attention_mask if isinstance(attention_mask, Tensor) else None
        return _reference_attention(query, key, value, scale, window, softcap, mask, sinks), None


def _reference_attention(q, k, v, scale, window, softcap, mask=None, sinks=None) -> Tensor:
    """Attention of one sequence: q [1,Hq,T,D], k/v [1,Hkv,T,D] -> [1,T,Hq,Dv] (contiguous), under `mask`
    (boolean or additive, transformers' layout) or else the causal rule and `window`."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t, s = q.shape[2], k.shape[2]
    if mask is not None:
        mask = mask[..., :t, :s]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    else:
        qi = torch.arange(t, device=q.device)[:, None]
        ki = torch.arange(s, device=q.device)[None, :]
        allowed = ki <= qi
        if window is not None:
            allowed &= ki > qi - int(window)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # one more logit per head in the denominator, with no value
        sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs.to(v.dtype) @ v
    return out.transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class TransformersModelConfig(ContextFacts):
    """What the engine reads from a model, for a model run by the transformers backend."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...]
    layer_softcaps: tuple[float | None, ...]
    layer_scales: tuple[float, ...]
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    implementation = "transformers"


class HiddenStates(nn.Module):
    """Stands in for the backbone inside the causal-LM forward: returns the hidden states it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any):
        return _stub_output_class()(last_hidden_state=self.hidden)

    def __getattr__(self, name: str):
        # heads that call a sub-module of the backbone (OPT: `self.model.decoder(...)`) reach the stub too
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return self


_STUB_OUTPUT: type | None = None


def _stub_output_class() -> type:
    """`BaseModelOutputWithPast` whose other fields (router_logits, cross_attentions...) read as None."""
    global _STUB_OUTPUT
    if _STUB_OUTPUT is None:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        class _StubOutput(BaseModelOutputWithPast):
            def __getattr__(self, name: str):
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        _STUB_OUTPUT = _StubOutput
    return _STUB_OUTPUT


class TransformersCausalLM(nn.Module):
    """A transformers causal LM behind the engine's model interface (`forward` -> hidden, `compute_logits`)."""

    def __init__(
        self, hf_model: nn.Module, config: TransformersModelConfig, layers: dict[int, LayerAttention]
    ):
        super().__init__()
        self.config = config
        self.hf_model = hf_model
        prefix = hf_model.base_model_prefix
        self.backbone = getattr(hf_model, prefix)
        self._stub = HiddenStates()
        setattr(hf_model, prefix, self._stub)
        self._layers = layers
        self._backbone_kwargs = no_cache_kwargs(self.backbone)
        self._head_kwargs = no_cache_kwargs(hf_model)

    def _backbone(self, input_ids: Tensor, positions: Tensor, state: Any) -> Tensor:
        return _run_backbone(self.backbone, input_ids, positions, state, self._backbone_kwargs)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: Any) -> Tensor:
        """input_ids, positions [T] int64 (packed batch) -> hidden states [T, hidden_size]."""
        return self._backbone(input_ids, positions, PagedState(ctx, self._layers))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size], through the model's own head."""
        self._stub.hidden = hidden[None]
        try:
            dummy = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            out = self.hf_model(input_ids=dummy, **self._head_kwargs)
        finally:
            self._stub.hidden = None
        return out.logits[0].float()


def _run_backbone(
    backbone: nn.Module, input_ids: Tensor, positions: Tensor, state: Any, kwargs: dict[str, Any]
) -> Tensor:
    """One packed forward of a transformers base model with attention dispatched to ``state``: hidden [T, H]."""
    token = ATTENTION_STATE.set(state)
    try:
        out = backbone(input_ids=input_ids[None], position_ids=positions[None], **kwargs)
    finally:
        ATTENTION_STATE.reset(token)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]


class TransformersBackbone(nn.Module):
    """A transformers base model (``GPTNeoXModel``, ``Olmo2Model``...: no head) behind the engine's
    ``forward``: hidden states after the final norm, attention through the paged cache. Pooling models wrap
    it (:mod:`batchgen.pooling.decoder`); it has no language-model head."""

    def __init__(
        self, backbone: nn.Module, config: TransformersModelConfig, layers: dict[int, LayerAttention]
    ):
        super().__init__()
        self.config = config
        self.backbone = backbone
        self._layers = layers
        self._kwargs = no_cache_kwargs(backbone)

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: Any) -> Tensor:
        """input_ids, positions [T] int64 (packed batch) -> hidden states [T, hidden_size]."""
        return _run_backbone(self.backbone, input_ids, positions, PagedState(ctx, self._layers), self._kwargs)


def no_cache_kwargs(module: nn.Module) -> dict[str, Any]:
    """`use_cache=False` when the module's forward takes it (transformers' own KV cache is never used)."""
    params = inspect.signature(module.forward).parameters
    takes = "use_cache" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {"use_cache": False} if takes else {}


# -------------------------------------------------------------------------------------------------- loading
def inspect_checkpoint(path: str | os.PathLike, causal_head: bool = True) -> Any:
    """transformers' config for `path` after every check that needs no weights; raises UnsupportedModelError.
    ``causal_head`` False: the checkpoint may hold a decoder family's base model or another head (pooling)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    source = str(path / "config.json")
    config, _ = read_config_files(path)
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if causal_head and (wrong := wrong_task_error(archs, source)) is not None:
        raise wrong
    try:
        hf = hf_config_from_dict(config, source)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from e
    if getattr(hf, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{', '.join(archs) or model_type} ({source}) is an encoder-decoder model; batchgen runs decoder-only "
            "causal language models"
        )
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if causal_head and not any(a in causal_classes for a in archs):
        image_text = unrunnable_image_text(archs, source, config)
        if image_text is not None:
            raise UnsupportedModelError(image_text)
    if causal is None:
        raise UnsupportedModelError(
            f"transformers has no causal-LM class for model_type {model_type!r} ({source}): not a decoder-only "
            "language model with an LM head"
        )
    if causal_head and archs and not any(a in causal_classes for a in archs):
        raise UnsupportedModelError(
            f"the checkpoint's architecture {', '.join(archs)} ({source}) is not a causal language model "
            f"(transformers' causal LM for {model_type!r} is {causal})"
        )
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    if getattr(text, "is_causal", True) is False or getattr(text, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{model_type} ({source}) uses bidirectional attention: not a causal LM")
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedModelError(
            f"{model_type} ({source}) has layers of type {', '.join(other)}: batchgen's KV cache holds attention "
            "layers only (full or sliding-window), not recurrent/linear-attention/chunked layers"
        )
    return hf


def transformers_logging():
    import transformers

    return transformers.utils.logging


def max_context_len(text: Any, source: str) -> int:
    for key in _MAX_LEN_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    logger.warning("%s names no maximum context length: assuming 2048 tokens", source)
    return 2048


@torch.inference_mode()
def load_transformers_model(
    ckpt: str | os.PathLike, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"
) -> TransformersCausalLM:
    """Load `ckpt` with transformers' modeling code over batchgen's paged attention (see the module doc)."""
    hf_model, text, source, torch_dtype = _load(Path(ckpt), dtype, device)
    config, layers = probe_attention(hf_model, text, source, torch_dtype)
    _, generation = read_config_files(Path(ckpt))
    config = dataclasses.replace(config, eos_token_ids=eos_token_ids(text, generation))
    model = TransformersCausalLM(hf_model, config, layers)
    _check_head_split(model, hf_model, source)
    return model


@torch.inference_mode()
def load_transformers_backbone(
    ckpt: str | os.PathLike,
    auto_class: Any,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
) -> tuple[TransformersBackbone, nn.Module]:
    """A decoder family's base model for pooling: ``auto_class`` (``AutoModel`` for an embedder,
    ``AutoModelForSequenceClassification`` for a classifier) loaded over batchgen's paged attention, with the
    same checks and probe as :func:`load_transformers_model` (no causal-LM head needed; a causal LM's
    ``lm_head`` is left unused). Returns the backbone and the whole transformers model (its head)."""
    hf_model, text, source, torch_dtype = _load(Path(ckpt), dtype, device, auto_class, ("lm_head.",))
    base = getattr(hf_model, hf_model.base_model_prefix, hf_model)
    config, layers = probe_attention(base, text, source, torch_dtype)
    _, generation = read_config_files(Path(ckpt))
    config = dataclasses.replace(config, eos_token_ids=eos_token_ids(text, generation))
    return TransformersBackbone(base, config, layers), hf_model


def _load(
    ckpt: Path, dtype: torch.dtype | str, device: str | torch.device, auto_class: Any = None, unused_ok=()
) -> tuple[nn.Module, Any, str, torch.dtype]:
    """The checked, loaded transformers model in eval mode with its cache off: (model, text config, source,
    dtype). ``auto_class`` None: a causal LM."""
    source = str(ckpt / "config.json")
    hf_config = inspect_checkpoint(ckpt, causal_head=auto_class is None)
    from batchgen.models.loader import safetensors_files

    safetensors_files(ckpt)  # refuses pickle-only checkpoints with the usual message
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if isinstance(dtype, str) and dtype.lower() == "auto":
        torch_dtype = parse_dtype(
            getattr(text, "dtype", None) or getattr(hf_config, "dtype", None) or "float32"
        )
    else:
        torch_dtype = parse_dtype(dtype)
    hf_model = _from_pretrained(ckpt, hf_config, torch_dtype, auto_class, unused_ok)
    hf_model = hf_model.to(torch.device(device)).eval().requires_grad_(False)
    pack_transformers_linears(hf_model)
    model_text = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else None
    for cfg in (hf_model.config, model_text):
        if cfg is not None:
            cfg.use_cache = False  # KV lives in batchgen's paged cache; transformers' cache is never built
    return hf_model, text, source, torch_dtype


def _from_pretrained(
    ckpt: Path,
    hf_config: Any,
    torch_dtype: torch.dtype,
    auto_class: Any = None,
    unused_ok: tuple[str, ...] = (),
) -> nn.Module:
    """``auto_class.from_pretrained`` (default ``AutoModelForCausalLM``) with batchgen's attention, progress
    bars off; refuses a checkpoint whose tensors are missing or misshapen (unused ones are logged, except
    names starting with ``unused_ok``)."""
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM
    register_attention()
    hf_logging = transformers_logging()
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        hf_model, info = auto_class.from_pretrained(
            str(ckpt),
            dtype=torch_dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            output_loading_info=True,
        )
    except KeyError as e:  # modeling code that picks attention classes by name (eager/sdpa/flash only)
        raise UnsupportedModelError(
            f"{ckpt}: transformers' {hf_config.model_type} modeling code does not take custom attention "
            f"implementations (it selects its own attention classes, {e} is not one), so batchgen's paged "
            "attention cannot be plugged in"
        ) from e
    except (ValueError, NotImplementedError) as e:
        raise UnsupportedModelError(f"transformers cannot load {ckpt} with batchgen's attention: {e}") from e
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(m) for m in info.get("mismatched_keys") or [])
    if missing or mismatched:
        shown = ", ".join((missing + mismatched)[:10])
        raise ValueError(
            f"checkpoint {ckpt} does not match {type(hf_model).__name__}: missing or misshapen tensor(s) {shown}"
        )
    unused = sorted(k for k in info.get("unexpected_keys") or [] if not k.startswith(unused_ok or ("\0",)))
    if unused:
        logger.warning("checkpoint %s has unused tensor(s): %s", ckpt, ", ".join(unused[:10]))
    return hf_model


def _probe_inputs(vocab: int, device: torch.device) -> tuple[Tensor, Tensor]:
    ids = (torch.arange(_PROBE_TOKENS, device=device) * 7 + 3) % max(vocab, 1)
    return ids, torch.arange(_PROBE_TOKENS, device=device)


def probe_attention(
    hf_model: nn.Module, text: Any, source: str, dtype: torch.dtype
) -> tuple[TransformersModelConfig, dict[int, LayerAttention]]:
    """Run a few tokens through the model with a recording reference attention; derive the KV layout and each
    layer's options; refuse what the kernels cannot honour."""
    name = type(hf_model).__name__
    calls = _record_attention_calls(hf_model, text, name, source)
    _check_calls(calls, text, name, source)
    max_len = max_context_len(text, source)
    windows, layers = _layer_options(calls, text, max_len)
    first = calls[0]
    config = TransformersModelConfig(
        architecture=type(hf_model).__name__,
        model_type=str(getattr(text, "model_type", "")),
        vocab_size=int(text.vocab_size),
        hidden_size=int(getattr(text, "hidden_size", 0) or 0),
        num_layers=len(calls),
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        max_position_embeddings=max_len,
        layer_windows=tuple(windows),
        layer_softcaps=tuple(c.softcap for c in calls),
        layer_scales=tuple(c.scale for c in calls),
        dtype=dtype,
        bos_token_id=getattr(text, "bos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )
    return config, layers


def _record_attention_calls(hf_model: nn.Module, text: Any, name: str, source: str) -> list[_Call]:
    """The attention calls of one probe forward, in order (at least one; the model's attention implementation
    is ``ATTN_IMPLEMENTATION`` again afterwards)."""
    device = next(hf_model.parameters()).device
    probe = ProbeState()
    ids, pos = _probe_inputs(int(text.vocab_size), device)
    token = ATTENTION_STATE.set(probe)
    hf_model.config._attn_implementation = PROBE_IMPLEMENTATION
    try:
        hf_model(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    except Exception as e:
        raise UnsupportedModelError(
            f"{name} ({source}) cannot run a packed forward with batchgen's attention: {type(e).__name__}: {e}"
        ) from e
    finally:
        ATTENTION_STATE.reset(token)
        hf_model.config._attn_implementation = ATTN_IMPLEMENTATION
        PROBE_MASKS.clear()
    if not probe.calls:
        raise UnsupportedModelError(
            f"{name} ({source}) does not call transformers' attention interface, so batchgen's paged attention "
            "cannot be plugged in"
        )
    return probe.calls


def _check_calls(calls: list[_Call], text: Any, name: str, source: str) -> None:
    """Refuse unless every layer calls attention once, all with one KV shape, and each with what the kernels
    can apply (causal rule, window, soft-cap, one sink per query head)."""
    if len({id(c.module) for c in calls}) != len(calls):
        raise UnsupportedModelError(f"{name} ({source}) calls one attention module several times per forward")
    n_layers = getattr(text, "num_hidden_layers", None)
    if isinstance(n_layers, int) and n_layers != len(calls):
        raise UnsupportedModelError(
            f"{name} ({source}) has {n_layers} layers but {len(calls)} attention calls per forward (layers "
            "without attention, whose recurrent or convolution state batchgen's KV cache cannot hold, or "
            "cross-attention): not a plain decoder-only model"
        )
    shapes = {(c.num_kv_heads, c.head_dim) for c in calls}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"{name} ({source}) has attention layers of different KV shapes {sorted(shapes)}: one paged KV cache "
            "needs the same (kv heads, head size) in every layer"
        )
    for i, c in enumerate(calls):
        _check_call(i, c, name, source)


def _check_call(i: int, c: _Call, name: str, source: str) -> None:
    if c.value_dim != c.head_dim:
        raise UnsupportedModelError(
            f"{name} ({source}): keys and values have different head sizes ({c.head_dim} vs {c.value_dim})"
        )
    if c.num_heads % c.num_kv_heads:
        raise UnsupportedModelError(
            f"{name} ({source}): {c.num_heads} query heads for {c.num_kv_heads} KV heads"
        )
    if c.mask is not None and c.mask.kind == "foreign":
        raise UnsupportedModelError(
            f"{name} ({source}) builds its own attention mask or bias (layer {i}), e.g. ALiBi: the paged "
            "kernels apply only the causal rule, sliding windows and soft-capping"
        )
    if c.mask is not None and c.mask.kind != "causal":
        raise UnsupportedModelError(
            f"{name} ({source}) layer {i} uses a {c.mask.kind} attention mask (not causal with an optional "
            "sliding window), which the paged kernels cannot apply"
        )
    if c.sinks is not None and tuple(c.sinks.shape) != (c.num_heads,):
        raise UnsupportedModelError(
            f"{name} ({source}) layer {i}: attention sinks of shape {tuple(c.sinks.shape)}, expected one per "
            f"query head ({c.num_heads})"
        )
    if c.extra:
        raise UnsupportedModelError(
            f"{name} ({source}) passes attention options the kernels cannot honour: {sorted(c.extra)}"
        )


def _layer_options(
    calls: list[_Call], text: Any, max_len: int
) -> tuple[list[int | None], dict[int, LayerAttention]]:
    """Each layer's window (None: full attention; a window of ``max_len`` or more is none) and its
    :class:`LayerAttention`, keyed by the attention module's ``id``."""
    layer_types = list(getattr(text, "layer_types", None) or [])
    config_window = getattr(text, "sliding_window", None)
    windows: list[int | None] = []
    layers: dict[int, LayerAttention] = {}
    for i, c in enumerate(calls):
        layer_idx = getattr(c.module, "layer_idx", None)
        layer_idx = layer_idx if isinstance(layer_idx, int) and 0 <= layer_idx < len(calls) else i
        if c.mask is not None:  # the mask transformers built for this layer is what eager attention applies
            window = c.mask.window
        else:
            window = c.sliding_window
            if (
                window is None
                and layer_types
                and layer_types[layer_idx] == "sliding_attention"
                and config_window
            ):
                window = int(config_window)
        if window is not None and (window <= 0 or window >= max_len):
            window = None
        windows.append(window)
        options = AttentionOptions(c.scale, sliding_window=window, softcap=c.softcap)
        layers[id(c.module)] = LayerAttention(i, options, sinks=c.sinks is not None)
    return windows, layers


def _check_head_split(model: TransformersCausalLM, hf_model: nn.Module, source: str) -> None:
    """The backbone -> head split must reproduce the model's own forward (same reference attention)."""
    device = next(model.parameters()).device
    ids, pos = _probe_inputs(model.config.vocab_size, device)
    # the model's own forward needs its real backbone: put it back for this one call
    prefix = hf_model.base_model_prefix
    setattr(hf_model, prefix, model.backbone)
    token = ATTENTION_STATE.set(ProbeState())
    hf_model.config._attn_implementation = PROBE_IMPLEMENTATION
    try:
        ref = hf_model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0].float()
        setattr(hf_model, prefix, model._stub)
        hidden = model._backbone(ids, pos, ProbeState())
        logits = model.compute_logits(hidden)
    except Exception as e:
        raise UnsupportedModelError(
            f"{type(hf_model).__name__} ({source}): cannot split the backbone from the causal-LM head: {e}"
        ) from e
    finally:
        ATTENTION_STATE.reset(token)
        hf_model.config._attn_implementation = ATTN_IMPLEMENTATION
        setattr(hf_model, prefix, model._stub)
        PROBE_MASKS.clear()
    if logits.shape != ref.shape or not torch.allclose(logits, ref, atol=1e-3, rtol=1e-3):
        raise UnsupportedModelError(
            f"{type(hf_model).__name__} ({source}): its causal-LM head does more than map the backbone's hidden "
            "states to logits, so batchgen cannot split it"
        )
