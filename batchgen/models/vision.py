"""Image-text models over the paged KV cache: the language model is a native decoder; the vision encoder
(tower + projector) runs outside the cache, in batches of images, and its outputs replace the input embeddings
at the image's placeholder positions.

**Image token ids.** The engine gives each image's placeholder positions *image token ids* instead of the
checkpoint's placeholder token: ``IMAGE_ID_BASE + (key << OFFSET_BITS) + offset``, where ``key`` is the small
integer :class:`ImageInputs` assigned to the image's content hash and ``offset`` the token's index inside the
image's features. The forward needs nothing else to place features (the step input stays plain token ids), and
the prefix cache, which hashes token ids, keys a placeholder block by the image: two rows with the same image
and the same tokens before it share blocks; different images never do (distinct hashes get distinct keys, a
collision of the short key is probed away).

**Invariants.** An image's pixels stay in :class:`ImageInputs` while a request that shows it is in the engine
(``acquire`` / ``release``), so its features can always be (re)computed; computed features live in the
:class:`EncoderCache` (LRU, bounded in bytes) and each distinct image is encoded once as long as it fits there.
An image the encoder fails on (its batch fails, then it fails alone), or whose features are not as many as
its placeholder tokens (the processor's options made tiles the tower was not built for: transformers'
"image features and image tokens do not match"), gets no features (the forward places zeros) and is recorded
with the reason: the engine fails the requests that show it after the step (:meth:`ImageInputs.take_failed`),
and later requests showing it are not encoded again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

IMAGE_ID_BASE = 1 << 62
OFFSET_BITS = 16
MAX_IMAGE_TOKENS = 1 << OFFSET_BITS
_KEY_MASK = (1 << (62 - OFFSET_BITS)) - 1


def image_token_ids(key: int, num_tokens: int) -> list[int]:
    """The image token ids of image ``key``'s ``num_tokens`` placeholder positions."""
    base = IMAGE_ID_BASE + (key << OFFSET_BITS)
    return list(range(base, base + num_tokens))


@dataclass
class EncoderStats:
    """``references``: image slots of the requests added; ``distinct``: distinct images among them;
    ``encoded``: images run through the encoder (more than ``distinct`` only after a cache eviction);
    ``encoder_seconds``: wall time spent in the encoder."""

    references: int = 0
    distinct: int = 0
    encoded: int = 0
    encoder_seconds: float = 0.0


class EncoderCache:
    """Encoder outputs by image key, least recently used evicted first once over ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._entries: OrderedDict[int, Tensor] = OrderedDict()

    def get(self, key: int) -> Tensor | None:
        t = self._entries.get(key)
        if t is not None:
            self._entries.move_to_end(key)
        return t

    def put(self, key: int, features: Tensor) -> None:
        if key in self._entries:
            return
        size = features.numel() * features.element_size()
        while self._entries and self.used + size > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.used -= old.numel() * old.element_size()
        if size <= self.capacity:
            self._entries[key] = features
            self.used += size

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class _Image:
    key: int
    pixels: dict[str, Tensor]
    refs: int = 0
    num_tokens: int | None = None
    """The image's placeholder tokens in its prompts (its features must be as many); None: not checked."""


@dataclass
class ImageInputs:
    """The images of the requests in the engine: content hash -> key, key -> pixels (reference-counted), and
    the encoder cache. Thread-safe (async scheduling runs forwards in a worker thread)."""

    cache: EncoderCache
    stats: EncoderStats = field(default_factory=EncoderStats)
    _by_hash: dict[str, _Image] = field(default_factory=dict)
    _by_key: dict[int, tuple[str, _Image]] = field(default_factory=dict)
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _bad: dict[str, str] = field(default_factory=dict)
    """Content hash -> why the encoder failed on that image (kept: it is never encoded again)."""
    _failed: dict[str, str] = field(default_factory=dict)
    """The failures of the steps since the last :meth:`take_failed`."""

    def acquire(self, content_hash: str, pixels: dict[str, Tensor], num_tokens: int | None = None) -> int:
        """Register one reference to the image (its pixel inputs kept while referenced); returns its key.
        ``num_tokens``: its placeholder tokens in the prompt, which its encoded features must number."""
        with self._lock:
            self.stats.references += 1
            if content_hash not in self._seen:
                self._seen.add(content_hash)
                self.stats.distinct += 1
            img = self._by_hash.get(content_hash)
            if img is None:
                key = int(content_hash[:16], 16) & _KEY_MASK
                while key in self._by_key and self._by_key[key][0] != content_hash:
                    key = (key + 1) & _KEY_MASK  # a short-key collision: probe
                known = self._by_key.get(key)
                img = known[1] if known is not None else _Image(key, pixels)
                img.pixels = pixels
                img.num_tokens = num_tokens
                self._by_hash[content_hash] = img
                self._by_key[key] = (content_hash, img)
            img.refs += 1
            return img.key

    def release(self, content_hash: str) -> None:
        """Drop one reference; the pixels go with the last one (the key and cached features stay)."""
        with self._lock:
            img = self._by_hash.get(content_hash)
            if img is None:
                return
            img.refs -= 1
            if img.refs <= 0:
                del self._by_hash[content_hash]
                img.pixels = {}

    def features(self, keys: list[int], encode) -> dict[int, Tensor]:
        """Features of each key: from the cache, the rest encoded in one batch by ``encode(pixel list)``. A key
        whose pixels were released is left out: only a step in flight when its request was aborted asks for it."""
        out: dict[int, Tensor] = {}
        missing: list[int] = []
        hashes: list[str] = []
        pixels: list[dict[str, Tensor]] = []
        expected: list[int | None] = []
        with self._lock:
            for k in keys:
                t = self.cache.get(k)
                if t is not None:
                    out[k] = t
                    continue
                h, img = self._by_key[k]
                if not img.pixels:  # released: only a step in flight when its request was aborted asks
                    continue
                if h in self._bad:  # failed before: no features, the failure again
                    self._failed[h] = self._bad[h]
                    continue
                missing.append(k)
                hashes.append(h)
                pixels.append(img.pixels)
                expected.append(img.num_tokens)
        if missing:
            t0 = time.perf_counter()
            try:
                computed: list[Tensor | None] = list(encode(pixels))
            except Exception:  # noqa: BLE001 - a bad image in the batch: each alone, the bad ones recorded
                computed = [self._encode_alone(h, p, encode) for h, p in zip(hashes, pixels)]
            elapsed = time.perf_counter() - t0
            with self._lock:
                self.stats.encoded += sum(t is not None for t in computed)
                self.stats.encoder_seconds += elapsed
                for k, h, t, n in zip(missing, hashes, computed, expected):
                    if t is not None and n is not None and t.shape[0] != n:
                        self._bad[h] = self._failed[h] = (
                            f"the vision encoder made {t.shape[0]} feature tokens for this image but its prompt "
                            f"holds {n} image tokens (image features and image tokens do not match: the image "
                            "processor's options do not fit the model)"
                        )
                    elif t is not None:
                        out[k] = t
                        self.cache.put(k, t)
        return out

    def _encode_alone(self, content_hash: str, pixels: dict[str, Tensor], encode) -> Tensor | None:
        """One image's features, or None (its failure recorded) when the encoder fails on it."""
        try:
            return encode([pixels])[0]
        except Exception as e:  # noqa: BLE001 - any encoder error fails this image's requests alone
            reason = " ".join(f"the vision encoder failed on this image: {type(e).__name__}: {e}".split())
            with self._lock:
                self._bad[content_hash] = self._failed[content_hash] = reason[:500]
            return None

    def take_failed(self) -> dict[str, str]:
        """Content hash -> reason of each image the encoder failed on since the last call."""
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed


class ImageTextModel(nn.Module):
    """A native language model (``language_model``: :class:`~batchgen.models.llama.CausalLM`) fed image
    features from ``encoder`` (a module with ``encode(list of pixel dicts) -> list of [tokens, hidden]``).
    ``config`` is the language model's; ``image_token_id`` the checkpoint's placeholder token.

    ``bidirectional_images``: an image's tokens attend to each other both ways during prefill (Gemma 3): each
    run of consecutive image tokens in a sequence's chunk is one span (transformers' ``token_type_ids``
    groups), passed to attention as ``AttentionMetadata.key_end``. The engine keeps a span in one chunk
    (:class:`~batchgen.engine.features.multimodal.ImageSpans`); a chunk that starts inside a span (its first
    part a prefix-cache hit) sees that part causally, which is all of it."""

    def __init__(
        self,
        language_model: nn.Module,
        encoder: nn.Module,
        image_token_id: int,
        cache_bytes: int,
        bidirectional_images: bool = False,
    ):
        super().__init__()
        self.language_model = language_model
        self.encoder = encoder
        self.config = language_model.config
        self.image_token_id = image_token_id
        self.bidirectional_images = bidirectional_images
        self.images = ImageInputs(EncoderCache(cache_bytes))

    def forward(self, input_ids: Tensor, positions: Tensor, ctx) -> Tensor:
        backbone = self.language_model.model
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return backbone(input_ids, positions, ctx)  # a captured decode step carries no image tokens
        is_image = input_ids >= IMAGE_ID_BASE
        if not bool(is_image.any()):
            return backbone(input_ids, positions, ctx)
        embeds = backbone.embed(torch.where(is_image, 0, input_ids))
        rel = input_ids[is_image] - IMAGE_ID_BASE
        keys, offsets = rel >> OFFSET_BITS, rel & (MAX_IMAGE_TOKENS - 1)
        uniq = sorted(set(keys.tolist()))
        feats = self.images.features(uniq, self.encoder.encode)
        for k in uniq:  # an aborted request's image in a step already in flight: its rows are discarded
            if k not in feats:
                n = int(offsets[keys == k].max()) + 1
                feats[k] = torch.zeros(n, embeds.shape[-1], dtype=embeds.dtype, device=embeds.device)
        table = torch.cat([feats[k] for k in uniq]).to(embeds.dtype)
        starts = torch.tensor([0] + [feats[k].shape[0] for k in uniq], device=embeds.device).cumsum(0)
        index = torch.searchsorted(torch.tensor(uniq, device=keys.device), keys)
        embeds[is_image] = table[starts[index] + offsets]
        if self.bidirectional_images:
            key_end = image_span_ends(is_image, positions, ctx.meta.cu_seqlens_q)
            if key_end is not None:
                ctx = dataclasses.replace(ctx, meta=dataclasses.replace(ctx.meta, key_end=key_end))
        return backbone(input_ids, positions, ctx, inputs_embeds=embeds)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.language_model.compute_logits(hidden)


def image_span_ends(is_image: Tensor, positions: Tensor, cu_seqlens_q: Tensor) -> Tensor | None:
    """``[T]`` key bounds (``AttentionMetadata.key_end``) of a packed batch: for a token of a run of
    consecutive image tokens inside one sequence's chunk, the position after the run; for any other token its
    own position + 1. None when no run has two tokens (nothing to see beyond causal)."""
    t = is_image.shape[0]
    first = torch.zeros(t, dtype=torch.bool, device=is_image.device)
    first[cu_seqlens_q[:-1].long().clamp(max=max(t - 1, 0))] = True
    prev = torch.cat([is_image.new_zeros(1), is_image[:-1]])
    run_start = is_image & (first | ~prev)
    if int(is_image.sum()) <= int(run_start.sum()):
        return None
    group = torch.cumsum(run_start.long(), 0) - 1
    ends = positions.long() + 1
    last = torch.zeros(int(run_start.sum()), dtype=torch.long, device=ends.device)
    last.scatter_reduce_(0, group[is_image], ends[is_image], reduce="amax")
    ends[is_image] = last[group[is_image]]
    return ends


def load_vision_weights(
    encoder: nn.Module, ckpt: str, prefixes: tuple[tuple[str, str], ...], ignore_missing: tuple[str, ...] = ()
) -> None:
    """Load into ``encoder`` the checkpoint's tensors named under one of ``prefixes`` (checkpoint prefix, ours:
    the first that matches renames the tensor; the others are not the encoder's). ValueError naming the
    checkpoint when the tensors and the encoder's parameters differ (missing names ending in one of
    ``ignore_missing`` aside)."""
    from safetensors import safe_open

    from batchgen.models.loader import safetensors_files

    state: dict[str, Tensor] = {}
    for file in safetensors_files(ckpt):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                for theirs, ours in prefixes:
                    if name.startswith(theirs):
                        state[ours + name[len(theirs) :]] = f.get_tensor(name)
                        break
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(ignore_missing)] if ignore_missing else missing
    if missing or unexpected:
        raise ValueError(
            f"{ckpt}: the vision encoder's tensors do not match its config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
