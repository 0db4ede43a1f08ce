"""Which LoRA adapters the engine knows, and which are resident in the model's ``max_loras`` slots.

* :meth:`LoRAManager.check` validates a request's adapter once per ``lora_int_id`` (reads and parses it: an
  unreadable or unfit adapter fails that request alone, with the reason), and keeps parsed adapters in a CPU
  cache of ``max_cpu_loras`` (LRU; an evicted one is read again when next loaded).
* Residency: a request *pins* its adapter's slot from admission (:meth:`acquire`) to its end
  (:meth:`release`). :meth:`acquire` loads the adapter on demand into a free slot, else into the least recently
  used unpinned slot; :meth:`can_acquire` says whether that is possible now, so a scheduler admits a request
  only when its adapter can be made resident, and rows of resident adapters never wait for a load.

Invariants: ``slot_of`` and ``id_in`` are inverse maps of the resident adapters; a pinned adapter is resident;
``pins[id] > 0`` only for resident ids.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from batchgen.lora_request import LoRARequest
from batchgen.models.config import ModelConfig
from batchgen.models.lora import LoRASlots
from batchgen.models.lora_adapter import LoRAAdapter, LoRAAdapterError, load_adapter

logger = logging.getLogger(__name__)


@dataclass
class LoRAStats:
    loads: int = 0
    """Adapters written into a slot (a load on demand, including reloads after an eviction)."""
    evictions: int = 0
    """Resident adapters replaced to make room for another."""
    disk_reads: int = 0
    """Adapter directories read and parsed (validation, and reloads after leaving the CPU cache)."""


class LoRAManager:
    def __init__(self, slots: LoRASlots, config: ModelConfig, max_cpu_loras: int | None = None) -> None:
        self.slots = slots
        self.config = config
        self.max_loras = slots.max_loras
        self.max_rank = slots.max_rank
        self.max_cpu_loras = max(max_cpu_loras or self.max_loras, self.max_loras)
        self.known: dict[int, LoRARequest] = {}
        self.errors: dict[int, str] = {}
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slot_of: dict[int, int] = {}
        self.id_in: list[int | None] = [None] * self.max_loras
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident ids, least recently used first
        self.pins: dict[int, int] = {}
        self.stats = LoRAStats()

    # ------------------------------------------------------------------------------------- validation
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
            self._read(req)
        except LoRAAdapterError as e:
            self.errors[req.lora_int_id] = str(e)
            self.known[req.lora_int_id] = req
            return str(e)
        self.known[req.lora_int_id] = req
        return None

    def _read(self, req: LoRARequest) -> LoRAAdapter:
        cached = self.cpu.get(req.lora_int_id)
        if cached is not None:
            self.cpu.move_to_end(req.lora_int_id)
            return cached
        adapter = load_adapter(req.lora_name, req.lora_path, self.config, self.max_rank)
        self.stats.disk_reads += 1
        self.cpu[req.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter

    # -------------------------------------------------------------------------------------- residency
    def can_acquire(self, lora_int_id: int) -> bool:
        """Whether :meth:`acquire` would succeed now (resident, a free slot, or an unpinned one to evict)."""
        if lora_int_id in self.slot_of:
            return True
        return len(self.slot_of) < self.max_loras or any(self.pins.get(i, 0) == 0 for i in self.lru)

    def acquire(self, lora_int_id: int) -> int:
        """Pin the adapter (loading it on demand) and return its slot. Raises RuntimeError when every slot
        is pinned (call :meth:`can_acquire` first), :class:`LoRAAdapterError` when it can no longer be read."""
        slot = self.slot_of.get(lora_int_id)
        if slot is None:
            slot = self._free_slot()
            adapter = self._read(self.known[lora_int_id])
            self.slots.load(slot, adapter)
            self.stats.loads += 1
            self.slot_of[lora_int_id] = slot
            self.id_in[slot] = lora_int_id
            logger.debug("LoRA adapter %s loaded into slot %d", adapter.name, slot)
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

    @property
    def num_resident(self) -> int:
        return len(self.slot_of)
