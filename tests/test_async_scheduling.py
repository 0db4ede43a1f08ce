"""Async scheduling (``engine.async_scheduling``, :mod:`batchgen.engine.worker.executor`): outputs identical to
synchronous stepping, the async path really taken (``EngineStats.async_steps``), drains where the scope
says, deferred frees and prefix-cache hashing, and a consistent KV manager under random admit/finish/abort.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import job_config
from engine_helpers import hf_greedy, pad_decodes_on_cpu
from test_hotloop import _checked_engine

from batchgen import LLM, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.async_engine import AsyncLLMEngine
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.kv.kv_cache import hash_block_tokens
from batchgen.engine.sched.async_scheduler import PLACEHOLDER, AsyncScheduler
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.worker.executor import Executor
from batchgen.job.run import EXIT_OK, run_job

BS = 8


def prompts_of(lengths: list[int], seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(5, 4096) for _ in range(shared)]
    return [head + [rng.randrange(5, 4096) for _ in range(n)] for n in lengths]


def generate(ckpt: str, prompts, params, **engine) -> tuple[list[tuple], LLMEngine]:
    """Every output field that must not depend on async scheduling, per request and sample."""
    llm = LLM(ckpt, device="cpu", block_size=BS, **engine)
    guard_placeholders(llm.engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    fields = [
        [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
        for o in outs
    ]
    return fields, llm.engine


def guard_placeholders(engine: LLMEngine) -> None:
    """Fail if a placeholder is ever fed to the model or hashed into the prefix cache, or a hash is wrong."""

    def check_ids(_module, args):
        assert int(args[0].min()) >= 0, "a placeholder token reached the model"

    engine.runner.model.register_forward_pre_hook(check_ids)
    pool = engine.scheduler.kv.pool
    inner = pool.cache_block

    def cache_block(block, h, parent, toks):
        assert PLACEHOLDER not in list(toks), "a placeholder was hashed into the prefix cache"
        assert h == hash_block_tokens(parent, toks)
        return inner(block, h, parent, toks)

    pool.cache_block = cache_block


def both(ckpt: str, prompts, params, **engine) -> tuple[list[tuple], LLMEngine]:
    """Outputs with async scheduling off and on (asserted equal); returns them and the async engine. The
    synchronous engine carries none of async scheduling: its subclasses are the async engine's alone."""
    sync, sync_eng = generate(ckpt, prompts, params, **engine)
    assert (type(sync_eng), type(sync_eng.scheduler), type(sync_eng.executor)) == (
        LLMEngine,
        Scheduler,
        Executor,
    )
    over, eng = generate(ckpt, prompts, params, async_scheduling=True, **engine)
    assert isinstance(eng, AsyncLLMEngine) and isinstance(eng.scheduler, AsyncScheduler)
    assert_same(over, sync)
    return over, eng


def assert_same(got: list, want: list) -> None:
    """Equal outputs: token ids, texts, finish and stop reasons exactly; logprobs to float32 rounding (the
    batch of a step differs by the rows of just-finished sequences, and the matmuls' summation order with
    the batch size, as it does in synchronous stepping whenever the batch changes)."""
    assert [[c[:5] for c in o] for o in got] == [[c[:5] for c in o] for o in want]
    for o, w in zip(got, want):
        for c, d in zip(o, w):
            if d[5] is None:
                assert c[5] is None
                continue
            assert [list(x) for x in c[5]] == [list(x) for x in d[5]]  # the same top tokens
            for x, y in zip(c[5], d[5]):
                assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)


def test_greedy_identity_mixed_lengths_stops_prefix_and_chunks(llama_ckpt: str) -> None:
    prompts = prompts_of([1, 7, 8, 9, 29, 3, 17, 40], seed=1, shared=16)
    rng = random.Random(2)
    params = []
    for i in range(len(prompts)):
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=rng.randint(1, 30),
                ignore_eos=i % 2 == 0,
                stop_token_ids=[rng.randrange(5, 4096) for _ in range(200)] if i % 3 == 0 else None,
            )
        )
    outs, eng = both(llama_ckpt, prompts, params, num_blocks=96, max_num_batched_tokens=24, max_num_seqs=8)
    st = eng.stats
    assert st.async_steps > 0 and st.async_steps + st.drained_steps == st.num_steps
    assert st.prompt_tokens_cached > 0  # shared prompts hit the prefix cache
    assert any(o[0][3] == "stop" for o in outs) and any(o[0][3] == "length" for o in outs)
    # ignore_eos requests run to max_tokens: the transformers reference
    ref = [prompts[i] for i in range(0, len(prompts), 2)]
    for o, want in zip(outs[::2], hf_greedy(llama_ckpt, ref, 30)):
        assert o[0][1] == want[: len(o[0][1])]


def test_stop_strings_and_logprobs_identity(llama_ckpt: str) -> None:
    prompts = prompts_of([5, 12, 20, 3], seed=3)
    free, _ = generate(llama_ckpt, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    params = []
    for i, o in enumerate(free):
        text = o[0][2]
        stop = text[len(text) // 2 : len(text) // 2 + 2] if i % 2 == 0 else "\x00never"
        params.append(
            SamplingParams(
                temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=2, min_tokens=2
            )
        )
    outs, eng = both(llama_ckpt, prompts, params, num_blocks=64)
    assert eng.stats.async_steps > 0
    assert any(o[0][3] == "stop" for o in outs)


@pytest.mark.parametrize("n", [1, 3])
def test_seeded_sampling_identity(llama_ckpt: str, n: int) -> None:
    prompts = prompts_of([4, 11, 19, 26, 2], seed=4)
    params = [
        SamplingParams(
            temperature=0.9,
            top_k=50,
            top_p=0.95,
            seed=100 + i,
            n=n,
            max_tokens=5 + 3 * i,
            repetition_penalty=1.2 if i % 2 else 1.0,
            presence_penalty=0.5 if i == 3 else 0.0,
        )
        for i in range(len(prompts))
    ]
    _, eng = both(llama_ckpt, prompts, params, num_blocks=128, max_num_seqs=16)
    assert eng.stats.async_steps > 0


def test_small_pool_preempts_and_drains(llama_ckpt: str) -> None:
    prompts = prompts_of([20, 25, 30, 18, 22, 27], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _, eng = both(llama_ckpt, prompts, params, num_blocks=16, max_num_seqs=6)
    st = eng.stats
    assert st.num_preemptions > 0 and st.drained_steps > 1 and st.async_steps > 0
    assert len(eng.scheduler.kv) == 0


def test_beams_in_the_batch_drain(llama_ckpt: str) -> None:
    prompts = prompts_of([6, 9, 13], seed=6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, beam_width=3, n=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    _, eng = both(llama_ckpt, prompts, params, num_blocks=64)
    assert eng.stats.drained_steps > 0
    assert not eng._sync_ids


def test_prompt_logprobs_drain(llama_ckpt: str) -> None:
    prompts = prompts_of([6, 9], seed=7)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=6),
    ]
    sync, _ = generate(llama_ckpt, prompts, params, num_blocks=64)
    llm = LLM(llama_ckpt, device="cpu", block_size=BS, num_blocks=64, async_scheduling=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(llama_ckpt, device="cpu", block_size=BS, num_blocks=64).generate(
        prompts, params, use_tqdm=False
    )
    assert [o.prompt_logprobs for o in outs] == [o.prompt_logprobs for o in ref]
    assert [o.outputs[0].token_ids for o in outs] == [s[0][1] for s in sync]
    st = llm.engine.stats
    assert st.async_steps < st.num_steps == st.async_steps + st.drained_steps


def test_structured_outputs_drain(llama_ckpt: str) -> None:
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (batchgen[structured])")
    prompts = prompts_of([6, 9], seed=8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, choice=["yes", "no"]),
        SamplingParams(temperature=0.0, max_tokens=6),
    ]
    _, eng = both(llama_ckpt, prompts, params, num_blocks=64)
    assert eng.stats.drained_steps > 0


def test_finished_sequence_keeps_its_blocks_until_the_next_forward(llama_ckpt: str) -> None:
    """A request stopped by a token at step N was scheduled in N+1 too: its blocks stay allocated while N+1
    is in flight and are freed when N+1 is collected; nothing of N+1 reaches its output."""
    prompt = prompts_of([10], seed=10)[0]
    free, _ = generate(llama_ckpt, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    toks = free[0][0][1]
    k = next(i for i in range(2, 8) if toks[i] not in toks[:i])
    engine = LLMEngine(
        llama_ckpt, EngineConfig(device="cpu", num_blocks=32, block_size=BS, async_scheduling=True)
    )
    engine.add_request(
        "a", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[toks[k]])
    )
    engine.add_request("b", prompt[:5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seq = engine.requests["a"].seqs[0]
    kv = engine.scheduler.kv
    while True:
        done = engine.step()
        if any(o.request_id == "a" for o in done):
            break
    out = next(o for o in done if o.request_id == "a").outputs[0]
    assert out.token_ids == toks[: k + 1] and out.finish_reason == "stop"
    assert engine._flights and seq.seq_id in kv  # N+1 in flight still writes its blocks
    engine.step()
    assert seq.seq_id not in kv
    while engine.has_unfinished():
        engine.step()
    assert len(kv) == 0


def test_length_finishing_sequence_is_not_scheduled_again(llama_ckpt: str) -> None:
    engine = LLMEngine(
        llama_ckpt, EngineConfig(device="cpu", num_blocks=32, block_size=BS, async_scheduling=True)
    )
    engine.add_request(0, [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seq = engine.requests[0].seqs[0]
    positions: list[int] = []
    inner = engine.builder.prepare_inputs

    def prepare(out):
        assert not any(engine.scheduler.is_finishing(s.seq) for s in out.seqs)
        positions.extend(s.start for s in out.seqs if s.seq is seq)
        return inner(out)

    engine.builder.prepare_inputs = prepare
    while engine.has_unfinished():
        engine.step()
    # prefill (token 1), decodes of tokens 1 and 2 planned ahead; no step is planned for token 3, the last
    assert positions == [0, 3, 4]
    assert (engine.stats.num_steps, engine.stats.async_steps) == (3, 2)


@pytest.mark.parametrize("seed", [11, 12])
def test_random_admit_finish_abort_keeps_the_kv_manager_consistent(llama_ckpt: str, seed: int) -> None:
    rng = random.Random(seed)
    engine, checked = _checked_engine(
        llama_ckpt,
        num_blocks=24,
        block_size=BS,
        max_num_seqs=6,
        max_num_batched_tokens=40,
        async_scheduling=True,
    )
    guard_placeholders(engine)
    kv = engine.scheduler.kv
    next_id = 0
    for _ in range(90):
        if rng.random() < 0.5 and engine.num_unfinished() < 10:
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.choice([None, 3]),
                max_tokens=rng.randint(1, 30),
                n=rng.choice([1, 1, 2]),
                ignore_eos=rng.random() < 0.5,
                stop_token_ids=[rng.randrange(5, 4096) for _ in range(100)] if rng.random() < 0.3 else None,
            )
            shared = [5, 6, 7, 8, 9, 10, 11, 12] if rng.random() < 0.5 else []
            engine.add_request(
                next_id, shared + [rng.randrange(5, 4096) for _ in range(rng.randint(1, 20))], params
            )
            next_id += 1
        if rng.random() < 0.08 and engine.requests:
            engine.abort_request(rng.choice(list(engine.requests)))
        if engine.has_unfinished():
            engine.step()
        kv.pool.check_invariants()
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.async_steps > 10 and checked[0] > 20
    assert len(kv) == 0 and not engine.scheduler._deferred_free and not engine.scheduler._ahead
    assert not any(kv.pool.ref_counts)
    kv.pool.check_invariants()


def test_job_output_identical(llama_ckpt: str, tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "prompt": f"row {i} says " + "word " * (i % 7)} for i in range(20)]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    tables = []
    for on in (False, True):
        out = tmp_path / f"out-{on}"
        cfg = job_config(llama_ckpt, inp, out, engine={"async_scheduling": on})
        assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
        parts = sorted(out.glob("part-*.parquet"))
        tables.append(pa.concat_tables([pq.read_table(p) for p in parts]).to_pylist())
    assert tables[0] == tables[1] and len(tables[0]) == 20


@pytest.fixture
def async_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine built meanwhile (one device) runs with async scheduling on."""
    inner = EngineConfig.__post_init__

    def post_init(self: EngineConfig) -> None:
        if self.tensor_parallel_size == 1:
            self.async_scheduling = True
        inner(self)

    monkeypatch.setattr(EngineConfig, "__post_init__", post_init)


@pytest.mark.parametrize(
    "name",
    [
        "test_batched_shuffled_with_preemption_matches_unbatched",
        "test_prefix_cache_hits_and_same_tokens",
        "test_chunked_prefill_gives_identical_output",
        "test_seeded_sampling_is_independent_of_batch",
        "test_n_forks_share_prompt_blocks_and_free_everything",
        "test_stop_conditions",
        "test_requests_that_cannot_run_fail_alone",
        "test_max_model_len_finishes_with_length",
    ],
)
def test_engine_equality_tests_pass_with_async_forced(async_forced: None, llama_ckpt: str, name: str) -> None:
    """The engine's equality tests (against transformers and unbatched runs), unchanged, with async on."""
    import test_engine

    assert EngineConfig().async_scheduling
    getattr(test_engine, name)(llama_ckpt)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hotloop_random_workloads_with_async_forced(async_forced: None, llama_ckpt: str, mode: str) -> None:
    """issue 17's incremental-state property test (admit, finish, abort, preempt, swap, fork, beams) with
    async on: the persistent inputs still equal a rebuild at every step, and every block comes back."""
    import test_hotloop

    test_hotloop.test_incremental_state_matches_rebuild(llama_ckpt, mode, 0)


def test_abort_while_in_flight_and_last_step_cancelled(llama_ckpt: str) -> None:
    """An aborted request's blocks outlive the step in flight; a planned step whose every sequence finished
    meanwhile (here: the last request, stopped by a token) is cancelled, not run."""
    prompt = prompts_of([12], seed=12)[0]
    free, _ = generate(llama_ckpt, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    toks = free[0][0][1]
    k = next(i for i in range(2, 8) if toks[i] not in toks[:i])
    cfg = EngineConfig(device="cpu", num_blocks=32, block_size=BS, async_scheduling=True)
    engine = LLMEngine(llama_ckpt, cfg)
    engine.add_request("stop", prompt, SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[toks[k]]))
    engine.add_request("gone", prompt[:7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    kv = engine.scheduler.kv
    engine.step()
    engine.step()
    gone = engine.requests["gone"].seqs[0]
    assert engine._flights and gone.seq_id in {s.seq.seq_id for s in engine._flights[0].out.seqs}
    engine.abort_request("gone")
    assert gone.seq_id in kv  # the step in flight still writes its blocks
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        assert gone.seq_id not in kv
    assert [o.request_id for o in outs] == ["stop"] and outs[0].outputs[0].token_ids == toks[: k + 1]
    st = engine.stats
    assert len(kv) == 0 and st.num_steps == st.async_steps + st.drained_steps == k + 1


def test_padded_decode_buckets_with_async(llama_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-graph input path (decode batches padded to buckets; forced on CPU): placeholders are filled
    before padding, outputs unchanged."""
    pad_decodes_on_cpu(monkeypatch)
    prompts = prompts_of([3, 9, 14, 20, 5], seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, eng = both(llama_ckpt, prompts, params, num_blocks=64, max_num_seqs=5)
    assert eng.runner.pad_decodes and eng.stats.async_steps > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches_identical(llama_ckpt: str, seed: int) -> None:
    """Random batches (shared prefixes, greedy and seeded rows, n > 1, stop ids, min_tokens, penalties,
    logprobs, chunked prefill, a pool that sometimes preempts) give the same outputs with async on."""
    rng = random.Random(100 + seed)
    prompts = prompts_of([rng.randint(1, 40) for _ in range(14)], seed=seed, shared=rng.choice([0, 8, 12]))
    params = []
    for _ in prompts:
        greedy = rng.random() < 0.5
        params.append(
            SamplingParams(
                temperature=0.0 if greedy else 0.8,
                seed=None if greedy else rng.randrange(1000),
                top_k=rng.choice([0, 20]),
                n=rng.choice([1, 1, 2, 3]),
                max_tokens=rng.randint(2, 25),
                min_tokens=rng.choice([0, 0, 2]),
                ignore_eos=rng.random() < 0.3,
                stop_token_ids=[rng.randrange(5, 4096) for _ in range(150)] if rng.random() < 0.4 else None,
                repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
                logprobs=rng.choice([None, None, 1]),
            )
        )
    cfg = dict(
        num_blocks=rng.choice([24, 40, 128]), max_num_seqs=rng.choice([4, 8, 16]), max_num_batched_tokens=32
    )
    _, eng = both(llama_ckpt, prompts, params, **cfg)
    assert eng.stats.async_steps > 0 and len(eng.scheduler.kv) == 0
