"""Request-group kinds through the scheduler's one update path, with no model: ``schedule()`` gives a
``SchedulerOutput`` (each group's claim on the step declared in it), a fake ``RunnerOutput`` is handed to
``Scheduler.update``, and each kind absorbs its slice."""

from __future__ import annotations

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.output_processor import OutputProcessor
from batchgen.engine.features.beam import BeamGroup, BeamSearch
from batchgen.engine.features.pooling import PoolingGroup, PoolingState, PoolRows
from batchgen.engine.features.prompt_logprobs import PromptLogprobs, PromptLogprobsAddOn, PromptRows
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.kinds import make_group
from batchgen.engine.sched.output import GroupStep, SchedulerOutput
from batchgen.engine.sched.request_group import (
    Absorbed,
    AddOn,
    Entry,
    RequestGroup,
    SampleGroup,
    UpdateContext,
)
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.sched.sequence import Request
from batchgen.engine.sched.stop import StopRules
from batchgen.engine.worker.step_input import RunnerOutput
from batchgen.sampling_params import SamplingParams

BS = 4
EOS = 99
V = 100


def scheduler(num_blocks: int = 64, max_model_len: int = 64, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(EngineConfig(block_size=8, **config), kv, StopRules.build([EOS], max_model_len))


def add(
    sched: Scheduler,
    rid: str,
    prompt: list[int],
    params: SamplingParams | None = None,
    pooling: PoolingState | None = None,
    **request,
):
    req = Request(rid, prompt, params or SamplingParams(temperature=0.0, max_tokens=8))
    for key, value in request.items():
        setattr(req, key, value)
    group = make_group(req, req.new_sequence(list(prompt), 0), sched.stop, pooling)
    sched.add(group)
    return req, group


def tokens(out: SchedulerOutput, *ids: int) -> RunnerOutput:
    return RunnerOutput(list(ids), [None] * len(ids))


def test_kinds_are_chosen_per_request() -> None:
    sched = scheduler()
    assert type(add(sched, "a", [1, 2])[1]) is RequestGroup
    assert type(add(sched, "b", [1, 2], SamplingParams(n=2))[1]) is SampleGroup
    assert type(add(sched, "c", [1, 2], SamplingParams(n=2, beam_width=2))[1]) is BeamGroup
    assert type(add(sched, "d", [1, 2], pooling=PoolingState("last"))[1]) is PoolingGroup


def test_n2_forks_at_the_prompt_and_finishes_when_both_samples_stop() -> None:
    sched = scheduler()
    req, group = add(sched, "r", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, temperature=0.0, max_tokens=5))
    out = sched.schedule()
    # one forward row; both samples draw from it, each in a group of its own
    assert len(out.seqs) == 1 and out.sample_rows == [0, 0]
    assert [type(g) for g, _ in out.parts] == [SampleGroup, RequestGroup]
    assert [[(s.sample_index, i) for s, i in step.samples] for _, step in out.parts] == [[(0, 0)], [(1, 1)]]
    assert sched.update(out, tokens(out, 7, 8)) == []
    assert [s.output_token_ids for s in req.seqs] == [[7], [8]]
    out = sched.schedule()
    assert out.num_decodes == 2 and len(out.parts) == 2
    assert sched.update(out, tokens(out, EOS, 11)) == []  # sample 0 stops on eos, sample 1 runs on
    assert req.seqs[0].finish_reason == "stop" and req.num_finished == 1 and len(sched.running) == 1
    out = sched.schedule()
    assert sched.update(out, tokens(out, EOS)) == [req]
    assert not sched.running and sched.kv.stats().blocks_used == 0
    assert sched.stats.generated_tokens == 5


def test_length_stops_a_sample_in_the_update() -> None:
    sched = scheduler()
    req, _ = add(sched, "r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    out = sched.schedule()
    assert sched.update(out, tokens(out, 5)) == []
    out = sched.schedule()
    assert sched.update(out, tokens(out, 6)) == [req] and req.seqs[0].finish_reason == "length"


def _scores(rows: int, best: list[int]) -> torch.Tensor:
    """Log-softmax rows whose best tokens are ``best`` (in order), for a fake beam step."""
    logits = torch.full((rows, V), -10.0)
    for r in range(rows):
        for rank, t in enumerate(best):
            logits[r, t] = 5.0 - rank - r * 0.5
    return torch.log_softmax(logits, dim=-1)


def test_beam_group_scores_rows_and_finishes_with_the_search() -> None:
    sched = scheduler()
    params = SamplingParams(n=2, beam_width=2, max_tokens=3, ignore_eos=True)
    req, group = add(sched, "b", [1, 2, 3, 4, 5], params)
    out = sched.schedule()
    assert out.sample_rows == [] and out.score_rows == [0]
    (part,) = out.parts
    assert part[0] is group and part[1].scores == (0, 1)
    assert sched.update(out, RunnerOutput(scores=_scores(1, [10, 20]))) == []
    assert sorted(s.output_token_ids for s in group.seqs) == [[10], [20]]
    finished = []
    for _ in range(5):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert len(out.score_rows) == 2 and out.num_decodes == 2
        finished += sched.update(out, RunnerOutput(scores=_scores(2, [30, 40])))
    assert finished == [req] and req.is_finished and not sched.running
    assert [len(h.token_ids) for h in req.ranked.results()] == [3, 3]
    assert sched.kv.stats().blocks_used == 0


def test_beam_stop_tokens_and_length_come_from_the_stop_rules() -> None:
    stop = StopRules.build([EOS, 98], max_model_len=20)
    params = SamplingParams(beam_width=2, max_tokens=50, stop_token_ids=[7])
    search = BeamSearch.build(params, 6, stop)
    assert search.stop_ids == stop.stop_token_ids(params) == [7, 98, EOS]
    assert search.max_len == stop.length_limit(params, 6) == 20
    quiet = SamplingParams(beam_width=2, max_tokens=5, ignore_eos=True)
    assert BeamSearch.build(quiet, 6, stop).stop_ids == [] and stop.length_limit(quiet, 6) == 11


def test_pooling_group_pools_its_chunks_and_finishes_at_its_prompt() -> None:
    sched = scheduler(max_num_batched_tokens=4)
    state = PoolingState("mean")
    req, group = add(sched, "p", list(range(1, 11)), SamplingParams(), pooling=state)
    sums = []
    finished = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.sample_rows == [] and out.score_rows == []
        rows = out.reads[PoolRows]
        assert list(out.reads) == [PoolRows] and rows.ops == ["sum"]
        seg = rows.ends[0] - rows.starts[0]
        sums.append(torch.full((1, 3), float(len(sums) + 1)) * seg)
        finished += sched.update(out, RunnerOutput(reads={PoolRows: sums[-1]}))
    # chunks of 4, 4, 2 tokens valued 1, 2, 3: the mean over the 10 tokens
    assert finished == [req] and req.seqs[0].finish_reason == "stop"
    torch.testing.assert_close(state.vector, torch.full((3,), (4 * 1 + 4 * 2 + 2 * 3) / 10))
    assert sched.kv.stats().blocks_used == 0


def test_prompt_logprobs_are_an_add_on_of_the_sampling_kind() -> None:
    sched = scheduler(max_num_batched_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    addon = PromptLogprobsAddOn(top_k=0)
    req, group = add(sched, "r", [5, 6, 7, 8, 9], params, addons=[addon])
    finished = []
    while sched.has_unfinished():
        out = sched.schedule()
        rows = out.reads[PromptRows]
        result = PromptLogprobs([-float(t) for t in rows.targets], [], [])
        finished += sched.update(
            out,
            RunnerOutput(
                [1] * len(out.sample_seqs), [None] * len(out.sample_seqs), reads={PromptRows: result}
            ),
        )
    assert finished == [req]
    assert addon.entries == [None, {6: -6.0}, {7: -7.0}, {8: -8.0}, {9: -9.0}]


class _EchoGroup(RequestGroup):
    """A kind of the test's own: it scores its last row once and finishes with the best token. The scheduler
    runs it through the same hooks as every other kind."""

    def plan_outputs(self, entries: list[Entry], out: SchedulerOutput, kv: KVCacheManager):
        rows = [row for row, s, _ in entries if s.completes]
        if rows:
            out.parts.append((self, GroupStep(scores=out.score(rows))))
        return []

    def absorb(self, step: GroupStep, output: RunnerOutput, ctx: UpdateContext) -> Absorbed:
        assert step.scores is not None and output.scores is not None
        seq = self.seqs[0]
        token = int(output.scores[step.scores[0]].argmax())
        ctx.place(seq, token, -1)
        seq.finish_reason = "stop"
        done = Absorbed(num_tokens=1)
        self.leave(seq, done)
        return done


def test_a_new_kind_needs_no_scheduler_change() -> None:
    sched = scheduler()
    req = Request("e", [1, 2, 3], SamplingParams())
    sched.add(_EchoGroup(req, req.new_sequence([1, 2, 3], 0)))
    out = sched.schedule()
    assert out.score_rows == [0] and out.sample_rows == []
    assert sched.update(out, RunnerOutput(scores=_scores(1, [42]))) == [req]
    assert req.seqs[0].output_token_ids == [42] and sched.kv.stats().blocks_used == 0


class _CountingAddOn(AddOn):
    """An add-on of the test's own: it reuses no cached prefix, asks for synchronous steps, counts the tokens
    of the chunks it is shown and writes the count into the output. Every kind runs it through the same hooks."""

    def __init__(self) -> None:
        self.tokens = 0

    def lookup_tokens(self, seq, tokens: list[int]) -> list[int]:
        return tokens[:1]

    def overlappable(self) -> bool:
        return False

    def plan_chunk(self, sched, offset: int, out: SchedulerOutput, step: GroupStep) -> None:
        self.tokens += sched.num_tokens

    def finish(self, request: Request, output) -> None:
        output.prompt = f"{self.tokens} tokens"


class _Tokenizer:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_an_add_on_needs_no_kind_or_scheduler_change() -> None:
    sched = scheduler()
    for params in (SamplingParams(temperature=0.0, max_tokens=2), SamplingParams(beam_width=2, max_tokens=2)):
        addon = _CountingAddOn()
        req, group = add(sched, f"r{params.beam_width}", [1, 2, 3, 4, 5], params, addons=[addon])
        assert not group.overlappable() and group.lookup_tokens(req.seqs[0]) == [1]
        finished = []
        while sched.has_unfinished():
            out = sched.schedule()
            n = len(out.sample_seqs)
            scores = _scores(len(out.score_rows), [7, 8]) if out.score_rows else None
            finished += sched.update(out, RunnerOutput([7] * n, [None] * n, scores=scores))
        assert finished == [req]
        output = OutputProcessor(_Tokenizer()).request_output(req)
        assert output.prompt == f"{addon.tokens} tokens" and addon.tokens >= 5
