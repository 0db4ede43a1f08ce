"""The engine's hot-loop fast paths agree with from-scratch rebuilds (issue 17).

* decode fast path (``KVCacheManager.append_one``, block tables) and the persistent input buffers
  (:class:`~batchgen.engine.worker.input_batch.InputBatch`): at every step of random workloads that admit, finish,
  abort, preempt (recompute and swap) and fork (n > 1, beams), every scheduled block table equals the KV
  manager's table, the persistent block-table rows equal the step's tables, and the runner's inputs equal a
  straightforward per-sequence rebuild (the pre-issue-17 code, kept here as the reference);
* the persistent per-row sampling settings (:class:`~batchgen.engine.worker.sampler.SamplingBatch`) equal the rows'
  params at every step;
* padded decode buckets (the CUDA-graph input path, forced on CPU) give identical tokens.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from engine_helpers import pad_decodes_on_cpu

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.worker.model_runner import decode_buckets
from batchgen.engine.worker.sampler import SamplingBatch, SamplingTensors, _argmax
from batchgen.sampling_params import SamplingParams


def reference_inputs(out, block_size: int):
    """Flat inputs rebuilt from scratch, one sequence at a time (the engine's code before issue 17)."""
    bs = block_size
    input_ids, positions, slots = [], [], []
    for s in out.seqs:
        start, table = s.start, s.block_table
        input_ids.extend(s.seq.token_ids[s.start : s.start + s.num_tokens])
        rng = range(start, start + s.num_tokens)
        positions.extend(rng)
        slots.extend(table[p // bs] * bs + p % bs for p in rng)
    q_lens = [s.num_tokens for s in out.seqs]
    seq_lens = [s.start + s.num_tokens for s in out.seqs]
    cu = [0, *itertools.accumulate(q_lens)]
    max_blocks = max(len(s.block_table) for s in out.seqs)
    padded = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in out.seqs]
    last = [cu[b + 1] - 1 for b in out.logit_rows]
    return input_ids, positions, slots, seq_lens, cu, padded, last, max(seq_lens), max(q_lens)


def _checked_engine(ckpt: str, **cfg) -> tuple[LLMEngine, list[int]]:
    engine = LLMEngine(ckpt, EngineConfig(device="cpu", **cfg))
    runner, kv = engine.builder, engine.scheduler.kv
    inner = runner.prepare_inputs
    checked = [0, 0, 0]  # steps checked, sequences scheduled, block-table rows rewritten

    def prepare(out):
        for s in out.seqs:
            assert s.block_table == kv.block_table(s.seq.seq_id)
            assert s.start == s.seq.num_computed_tokens
            assert kv.num_tokens(s.seq.seq_id) >= s.start + s.num_tokens
        fwd = inner(out)
        ids, pos, meta, last = fwd.ids, fwd.positions, fwd.meta, fwd.last
        runner.input_batch.check(out)  # persistent block-table rows == this step's tables
        ref = reference_inputs(out, runner.input_batch.block_size)
        assert ids.tolist() == ref[0]
        assert pos.tolist() == ref[1]
        assert meta.slot_mapping.tolist() == ref[2]
        assert meta.seq_lens.tolist() == ref[3]
        assert meta.cu_seqlens_q.tolist() == ref[4]
        assert meta.block_tables.tolist() == ref[5]
        assert last.tolist() == ref[6]
        assert (meta.max_seq_len, meta.max_query_len) == ref[7:]
        assert meta.num_decode_seqs == sum(1 for s in out.seqs if s.num_tokens == 1)
        assert all(s.num_tokens == 1 for s in out.seqs[: meta.num_decode_seqs])
        checked[0] += 1
        checked[1] += len(out.seqs)
        checked[2] += runner.input_batch.rows_written
        return fwd

    runner.prepare_inputs = prepare
    batch = engine.builder.sampling_batch
    inner_gather = batch.gather

    def gather(seq_ids, params):
        got = inner_gather(seq_ids, params)
        want = SamplingTensors.from_params(params)
        for f in ("temperature", "top_k", "top_p", "min_p"):
            assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
        assert set(batch.row_of) == set(seq_ids)
        assert not set(batch.row_of.values()) & set(batch.free_rows)
        return got

    batch.gather = gather
    return engine, checked


preemptions: list[int] = []


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_state_matches_rebuild(llama_ckpt: str, mode: str, seed: int) -> None:
    rng = random.Random(seed)
    engine, checked = _checked_engine(
        llama_ckpt,
        num_blocks=12,
        block_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        preemption_mode=mode,
        num_swap_blocks=16,
    )
    vocab = engine.model.config.vocab_size
    next_id = 0
    for _ in range(70):
        if rng.random() < 0.5 and engine.num_unfinished() < 10:  # admit
            n = rng.choice([1, 1, 1, 2, 3])
            beam = n == 1 and rng.random() < 0.15
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.0, 0.8]) if not beam else 0.0,
                top_k=rng.choice([0, 5]),
                top_p=rng.choice([1.0, 0.9]),
                max_tokens=rng.randint(1, 40),
                n=n if not beam else 1,
                beam_width=2 if beam else 1,
                ignore_eos=rng.random() < 0.5,
                seed=rng.choice([None, 7]),
            )
            shared = [5, 6, 7, 8, 9, 10, 11, 12] if rng.random() < 0.5 else []
            prompt = shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
            engine.add_request(next_id, prompt, params)
            next_id += 1
        if rng.random() < 0.05 and engine.requests:  # abort one mid-batch
            engine.abort_request(rng.choice(list(engine.requests)))
        if engine.has_unfinished():
            engine.step()
        engine.scheduler.kv.pool.check_invariants()
    while engine.has_unfinished():
        engine.step()
    assert checked[0] > 20
    assert checked[2] < checked[1]  # the persistent rows were reused, not rebuilt every step
    preemptions.append(engine.stats.num_preemptions)
    kv = engine.scheduler.kv
    assert len(kv) == 0
    kv.pool.check_invariants()


def test_random_workloads_preempted() -> None:
    """The random workloads above did exercise preemption (run after them, in file order)."""
    if not preemptions:
        pytest.skip("the random-workload tests did not run")
    assert sum(preemptions) > 0


def test_decode_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(256)[-2:] == [240, 256]


def _generate(ckpt: str, prompts, params, padded: bool, monkeypatch: pytest.MonkeyPatch, **cfg):
    pad_decodes_on_cpu(monkeypatch, padded)
    engine = LLMEngine(ckpt, EngineConfig(device="cpu", **cfg))
    assert engine.runner.pad_decodes is padded
    for i, p in enumerate(prompts):
        engine.add_request(i, p, params)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = [c.token_ids for c in o.outputs]
    return outs, engine


def test_padded_decode_buckets_give_identical_tokens(
    llama_ckpt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randint(3, 30))] for _ in range(11)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cfg = dict(max_num_seqs=11, num_blocks=64)
    eager, _ = _generate(llama_ckpt, prompts, params, False, monkeypatch, **cfg)
    padded, engine = _generate(llama_ckpt, prompts, params, True, monkeypatch, **cfg)
    assert padded == eager
    assert engine.runner.scratch_block == 64
    assert engine.runner.kv_cache.shape[2] == 65


def test_enforce_eager_config() -> None:
    assert EngineConfig().enforce_eager is False


def test_numpy_argmax_matches_torch() -> None:
    x = torch.randn(37, 501)
    x[3, 10] = x[3, 20] = 1e9  # tie: the first index wins
    x[5, 7] = float("nan")
    assert torch.equal(_argmax(x), x.argmax(dim=-1))


def test_sampling_batch_matches_params_under_random_admit_finish() -> None:
    """Persistent per-row sampling settings equal the rows' params after every gather (rows reused, grown)."""
    rng = random.Random(0)
    batch = SamplingBatch(capacity=2)
    params: dict[int, SamplingParams] = {}
    next_id = 0
    for _ in range(300):
        for _ in range(rng.randint(0, 3)):  # admit
            params[next_id] = SamplingParams(
                temperature=rng.choice([0.0, 0.7, 1.3]),
                top_k=rng.choice([0, 3, 50]),
                top_p=rng.choice([1.0, 0.8]),
                min_p=rng.choice([0.0, 0.1]),
            )
            next_id += 1
        for sid in rng.sample(sorted(params), k=min(len(params), rng.randint(0, 2))):  # finish / abort
            del params[sid]
        step = [sid for sid in params if rng.random() < 0.8]  # the rest skip this step (or are preempted)
        rng.shuffle(step)
        got = batch.gather(step, [params[s] for s in step])
        want = SamplingTensors.from_params([params[s] for s in step])
        for f in ("temperature", "top_k", "top_p", "min_p"):
            assert getattr(got, f).tolist() == getattr(want, f).tolist()
        assert sorted(batch.row_of) == sorted(step)
        assert len(set(batch.row_of.values())) == len(step)
    assert len(batch.arrays) > 2  # it grew


def test_prepare_inputs_outside_inference_mode(llama_ckpt: str) -> None:
    """The persistent buffers are plain tensors: a step can be prepared again outside ``inference_mode``
    (benchmarks and tools call ``prepare_inputs`` directly), and on the CPU the step's tensors are views of
    the buffers (no copy)."""
    engine = LLMEngine(llama_ckpt, EngineConfig(device="cpu", num_blocks=32, max_num_seqs=4))
    for i in range(3):
        engine.add_request(i, [5 + i, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outs = []
    inner = engine.builder.prepare_inputs
    engine.builder.prepare_inputs = lambda out: outs.append(out) or inner(out)
    engine.step()
    engine.step()
    ids = engine.builder.prepare_inputs(outs[-1]).ids
    assert ids.tolist() == reference_inputs(outs[-1], engine.runner.block_size)[0]
    assert ids.untyped_storage().data_ptr() in {
        b.host["ids"].untyped_storage().data_ptr() for b in engine.builder.input_batch._sets
    }
