"""Which LoRA adapters the engine knows, and which are resident in the model's ``max_loras`` slots.

* :meth:`LoRAManager.check` validates a request's adapter once per ``lora_int_id`` (reads and parses it: an
  unreadable or unfit adapter fails that request alone, with the reason), and keeps parsed adapters in a CPU
  cache of ``max_cpu_loras`` (:class:`AdapterCache`, LRU; an evicted one is read again when next loaded).
* Residency: a request *pins* its adapter's slot from admission (:meth:`acquire`) to its end
  (:meth:`release`). :meth:`acquire` assigns the adapter a free slot, else the least recently used unpinned
  one; :meth:`can_acquire` says whether that is possible now, so a scheduler admits a request only when its
  adapter can be made resident, and rows of resident adapters never wait for a load.
* The manager only decides: the weights are written by the model runner, from the
  :class:`~batchgen.engine.worker.step_input.LoRALoad` list the engine takes (:meth:`take_loads`) into the next step
  it launches. Steps run in launch order, so a slot is rewritten only after the forward of every step launched
  before, including one still in flight (pipelined) that holds a row of the slot's previous,
  finished request; under tensor parallelism the list reaches every rank with its step.

Invariants: ``slot_of`` and ``id_in`` are inverse maps of the resident adapters (as they are once the pending
loads are applied); a pinned adapter is resident; ``pins[id] > 0`` only for resident ids.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from batchgen.engine.config import EngineConfig
from batchgen.kernels.lora import LoRAPlan
from batchgen.lora_request import LoRARequest
from batchgen.models.config import ModelConfig
from batchgen.models.llama import CausalLM
from batchgen.models.lora import LoRASlots, attach_lora, whole_model_config
from batchgen.models.lora_adapter import LoRAAdapter, LoRAAdapterError, load_adapter

if TYPE_CHECKING:
    from batchgen.engine.sched.output import ScheduledSeq
    from batchgen.engine.sched.sequence import Request

logger = logging.getLogger(__name__)


@dataclass
class AdapterSlots:
    """A runner's LoRA slots (its :attr:`ModelRunner.adapters`) and where it reads the adapter of a load that
    carries none (a tensor-parallel worker: from the adapter's directory)."""

    slots: LoRASlots
    source: Callable[[LoRARequest], LoRAAdapter] | None = None


@dataclass
class LoRALoad:
    """Write adapter ``request`` into LoRA slot ``slot`` before the step's forward (a
    :class:`~batchgen.engine.worker.step_input.SlotLoad`). ``adapter``: rank 0's parsed copy (None in the
    message to tensor-parallel workers: they read ``request.lora_path`` themselves)."""

    slot: int
    request: LoRARequest
    adapter: LoRAAdapter | None = None

    def apply(self, slots: AdapterSlots | None) -> None:
        if slots is None:
            raise RuntimeError("a LoRA slot load was sent to a runner without LoRA slots")
        adapter = self.adapter
        if adapter is None:
            assert slots.source is not None
            adapter = slots.source(self.request)
        slots.slots.load(self.slot, adapter)

    def for_workers(self) -> LoRALoad:
        return LoRALoad(self.slot, self.request)


def token_slots(seqs: list[ScheduledSeq], seq_idx: np.ndarray, device: torch.device) -> dict[str, Any]:
    """The step's per-token model input (an :class:`~batchgen.engine.worker.input_batch.InputBatch` token
    input): each token's adapter slot, from its request's (-1: the base model); none when no token has one."""
    seq_slots = np.fromiter((s.seq.request.adapter_slot for s in seqs), dtype=np.int64, count=len(seqs))
    if not (seq_slots >= 0).any():
        return {}
    return {"lora": LoRAPlan.build(seq_slots[seq_idx], device)}


@dataclass
class LoRAStats:
    loads: int = 0
    """Adapters written into a slot (a load on demand, including reloads after an eviction)."""
    evictions: int = 0
    """Resident adapters replaced to make room for another."""
    disk_reads: int = 0
    """Adapter directories read and parsed (validation, and reloads after leaving the CPU cache)."""


class AdapterCache:
    """Parsed adapters by ``lora_int_id``; the ``capacity`` most recently used stay in CPU memory, the others
    are read again from their directory. ``config`` is the whole model's (adapters are validated against the
    full sizes; a tensor-parallel rank takes its shard when it writes a slot)."""

    def __init__(
        self, config: ModelConfig, max_rank: int, capacity: int, stats: LoRAStats | None = None
    ) -> None:
        self.config = config
        self.max_rank = max_rank
        self.capacity = capacity
        self.stats = stats or LoRAStats()
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def get(self, req: LoRARequest) -> LoRAAdapter:
        """The parsed adapter of ``req``; raises :class:`LoRAAdapterError` when it cannot be read or applied."""
        cached = self.adapters.get(req.lora_int_id)
        if cached is not None:
            self.adapters.move_to_end(req.lora_int_id)
            return cached
        adapter = load_adapter(req.lora_name, req.lora_path, self.config, self.max_rank)
        self.stats.disk_reads += 1
        self.adapters[req.lora_int_id] = adapter
        while len(self.adapters) > self.capacity:
            self.adapters.popitem(last=False)
        return adapter

    def __len__(self) -> int:
        return len(self.adapters)


class LoRAManager:
    def __init__(
        self, max_loras: int, max_rank: int, config: ModelConfig, max_cpu_loras: int | None = None
    ) -> None:
        """``config``: the whole model's (see :class:`AdapterCache`)."""
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.stats = LoRAStats()
        self.known: dict[int, LoRARequest] = {}
        self.errors: dict[int, str] = {}
        self.cpu = AdapterCache(config, max_rank, self.max_cpu_loras, self.stats)
        self.slot_of: dict[int, int] = {}
        self.id_in: list[int | None] = [None] * max_loras
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident ids, least recently used first
        self.pins: dict[int, int] = {}
        self.pending: list[LoRALoad] = []
        """Slot loads decided and not yet taken into a launched step, oldest first."""

    # ------------------------------------------------------------------------------------- requests
    def bind(self, request: Request, lora_request: LoRARequest) -> str | None:
        """Run ``request`` under ``lora_request``'s adapter: the request's weights key and its prefix-cache root
        (so the same prompt under two adapters shares no block). Returns the request's error if the adapter
        cannot be applied (:meth:`check`)."""
        request.adapter = lora_request
        request.cache_root = adapter_root(lora_request)
        return self.check(lora_request)

    def check(self, req: LoRARequest) -> str | None:
        """None when ``req``'s adapter can be applied, else the error for the request (see module doc)."""
        known = self.known.get(req.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (req.lora_name, req.lora_path):
            return (
                f"lora_int_id {req.lora_int_id} is already adapter {known.lora_name!r} ({known.lora_path}); "
                f"give {req.lora_name!r} ({req.lora_path}) its own id"
            )
        if req.lora_int_id in self.errors:
            return self.errors[req.lora_int_id]
        if known is not None:
            return None
        try:
            self.cpu.get(req)
        except LoRAAdapterError as e:
            self.errors[req.lora_int_id] = str(e)
            self.known[req.lora_int_id] = req
            return str(e)
        self.known[req.lora_int_id] = req
        return None

    # -------------------------------------------------------------------------------------- residency
    def can_acquire(self, lora_int_id: int) -> bool:
        """Whether :meth:`acquire` would succeed now (resident, a free slot, or an unpinned one to evict)."""
        if lora_int_id in self.slot_of:
            return True
        return len(self.slot_of) < self.max_loras or any(self.pins.get(i, 0) == 0 for i in self.lru)

    def acquire(self, lora_int_id: int) -> int:
        """Pin the adapter and return its slot; a load into the slot is decided on demand (:meth:`take_loads`).
        Raises RuntimeError when every slot is pinned (call :meth:`can_acquire` first),
        :class:`LoRAAdapterError` when the adapter can no longer be read."""
        slot = self.slot_of.get(lora_int_id)
        if slot is None:
            request = self.known[lora_int_id]
            adapter = self.cpu.get(request)  # read (or fail) before any slot changes hands
            slot = self._free_slot()
            self.pending.append(LoRALoad(slot, request, adapter))
            self.stats.loads += 1
            self.slot_of[lora_int_id] = slot
            self.id_in[slot] = lora_int_id
            logger.debug("LoRA adapter %s goes into slot %d", adapter.name, slot)
        self.lru[lora_int_id] = None
        self.lru.move_to_end(lora_int_id)
        self.pins[lora_int_id] = self.pins.get(lora_int_id, 0) + 1
        return slot

    def release(self, lora_int_id: int) -> None:
        """Unpin once (the adapter stays resident until its slot is needed)."""
        n = self.pins.get(lora_int_id, 0)
        if n <= 1:
            self.pins.pop(lora_int_id, None)
        else:
            self.pins[lora_int_id] = n - 1

    # ------------------------------------------------------------- the scheduler's admission gate
    def ready(self, request: Request) -> bool:
        """Whether ``request`` may be admitted now: no adapter, its slot already pinned, or one it can pin."""
        adapter = request.adapter
        return adapter is None or request.adapter_slot >= 0 or self.can_acquire(adapter.lora_int_id)

    def take(self, request: Request) -> None:
        """Pin ``request``'s adapter slot at its first admission (kept through preemptions until it ends)."""
        if request.adapter is not None and request.adapter_slot < 0:
            request.adapter_slot = self.acquire(request.adapter.lora_int_id)

    def give_back(self, request: Request) -> None:
        """``request`` ended (finished or aborted): unpin its adapter slot."""
        if request.adapter is not None and request.adapter_slot >= 0:
            self.release(request.adapter.lora_int_id)
            request.adapter_slot = -1

    def take_loads(self) -> list[LoRALoad]:
        """The slot loads decided since the last call, in order (the next launched step applies them before
        its forward)."""
        loads, self.pending = self.pending, []
        return loads

    def _free_slot(self) -> int:
        for slot, owner in enumerate(self.id_in):
            if owner is None:
                return slot
        victim = next((i for i in self.lru if self.pins.get(i, 0) == 0), None)
        if victim is None:
            raise RuntimeError(f"all {self.max_loras} LoRA slots are pinned by running requests")
        slot = self.slot_of.pop(victim)
        del self.lru[victim]
        self.id_in[slot] = None  # the load that follows overwrites every part of the slot
        self.stats.evictions += 1
        return slot


def adapter_root(lora_request: LoRARequest) -> bytes:
    """The root of the prefix-cache hash chain of requests under this adapter."""
    return hashlib.sha256(f"lora:{lora_request.lora_int_id}".encode()).digest()


def attach(model: Any, model_path: str, config: EngineConfig) -> tuple[LoRAManager, AdapterSlots]:
    """Rank 0's adapter slots in ``model`` (before the KV cache is sized: they count as weights) and their
    manager. Native architectures only."""
    if not isinstance(model, CausalLM):
        raise ValueError(
            f"engine.enable_lora=true needs a native architecture ({model.config.architecture} runs on "
            f"transformers' modeling code here); use one of batchgen's native architectures"
        )
    slots = attach_lora(model, config.max_loras, config.max_lora_rank)
    whole = whole_model_config(model_path, model.config)
    manager = LoRAManager(config.max_loras, config.max_lora_rank, whole, config.max_cpu_loras)
    return manager, AdapterSlots(slots)


def worker_attach(model_path: str, config: EngineConfig) -> Callable[[Any], AdapterSlots] | None:
    """What a tensor-parallel worker runs on its model before sizing its KV cache (picklable): its adapter
    slots (:func:`attach_worker_slots`); None without ``enable_lora``."""
    if not config.enable_lora:
        return None
    return functools.partial(attach_worker_slots, model_path=model_path, config=config)


def cpu_capacity(config: EngineConfig) -> int:
    """Parsed adapters kept in CPU memory: ``max_cpu_loras``, at least ``max_loras``."""
    return max(config.max_cpu_loras or config.max_loras, config.max_loras)


def attach_worker_slots(model, model_path: str, config: EngineConfig) -> AdapterSlots:
    """A tensor-parallel worker's LoRA slots (its shard of every adapter, as rank 0's), reading the adapters
    of rank 0's slot loads through a cache of their own (their directories: every rank reads the same files)."""
    slots = attach_lora(model, config.max_loras, config.max_lora_rank)
    whole = whole_model_config(model_path, model.config)
    return AdapterSlots(slots, AdapterCache(whole, config.max_lora_rank, cpu_capacity(config)).get)
