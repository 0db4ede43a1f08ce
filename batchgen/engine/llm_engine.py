"""The engine: requests in, finished generations out, one ``schedule → run → update`` step at a time."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence as Seq

import torch

from batchgen import startup_trace
from batchgen.engine.async_step import InFlight, Prepared, StepWorker, fill_tensors, placeholder_rows
from batchgen.engine.attention import resolve_backend
from batchgen.engine.config import EngineConfig, logprobs_error
from batchgen.engine.interface import StepInfo, StepListener
from batchgen.engine.kv_cache import KVCacheManager
from batchgen.engine.lora_manager import LoRAManager
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.outputs import CompletionOutput, RequestOutput
from batchgen.engine.sampler import Sampler, SamplingBatch, SamplingRow, SamplingTensors
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.sequence import Request, sample_seed  # noqa: F401  (sample_seed: public since 0.1)
from batchgen.engine.stats import EngineStats
from batchgen.engine.stop import StopRules
from batchgen.engine.structured import StructuredOutputs
from batchgen.engine.structured import is_available as structured_available
from batchgen.engine.tensor_parallel import TPModelRunner
from batchgen.engine.tp_launch import TPGroup, WorkerSetup
from batchgen.engine.tp_launch import start as start_ranks
from batchgen.lora_request import LoRARequest
from batchgen.models.llama import CausalLM
from batchgen.models.loader import check_tensor_parallel, load_model, load_tokenizer
from batchgen.models.lora import attach_lora
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_NO_XGRAMMAR = (
    "structured outputs (json_schema / regex / choice / grammar) need xgrammar: "
    "pip install 'batchgen[structured]' (on a CPU machine, without Triton: pip install "
    "'batchgen[structured-cpu]' && pip install --no-deps xgrammar)"
)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.device={device!r} but no CUDA device is available; use device=cpu or auto")
    return dev


class LLMEngine:
    """Turns requests into generations over the paged KV cache (implements
    :class:`batchgen.engine.interface.Engine`).

    ``add_request`` queues a request; ``step`` runs one scheduler step and returns the requests that finished
    in it (in completion order); ``has_unfinished`` tells whether more steps are needed. A request that cannot
    be served (empty prompt, too long, larger than the whole KV pool) finishes at the next ``step`` with
    ``error`` set; it never disturbs the others.

    With ``engine_config.tensor_parallel_size > 1`` this process is rank 0 of a tensor-parallel group
    (:mod:`batchgen.engine.tp_launch`): it starts the worker ranks (stopped when the engine is collected or at
    exit) and steps them with a :class:`~batchgen.engine.tensor_parallel.TPModelRunner`; everything else here is
    unchanged. ``tp_group`` is None on one device.

    With ``engine_config.async_scheduling`` the next step is scheduled and prepared while the current one's
    forward runs (:mod:`batchgen.engine.async_step`): ``step`` still completes one step per call, but may
    return with the next one in flight (``has_unfinished`` is true until it is collected).
    """

    async_threaded = True
    """Async scheduling runs forwards in a worker thread (False: inline, same order, no overlap; a
    benchmark/test hook)."""

    def __init__(
        self,
        model: str,
        engine_config: EngineConfig | None = None,
        dtype: str = "auto",
        tokenizer: str | None = None,
        implementation: str = "auto",
    ) -> None:
        self.config = config = engine_config or EngineConfig()
        tp = config.tensor_parallel_size
        # tensor parallelism: this process is rank 0 (workers started or joined here; see tp_launch)
        self.tp_group: TPGroup | None = None
        if tp > 1:
            check_tensor_parallel(model, implementation, tp)
            self.tp_group = start_ranks(WorkerSetup(model, dtype, implementation, config))
            weakref.finalize(self, self.tp_group.close)  # workers stop when the engine is collected
            self.device = self.tp_group.device
        else:
            self.device = resolve_device(config.device)
        backend = resolve_backend(config.attention_backend, self.device)
        self.model_path = model
        # implementation: auto (native when batchgen has the architecture), native, or transformers
        self.model = load_model(
            model, dtype=dtype, device=self.device, implementation=implementation, tp_rank=0, tp_size=tp
        )
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.lora = self._attach_lora(config) if config.enable_lora else None
        mc = self.model.config
        # The model's full context (max_position_embeddings); sliding windows are attended, they do not cap it.
        self.max_model_len = config.max_model_len or mc.max_model_len
        if config.max_model_len and config.max_model_len > mc.max_model_len:
            raise ValueError(
                f"engine.max_model_len={config.max_model_len} exceeds the model's limit of {mc.max_model_len} "
                f"tokens (max_position_embeddings); lower it"
            )
        eos = set(mc.eos_token_ids or [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        num_blocks, num_swap_blocks = self._build_runner(config, backend)
        kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_cpu_blocks=num_swap_blocks,
        )
        self.stop = StopRules.build(self.eos_token_ids, self.max_model_len)
        self.scheduler = Scheduler(config, kv, self.stop, self.stats, self.lora)
        self.sampler = Sampler(seed=config.seed)
        self.sampling_batch = SamplingBatch(config.max_num_seqs)  # per-row filter settings across steps
        self._structured: StructuredOutputs | None = None  # built by the first constrained request
        self.requests: dict[str | int, Request] = {}
        self._errors: list[RequestOutput] = []
        self._listeners: list[StepListener] = []
        # async scheduling: the worker running launched steps, the step in flight, and the live requests
        # that need synchronous steps (beam search, structured outputs, prompt logprobs)
        self._worker: StepWorker | None = None
        if config.async_scheduling:
            self._worker = StepWorker(threaded=self.async_threaded)
            weakref.finalize(self, self._worker.close)
        self._in_flight: InFlight | None = None
        self._sync_ids: set[str | int] = set()

    def _attach_lora(self, config: EngineConfig) -> LoRAManager:
        """Adapter slots in the model (before the KV cache is sized: they count as weights)."""
        if not isinstance(self.model, CausalLM):
            raise ValueError(
                f"engine.enable_lora=true needs a native architecture ({self.model.config.architecture} runs on "
                f"transformers' modeling code here); use one of batchgen's native architectures"
            )
        slots = attach_lora(self.model, config.max_loras, config.max_lora_rank)
        return LoRAManager(slots, self.model.config, config.max_cpu_loras)

    def _build_runner(self, config: EngineConfig, backend: str) -> tuple[int, int]:
        """The model runner (this process's, or rank 0's under tensor parallelism) with its KV cache and swap
        space allocated; returns (KV blocks, CPU swap blocks)."""
        if self.tp_group is not None:
            self.runner: ModelRunner = TPModelRunner(
                self.model, config, self.device, backend, self.tp_group.channel
            )
            self.tp_group.runner = self.runner
        else:
            self.runner = ModelRunner(self.model, config, self.device, backend)
        self.runner.max_model_len = self.max_model_len
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.stats = EngineStats(
            num_blocks=num_blocks,
            block_size=config.block_size,
            bytes_per_block=self.runner.bytes_per_block,
            max_model_len=self.max_model_len,
        )
        num_swap_blocks = self.runner.determine_num_swap_blocks() if config.preemption_mode == "swap" else 0
        self.runner.allocate_swap_space(num_swap_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s); at most %d sequences of max_model_len=%d at once",
            num_blocks,
            config.block_size,
            num_blocks * self.runner.bytes_per_block / 2**30,
            backend,
            num_blocks * config.block_size // self.max_model_len,
            self.max_model_len,
        )
        return num_blocks, num_swap_blocks

    # ------------------------------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str | int,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        prompt_logprobs_start: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. ``prompt_logprobs_start``: compute the logprobs of the prompt tokens from this
        position on (scoring: the continuation's first token), reusing the prefix cache before it.
        ``lora_request``: the adapter to run it under (needs ``enable_lora``; an adapter that cannot be read or
        applied fails this request alone)."""
        if lora_request is not None and self.lora is None:
            raise ValueError("a lora_request needs an engine built with enable_lora=True")
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = (
            list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
        )
        request = Request(request_id, token_ids, params, prompt_text, self.tokenizer, self.device)
        request.lora_request = lora_request
        if prompt_logprobs_start is not None or params.prompt_logprobs is not None:
            request.prompt_logprobs_start = prompt_logprobs_start
            self.runner.collect_prompt_logprobs = True
        self.stats.num_requests += 1
        error = self._validate(token_ids, params)
        if error is None and lora_request is not None:
            assert self.lora is not None
            error = self.lora.check(lora_request)
        # A constraint is compiled (cached) now, so a bad schema or regex fails this request alone.
        if error is None and params.constrained:
            error = self.structured.validate(params) if structured_available() else _NO_XGRAMMAR
        if error is not None:
            self.stats.num_error_requests += 1
            self._errors.append(_error_output(request, error))
            return
        self.requests[request_id] = request
        if params.beam_width > 1 or params.constrained or _wants_prompt_logprobs(request):
            self._sync_ids.add(request_id)
        self.scheduler.add(request.new_sequence(list(token_ids), 0))
        self.stats.prompt_tokens += len(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> str | None:
        n = len(token_ids)
        if n == 0:
            return "empty prompt: it has no tokens"
        too_many = logprobs_error(params.logprobs, params.prompt_logprobs, self.config.max_logprobs)
        if too_many is not None:
            return too_many
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        if n >= self.max_model_len:
            return (
                f"prompt has {n} tokens but engine.max_model_len is {self.max_model_len}: it must leave room "
                f"for at least one generated token; shorten the prompt or raise engine.max_model_len"
            )
        return self.scheduler.unservable(n, params.max_tokens, self.max_model_len, params.beam_width)

    def abort_request(self, request_id: str | int) -> None:
        request = self.requests.pop(request_id, None)
        self._sync_ids.discard(request_id)
        if request is not None:
            self.scheduler.abort_request(request)
            self._release_lora(request)

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot >= 0 and self.lora is not None and request.lora_request is not None:
            self.lora.release(request.lora_request.lora_int_id)
            request.lora_slot = -1

    def has_unfinished(self) -> bool:
        return bool(self._errors) or self.scheduler.has_unfinished() or self._in_flight is not None

    def num_unfinished(self) -> int:
        return len(self.requests) + len(self._errors)

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(StepInfo)`` after every step (benchmarks' timelines, progress displays)."""
        self._listeners.append(listener)

    # ----------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the model, sample, update. Returns the requests finished in it."""
        t0 = time.perf_counter()
        finished, self._errors = self._errors, []
        if self._in_flight is not None:
            out, done = self._complete(self._in_flight)
        else:
            out = self.scheduler.schedule()
            done = []
            if out and self._worker is not None:
                self.stats.drained_steps += 1
            if out and self._worker is not None and self._may_launch(out):
                self._launch(Prepared(out, self.runner.prepare_inputs(out), [], []), None)
                assert self._in_flight is not None
                out, done = self._complete(self._in_flight)
            elif out:
                done = self._run_sync(out)
            elif out.swap_out or out.swap_in:
                self.runner.swap(out)  # everything that could run was preempted in this step
            elif self.scheduler.has_unfinished() and not finished:
                raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
        finished += [self._request_output(r) for r in done]
        if self._listeners:
            self._notify(
                StepInfo(
                    self.stats, finished, len(out.seqs), out.num_batched_tokens, time.perf_counter() - t0
                )
            )
        return finished

    def _run_sync(self, out: SchedulerOutput) -> list[Request]:
        """Run, sample and update one step, in order; returns the requests it finished."""
        logits = self.runner.execute(out)
        n = len(out.sample_rows)
        if self._structured is not None:  # grammar bitmasks (CPU work while the forward runs)
            self._structured.apply(logits[:n], out.sample_seqs)
        rows, settings = self._sampling_inputs(out)
        sampled = self.sampler(logits[:n], rows, settings)
        beam_lp = self.sampler.beam_logprobs(logits[n:]) if out.beam_rows else None
        done = self.scheduler.update(out, sampled.token_ids, sampled.logprobs, beam_lp)
        if startup_trace.enabled and n:
            startup_trace.mark("first_token")
        return done

    # ----------------------------------------------------------------------------- async scheduling
    def _may_launch(self, out: SchedulerOutput) -> bool:
        """Whether a freshly scheduled step may run asynchronously (see :mod:`batchgen.engine.async_step`)."""
        return not (self._sync_ids or out.swap_out or out.swap_in or out.beam_groups)

    def _may_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is updated: no request needing
        synchronous steps, nothing swapped out, a free block per running sequence (no preemption)."""
        sched = self.scheduler
        return not self._sync_ids and not sched.swapped and sched.kv.num_free_blocks >= len(sched.running)

    def _complete(self, flight: InFlight) -> tuple[SchedulerOutput, list[Request]]:
        """Plan the next step ahead (when allowed) while ``flight`` runs, then update ``flight`` with its
        tokens and launch the planned step; returns ``flight``'s schedule and the requests it finished."""
        prepared = None
        if self._may_run_ahead():
            nxt = self.scheduler.schedule(ahead=True)
            if nxt:
                dst, src = placeholder_rows(nxt)
                prepared = Prepared(nxt, self.runner.prepare_inputs(nxt), dst, src)
        sampled = flight.result.result()
        self._in_flight = None
        done = self.scheduler.update(flight.out, sampled.token_ids, sampled.logprobs)
        if prepared is not None:
            if all(s.seq.is_finished for s in prepared.out.seqs):  # e.g. the batch's last requests
                self.scheduler.cancel(prepared.out)
            else:
                self.stats.async_steps += 1
                self._launch(prepared, fill_tensors(prepared, sampled.sampled))
        return flight.out, done

    def _launch(self, prepared: Prepared, fill: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Start the forward and sampling of a prepared step (sampling rows built now: they see every token
        so far) and advance its sequences with placeholders (:meth:`Scheduler.mark_launched`)."""
        assert self._worker is not None
        out = prepared.out
        n = len(out.sample_rows)
        rows, settings = self._sampling_inputs(out)
        runner, sampler, inputs = self.runner, self.sampler, prepared.inputs

        def run():
            logits = runner.forward(out, inputs, fill)
            return sampler(logits[:n], rows, settings)

        self._in_flight = InFlight(out, self._worker.submit(run))
        self.scheduler.mark_launched(out)

    def _sampling_inputs(
        self, out: SchedulerOutput
    ) -> tuple[list[SamplingRow] | None, SamplingTensors | None]:
        """The sampler's rows and per-row filter settings: both None when the step is plain greedy; only the
        settings (no rows built) when every row is plain sampling (:attr:`Request.plain_sampling`)."""
        if out.plain_greedy:
            return None, None
        seqs = out.sample_seqs
        settings = self.sampling_batch.gather([s.seq_id for s in seqs], [s.params for s in seqs])
        return (None if out.plain_sampling else self._sampling_rows(out)), settings

    def _sampling_rows(self, out: SchedulerOutput) -> list[SamplingRow]:
        """One :class:`SamplingRow` per sampled sequence (the steps :meth:`_sampling_inputs` needs them for)."""
        return [
            SamplingRow(
                params=seq.params,
                prompt_token_ids=seq.request.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                generator=seq.generator,
                banned_token_ids=self.stop.banned_token_ids(seq),
            )
            for seq in out.sample_seqs
        ]

    @property
    def structured(self) -> StructuredOutputs:
        """The engine's structured-output state (xgrammar), built on first use."""
        if self._structured is None:
            if not structured_available():
                raise ValueError(_NO_XGRAMMAR)
            self._structured = StructuredOutputs(
                self.tokenizer, self.model.config.vocab_size, self.eos_token_ids
            )
        return self._structured

    def _notify(self, info: StepInfo) -> None:
        for listener in self._listeners:
            listener(info)

    def _request_output(self, request: Request) -> RequestOutput:
        """The output of a request whose every sample finished (texts decoded here, once)."""
        self.requests.pop(request.request_id, None)
        self._sync_ids.discard(request.request_id)
        self._release_lora(request)
        self.stats.num_finished_requests += 1
        outputs = self._beam_outputs(request) if request.beam is not None else self._sample_outputs(request)
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            outputs,
            request.num_cached_tokens,
            None,
            request.prompt,
            _prompt_logprobs(request),
        )

    def _sample_outputs(self, request: Request) -> list[CompletionOutput]:
        """One output per sample, by sample index (texts decoded here, once)."""
        outputs = []
        for s in sorted(request.seqs, key=lambda s: s.sample_index):
            if not isinstance(s.stop_reason, str):  # a stop string already cut the text
                s.text = self.tokenizer.decode(
                    s.output_token_ids, skip_special_tokens=s.params.skip_special_tokens
                )
            outputs.append(
                CompletionOutput(
                    s.sample_index,
                    s.text,
                    s.output_token_ids,
                    s.finish_reason or "length",
                    s.logprobs,
                    s.stop_reason,
                    constraint_satisfied=self._structured.satisfied(s) if self._structured else None,
                )
            )
        return outputs

    def _beam_outputs(self, request: Request) -> list[CompletionOutput]:
        """The ``n`` best finished beams of a beam-search request, best first."""
        assert request.beam is not None
        skip = request.params.skip_special_tokens
        return [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.token_ids, skip_special_tokens=skip),
                token_ids=h.token_ids,
                finish_reason=h.finish_reason,
                stop_reason=h.stop_reason,
                cumulative_logprob=h.cumulative_logprob,
            )
            for i, h in enumerate(request.beam.results())
        ]


def _wants_prompt_logprobs(request: Request) -> bool:
    return request.prompt_logprobs_start is not None or request.params.prompt_logprobs is not None


def _prompt_logprobs(request: Request) -> list[dict[int, float] | None] | None:
    if request.prompt_logprobs is None and request.params.prompt_logprobs is None:
        return None
    return request.prompt_logprobs or [None] * len(request.prompt_token_ids)


def _error_output(request: Request, error: str) -> RequestOutput:
    outputs = [
        CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
        for i in range(request.params.n)
    ]
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, 0, error, request.prompt)
