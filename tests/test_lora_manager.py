"""The adapter slot manager: validation once per id, slots assigned on demand, LRU eviction of unpinned slots only,
the loads handed out in order for the next launched step."""

from __future__ import annotations

import pytest
from lora_helpers import adapter

from batchgen.engine.features.lora_manager import LoRAManager
from batchgen.lora_request import LoRARequest
from batchgen.models.config import ModelConfig


@pytest.fixture(scope="module")
def setup(llama_ckpt):
    paths = [adapter(llama_ckpt, 2 + i, ("q_proj",), seed=i) for i in range(3)]
    return llama_ckpt, ModelConfig.from_pretrained(llama_ckpt), paths


def _loads(m: LoRAManager) -> list[tuple[int, str]]:
    return [(load.slot, load.adapter.name) for load in m.take_loads()]


def test_lru_load_on_demand_and_pins(setup, tmp_path):
    _, config, paths = setup
    m = LoRAManager(2, 8, config, max_cpu_loras=2)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    assert all(m.check(r) is None for r in reqs)
    assert m.stats.disk_reads == 3 and len(m.cpu) == 2  # CPU cache keeps the 2 most recent
    assert m.acquire(1) == 0 and m.acquire(2) == 1
    assert _loads(m) == [(0, "a0"), (1, "a1")] and m.take_loads() == []  # taken once
    assert not m.can_acquire(3)  # both slots pinned: a third adapter waits, nothing is evicted
    with pytest.raises(RuntimeError, match="pinned"):
        m.acquire(3)
    assert m.acquire(1) == 0  # resident: no load
    m.release(2)
    assert m.can_acquire(3)
    assert m.acquire(3) == 1  # evicts id 2 (unpinned), not id 1 (pinned twice)
    assert _loads(m) == [(1, "a2")]
    assert m.stats.evictions == 1 and m.slot_of == {1: 0, 3: 1}
    m.release(1)
    m.release(1)
    m.release(3)
    assert m.acquire(2) == 0  # LRU among unpinned: id 1 (used before id 3)
    assert [(load.slot, load.request.lora_int_id) for load in m.take_loads()] == [(0, 2)]
    # CPU cache of 2: ids 1 and 2 and 3 were each read again once after falling out of it
    assert m.stats.disk_reads == 6


def test_errors_once_per_id(setup, tmp_path):
    _, config, paths = setup
    m = LoRAManager(1, 8, config)
    bad = LoRARequest("missing", 7, str(tmp_path / "nope"))
    err = m.check(bad)
    assert "not a directory" in err and m.check(bad) == err
    assert m.check(LoRARequest("a0", 1, paths[0])) is None
    clash = m.check(LoRARequest("other", 1, paths[1]))
    assert "lora_int_id 1 is already adapter 'a0'" in clash
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, paths[0])
