"""The dry run on quantized checkpoints and narrow KV caches: the plan's KV figures (bytes per token, the pool,
rows the pool refuses) and weight bytes are the engine's own, and a refused setting is refused at planning as
the job refuses it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config
from quant_helpers import write_compressed_tensors, write_gguf

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.errors import ConfigError
from batchgen.job.run import run_job

Q4_0, Q8_0 = 2, 8


@pytest.fixture(scope="module")
def q8_gguf(tiny_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_gguf(tiny_ckpt, tmp_path_factory.mktemp("gguf") / "q8.gguf", Q8_0))


def _plan(model: dict, tmp_path: Path, **engine) -> dict:
    """The uncalibrated plan (no engine started) of 12 short rows with ``model`` options and ``engine`` ones."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"Question {i}: what is {i} plus {i}?" for i in range(12)]}), inp)
    out = tmp_path / "out"
    cfg = job_config(model.pop("path"), inp, out, engine={"num_blocks": None, **engine})
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.run.dry_run, cfg.plan.calibrate = True, False
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == 0
    return json.loads((out / "_plan.json").read_text())


def _assert_pool_is_the_engines(plan: dict, engine: LLMEngine, kv_dtype: str) -> None:
    st, mem = engine.stats, plan["memory"]
    assert mem["kv_cache_dtype"] == kv_dtype
    assert mem["kv_bytes_per_token"] == st.bytes_per_block // st.block_size
    assert mem["kv_pool_tokens"] == st.num_blocks * st.block_size


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e5m2"])
def test_a_gguf_plan_sizes_its_pool_and_weights_as_the_engine(
    q8_gguf: Path, tmp_path: Path, kv_dtype: str
) -> None:
    # the KV shape comes from the file's own config (no config.json beside it); the weights as the loader holds
    # them: packed Q8_0 projections, the token embedding widened to float32
    engine = LLMEngine(
        str(q8_gguf), EngineConfig(device="cpu", kv_cache_memory="128KiB", kv_cache_dtype=kv_dtype)
    )
    from batchgen.job.dry_run import _weights_bytes

    loaded = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert _weights_bytes(str(q8_gguf)) == _weights_bytes(str(q8_gguf), engine=engine) == loaded
    by_path = _plan({"path": str(q8_gguf)}, tmp_path / "a", kv_cache_memory="128KiB", kv_cache_dtype=kv_dtype)
    _assert_pool_is_the_engines(by_path, engine, kv_dtype)
    assert by_path["memory"]["weights_bytes"] == loaded and by_path["memory"]["sequences_that_fit"] >= 1
    by_file = _plan({"path": str(q8_gguf.parent), "gguf_file": q8_gguf.name}, tmp_path / "b",
                    kv_cache_memory="128KiB", kv_cache_dtype=kv_dtype)  # fmt: skip
    assert by_file["memory"] == by_path["memory"]


def test_rows_a_gguf_models_pool_cannot_hold_are_planned_as_error_rows(q8_gguf: Path, tmp_path: Path) -> None:
    # a pool of one block of 16 tokens (2 KiB a token in float32): every row's prompt plus max_tokens needs two,
    # so the job would refuse every row (exit status 2)
    plan = _plan({"path": str(q8_gguf)}, tmp_path, kv_cache_memory="32KiB")
    assert plan["memory"]["kv_pool_tokens"] == 16
    assert plan["rows"]["valid"] == 0 and plan["rows"]["error"] == 12
    assert "pool holds" in next(iter(plan["errors"]))


def test_a_compressed_tensors_plan_with_a_narrow_cache_is_the_engines(tiny_ckpt: str, tmp_path: Path) -> None:
    w4 = write_compressed_tensors(tiny_ckpt, tmp_path / "w4a16", bits=4, group_size=32)
    engine = LLMEngine(w4, EngineConfig(device="cpu", kv_cache_memory="64KiB", kv_cache_dtype="fp8"))
    plan = _plan({"path": w4}, tmp_path, kv_cache_memory="64KiB", kv_cache_dtype="fp8")
    _assert_pool_is_the_engines(plan, engine, "fp8")
    from batchgen.job.dry_run import _weights_bytes

    stored = sum(p.stat().st_size for p in Path(w4).glob("*.safetensors"))
    assert plan["memory"]["weights_bytes"] == stored  # the packed int4 weights as stored, not dense float32
    loaded = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert _weights_bytes(w4, engine=engine) == loaded  # a started engine's: as it holds them


def test_a_gguf_file_with_another_dtype_is_refused_at_planning(q8_gguf: Path, tmp_path: Path) -> None:
    # the loader computes a GGUF model in float32 only: a dry run that starts no engine refuses it as the job
    # does, in one line with exit status 2, writing nothing
    pq.write_table(pa.table({"prompt": ["a question"]}), tmp_path / "in.parquet")
    for dry_run in (True, False):
        cfg = job_config(str(q8_gguf), tmp_path / "in.parquet", tmp_path / "out")
        cfg.model.dtype, cfg.run.dry_run, cfg.plan.calibrate = "bfloat16", dry_run, False
        res = run_job(cfg, handle_signals=False, print_summary=False)
        assert res.exit_code == 2 and not (tmp_path / "out").exists()
        assert "a GGUF checkpoint computes in float32: use dtype auto, not bfloat16" in res.message
        assert "\n" not in res.message


def test_the_cpu_memory_check_sizes_num_blocks_in_the_caches_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # engine.num_blocks of an fp8 cache takes a quarter of a float32 one's bytes; a bfloat16 model's auto cache
    # is float32 on the CPU, where it computes in float32
    import torch

    from batchgen.job import plan
    from batchgen.models.checkpoint_facts import CheckpointFacts

    facts = CheckpointFacts("LlamaForCausalLM", "native", 256, 4, 2, 16, torch.bfloat16)
    per_block_f32 = 2 * 4 * 16 * 2 * 16 * 4
    monkeypatch.setattr(plan, "_physical_memory", lambda: 1000 * per_block_f32)

    def check(num_blocks: int, kv_dtype: str) -> None:
        plan._check_kv_memory(plan.KVRequest("cpu", "1GiB", num_blocks, 16, "auto", kv_dtype), facts)

    check(4000, "fp8")  # 4000 one-byte blocks fit in the memory of 1000 float32 ones
    with pytest.raises(ConfigError, match="engine.num_blocks=1001"):
        check(1001, "auto")
