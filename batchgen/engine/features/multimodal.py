"""The engine's hook for image-bearing requests: a request that shows images needs *encoder embeddings placed*
at its image positions. Here that need is turned into the sequence's token ids: each image's placeholder
positions get the image token ids of :mod:`batchgen.models.vision` (keyed by the image's content hash), and the
image's pixels are held by the model's :class:`~batchgen.models.vision.ImageInputs` while the request lives. The
scheduler, the KV cache manager and the runner see ordinary token ids: the prefix cache keys placeholder blocks
by image, and the model's forward places the (cached or freshly encoded) features.

A model whose positions depend on its images (multimodal RoPE: ``rope_positions(num_tokens, images)`` ->
``([S, n] prompt positions, decode delta)``) gets them through the step's per-token inputs
(:meth:`EngineImages.token_positions`, an :class:`~batchgen.engine.worker.input_batch.InputBatch` token input):
each request's table is computed once when it is placed; a token at cache position ``p`` takes column ``p``
of its prompt's table, or ``p + delta`` in every row past the prompt (generated tokens, any sample or beam of
the request). Rows without images, and whole steps without them, keep the cache positions.

A model whose image tokens attend to each other both ways (``bidirectional_images``: Gemma 3) needs each run
of an image's tokens computed in one prefill chunk: the request carries :class:`ImageSpans`, an add-on that
never lets a chunk end inside a run (a run longer than ``max_num_batched_tokens`` fails its request).

Invariants: ``Request.prompt_token_ids`` keeps the checkpoint's placeholder token (what outputs report and
penalties see); only the sequence's token ids carry image token ids. Every image acquired by ``place`` is
released exactly once, when its request finishes or is aborted; its position table goes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from batchgen.engine.config import EngineConfig, parse_bytes
from batchgen.engine.sched.request_group import AddOn
from batchgen.engine.sched.sequence import Sequence as Seq
from batchgen.models.config import no_images_reason
from batchgen.models.vision import MAX_IMAGE_TOKENS, EncoderStats, image_token_ids


class ImageSlot(Protocol):
    """One image of a request: content hash, the processor's tensors, its first placeholder position, its
    number of placeholder tokens and, when they are not contiguous, their offsets from the first
    (:class:`batchgen.multimodal.inputs.ImageItem`)."""

    hash: str
    pixels: dict[str, Tensor]
    start: int
    num_tokens: int
    offsets: tuple[int, ...] | None


class EngineImages:
    """Places images for the engine (``images`` of the model, None when it takes no images)."""

    def __init__(self, model: Any, config: EngineConfig) -> None:
        self.inputs = getattr(model, "images", None)
        self.architecture = model.config.architecture
        if self.inputs is not None:
            self.inputs.cache.capacity = parse_bytes(config.encoder_cache_memory)
        self._held: dict[str | int, list[str]] = {}
        self.position_fn = getattr(model, "rope_positions", None)
        """The model's own position ids of a row with images (None: positions are cache positions)."""
        self._positions: dict[str | int, tuple[np.ndarray, int]] = {}
        self.bidirectional = bool(getattr(model, "bidirectional_images", False))
        """Each run of an image's tokens is computed in one chunk (:class:`ImageSpans`)."""
        self.max_chunk = config.max_num_batched_tokens

    @property
    def stats(self) -> EncoderStats:
        return self.inputs.stats if self.inputs is not None else EncoderStats()

    def place(
        self, request_id: str | int, token_ids: list[int], images: Sequence[ImageSlot]
    ) -> list[int] | str:
        """The sequence's token ids with each image's positions set to its image token ids, or why not."""
        if self.inputs is None:
            return no_images_reason(self.architecture)
        for i, item in enumerate(images):
            end = item.start + (item.num_tokens if item.offsets is None else item.offsets[-1] + 1)
            if item.num_tokens > MAX_IMAGE_TOKENS or end > len(token_ids) or item.start < 0:
                return f"image {i}: its {item.num_tokens} image tokens at position {item.start} do not fit the prompt"
        if self.bidirectional:
            longest = max((e - s for item in images for s, e in image_runs(item)), default=0)
            if longest > self.max_chunk:
                return (
                    f"an image's {longest} image tokens attend to each other, so they are computed in one "
                    f"step, but engine.max_num_batched_tokens is {self.max_chunk}; raise it to {longest} or more"
                )
        seq = list(token_ids)
        held = self._held.setdefault(request_id, [])
        for item in images:
            key = self.inputs.acquire(item.hash, item.pixels, item.num_tokens)
            held.append(item.hash)
            ids = image_token_ids(key, item.num_tokens)
            if item.offsets is None:
                seq[item.start : item.start + item.num_tokens] = ids
            else:  # feature tokens interleaved with text tokens
                for offset, token in zip(item.offsets, ids):
                    seq[item.start + offset] = token
        if self.position_fn is not None:
            self._positions[request_id] = self.position_fn(len(seq), images)
        return seq

    def addon(self, images: Sequence[ImageSlot]) -> AddOn | None:
        """What a request showing ``images`` asks of its chunks: its image runs kept whole, or nothing."""
        if not self.bidirectional:
            return None
        return ImageSpans(sorted(r for item in images for r in image_runs(item)))

    def failures(self) -> dict[str | int, str]:
        """Request id -> why, for each request in the engine showing an image the encoder failed on since the
        last call (:meth:`~batchgen.models.vision.ImageInputs.take_failed`)."""
        bad = self.inputs.take_failed() if self.inputs is not None else {}
        if not bad:
            return {}
        out: dict[str | int, str] = {}
        for request_id, hashes in self._held.items():
            for i, h in enumerate(hashes):
                if h in bad:
                    out[request_id] = f"image {i}: {bad[h]}"
                    break
        return out

    def release(self, request_id: str | int) -> None:
        for h in self._held.pop(request_id, ()):
            self.inputs.release(h)
        self._positions.pop(request_id, None)

    def token_positions(self, seqs: list[Any], seq_idx: np.ndarray, device: torch.device) -> dict[str, Any]:
        """The step's ``rope_positions`` ``[S, T]`` (a per-token input of the step): none when no scheduled
        sequence belongs to a request with images."""
        tables = [self._positions.get(s.seq.request.request_id) for s in seqs] if self._positions else []
        if not any(t is not None for t in tables):
            return {}
        rows = next(t for t in tables if t is not None)[0].shape[0]
        starts = np.fromiter((s.start for s in seqs), dtype=np.int64, count=len(seqs))
        cu = np.concatenate([[0], np.cumsum([s.num_tokens for s in seqs])])
        pos = starts[seq_idx] + (np.arange(seq_idx.shape[0]) - cu[seq_idx])
        out = np.repeat(pos[None, :], rows, axis=0)
        for i, t in enumerate(tables):
            if t is None:
                continue
            table, delta = t
            lo, hi = cu[i], cu[i + 1]
            p = pos[lo:hi]
            inside = p < table.shape[1]
            out[:, lo:hi] = np.where(inside, table[:, np.minimum(p, table.shape[1] - 1)], p + delta)
        return {"rope_positions": torch.from_numpy(out).to(device)}

    def report(self, wall_time_s: float) -> dict[str, Any]:
        """The job report's ``images`` section (empty when no request showed an image): image slots of the
        rows, distinct images, encoder runs, encoder seconds and their share of the wall time."""
        s = self.stats
        if not s.references:
            return {}
        return {
            "images": {
                "references": s.references,
                "distinct": s.distinct,
                "encoded": s.encoded,
                "encoder_time_s": round(s.encoder_seconds, 4),
                "encoder_share": s.encoder_seconds / max(wall_time_s, 1e-9),
            }
        }


def image_runs(item: ImageSlot) -> list[tuple[int, int]]:
    """The ``[start, end)`` position runs of an image's consecutive tokens in its prompt."""
    if item.offsets is None:
        return [(item.start, item.start + item.num_tokens)] if item.num_tokens else []
    runs: list[tuple[int, int]] = []
    for o in item.offsets:
        p = item.start + o
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class ImageSpans(AddOn):
    """A request's image runs (sorted, disjoint ``[start, end)``), each computed in one prefill chunk: a chunk
    that would end inside a run ends before it (or waits, when it starts inside or at the run and the
    budget does not reach its end). A chunk starting inside a run (its first part a prefix-cache hit)
    therefore takes the rest of it whole."""

    def __init__(self, runs: list[tuple[int, int]]) -> None:
        self.runs = runs

    def chunk(self, seq: Seq, num_new: int) -> int:
        start = seq.num_computed_tokens
        end = start + num_new
        for s, e in self.runs:
            if s < end < e:
                return max(0, s - start)
            if s >= end:
                break
        return num_new
