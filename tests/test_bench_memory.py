"""Smoke test of the memory benchmark (``python -m batchgen.bench.memory --small``): runs and is sane."""

from __future__ import annotations

import json

import pytest

from batchgen.bench import memory
from batchgen.bench.memory import FirstFitContiguousKV, Request


def test_first_fit_extents_merge_back():
    kv = FirstFitContiguousKV(100)
    a = kv.admit(Request(0, [1] * 10, 20))  # 30 slots
    b = kv.admit(Request(1, [1] * 10, 20, n=2))  # 2 x 30
    assert a is not None and b is not None
    assert kv.admit(Request(2, [1] * 10, 10)) is None  # 10 free, needs 20
    assert kv.external(Request(2, [1] * 10, 10)) == 10
    for s in b + a:
        kv.release(s)
    assert kv.starts == [0] and kv.lengths == [100] and kv.reserved == 0 and kv.live == 0


def test_memory_bench_small(tmp_path, capsys):
    results = memory.main(["--small", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| KV memory utilisation" in out and "Block-size sweep" in out
    for wl in ("fixed", "sharegpt"):
        rs = [r for r in results if r.workload == wl]
        assert {r.scenario for r in rs} == {"unique", "prefix", "fork"}
        for r in rs:
            parts = r.live_share + r.internal_fragmentation + r.external_fragmentation + r.idle_free
            assert parts == pytest.approx(1.0)
            assert 0.0 < r.kv_utilization <= 1.0 and r.memory_bound_steps > 0
            if r.system.startswith("contiguous"):
                assert r.sharing_saved == 0.0 and r.preemptions == 0
        contig = next(r for r in rs if r.scenario == "unique" and r.system == "contiguous (max_model_len)")
        paged = next(r for r in rs if r.scenario == "unique" and r.system == "paged bs=16")
        assert paged.kv_utilization > contig.kv_utilization + 0.2
        assert paged.fragmentation < contig.fragmentation / 2
        assert paged.mean_concurrent_requests > 1.5 * contig.mean_concurrent_requests
        prefix = next(r for r in rs if r.scenario == "prefix" and r.system == "paged bs=16")
        no_cache = next(
            r for r in rs if r.scenario == "prefix" and r.system == "paged bs=16, no prefix cache"
        )
        assert prefix.sharing_saved > 0.2 and prefix.prefix_hit_rate > 0.3 and no_cache.sharing_saved == 0.0
        assert prefix.mean_concurrent_requests > no_cache.mean_concurrent_requests
        fork = next(r for r in rs if r.scenario == "fork" and r.system == "paged bs=16")
        assert fork.sharing_saved > 0.1
        # smaller blocks never waste more of their reservation
        utils = [
            next(r for r in rs if r.scenario == "unique" and r.system == f"paged bs={bs}").kv_utilization
            for bs in (8, 64)
        ]
        assert utils[0] > utils[1]
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["config"]["kv_bytes_per_token"] == 819_200 and len(data["results"]) == len(results)
    for wl in ("fixed", "sharegpt"):
        png = tmp_path / f"memory_{wl}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
