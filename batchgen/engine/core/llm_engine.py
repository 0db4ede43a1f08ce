"""The engine: requests in, finished generations out, one ``schedule → run → update`` step at a time."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from batchgen.attention import resolve_backend
from batchgen.engine.config import EngineConfig, logprobs_error
from batchgen.engine.core.interface import StepInfo, StepListener
from batchgen.engine.core.output_processor import OutputProcessor, error_output
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.core.stats import EngineCounters, EngineStats, StatsCollector
from batchgen.engine.features.lora_manager import LoRAManager, token_slots, worker_attach
from batchgen.engine.features.lora_manager import attach as attach_lora
from batchgen.engine.features.multimodal import EngineImages, ImageSlot
from batchgen.engine.features.pooling import PoolingState
from batchgen.engine.features.prompt_logprobs import PromptLogprobsAddOn
from batchgen.engine.features.structured import GRAMMAR, LogitsMask, StructuredOutputs
from batchgen.engine.features.structured import is_available as structured_available
from batchgen.engine.kv.kv_cache import KVCacheManager
from batchgen.engine.sched.kinds import make_group
from batchgen.engine.sched.output import SchedulerOutput
from batchgen.engine.sched.request_group import AddOn, RequestGroup
from batchgen.engine.sched.scheduler import Scheduler
from batchgen.engine.sched.sequence import Request, Sequence
from batchgen.engine.sched.stop import StopRules
from batchgen.engine.worker.executor import Executor
from batchgen.engine.worker.model_runner import ModelRunner
from batchgen.engine.worker.step_builder import StepBuilder
from batchgen.engine.worker.step_input import ForwardInput, RunnerOutput, SamplingInput, StepInput
from batchgen.engine.worker.tensor_parallel import TPModelRunner
from batchgen.engine.worker.tp_launch import TPGroup, WorkerSetup
from batchgen.engine.worker.tp_launch import start as start_ranks
from batchgen.lora_request import LoRARequest
from batchgen.models.loader import check_tensor_parallel, load_model, load_tokenizer
from batchgen.runtime import gc_tuning, startup_trace, threads
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_NO_XGRAMMAR = (
    "structured outputs (json_schema / regex / choice / grammar) need xgrammar: "
    "pip install 'batchgen[structured]' (on a CPU machine, without Triton: pip install "
    "'batchgen[structured-cpu]' && pip install --no-deps xgrammar)"
)


def _max_model_len(config: EngineConfig, mc) -> int:
    """The engine's context: ``engine.max_model_len``, at most the model's full context
    (max_position_embeddings; sliding windows are attended, they do not cap it)."""
    if config.max_model_len and config.max_model_len > mc.max_model_len:
        raise ValueError(
            f"engine.max_model_len={config.max_model_len} exceeds the model's limit of {mc.max_model_len} "
            f"tokens (max_position_embeddings); lower it"
        )
    return config.max_model_len or mc.max_model_len


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.device={device!r} but no CUDA device is available; use device=cpu or auto")
    return dev


class LLMEngine:
    """Turns requests into generations over the paged KV cache (implements
    :class:`batchgen.engine.core.interface.Engine`).

    ``add_request`` queues a request; ``step`` runs one scheduler step and returns the requests that finished
    in it (in completion order); ``has_unfinished`` tells whether more steps are needed. A request that cannot
    be served (empty prompt, too long, larger than the whole KV pool) finishes at the next ``step`` with
    ``error`` set; it never disturbs the others.

    With ``engine_config.tensor_parallel_size > 1`` this process is rank 0 of a tensor-parallel group
    (:mod:`batchgen.engine.worker.tp_launch`): it starts the worker ranks (stopped when the engine is collected or at
    exit) and steps them with a :class:`~batchgen.engine.worker.tensor_parallel.TPModelRunner`; everything else here is
    unchanged. ``tp_group`` is None on one device.

    One step is ``schedule → execute → update``: the :class:`Scheduler` plans it, the :class:`StepBuilder`
    turns the plan into a plain :class:`StepInput`, the :class:`Executor` runs it on the runner, and
    :meth:`Scheduler.update` applies the :class:`RunnerOutput`. ``LLMEngine(..., engine_config)`` with
    ``async_scheduling`` builds the subclass :class:`~batchgen.engine.core.async_engine.AsyncLLMEngine`.
    """

    scheduler_class: type[Scheduler] = Scheduler
    executor_class: type[Executor] = Executor

    def __new__(cls, model: str, engine_config: EngineConfig | None = None, *args, **kwargs) -> LLMEngine:
        if cls is LLMEngine and engine_config is not None and engine_config.async_scheduling:
            from batchgen.engine.core.async_engine import AsyncLLMEngine

            cls = AsyncLLMEngine
        return super().__new__(cls)

    def __init__(
        self,
        model: str,
        engine_config: EngineConfig | None = None,
        dtype: str = "auto",
        tokenizer: str | None = None,
        implementation: str = "auto",
        load: Callable[[torch.device, int, int], torch.nn.Module] | None = None,
    ) -> None:
        """``load(device, tp_rank, tp_size)``: builds (rank ``tp_rank``'s shard of) the model instead of the
        checkpoint's default loader (pooling models); picklable under tensor parallelism (every rank calls
        it)."""
        gc_tuning.freeze_startup_heap()  # full collections skip the import-time heap (batchgen/runtime)
        self.config = config = engine_config or EngineConfig()
        backend = self._load(model, config, dtype, implementation, load)
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.lora: LoRAManager | None = None
        adapters = None
        if config.enable_lora:
            self.lora, adapters = attach_lora(self.model, model, config)
        self.max_model_len = _max_model_len(config, self.model.config)
        eos = set(self.model.config.eos_token_ids or [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        num_blocks, num_swap_blocks = self._build_runner(config, backend)
        self.runner.adapters = adapters  # written by the steps' slot loads (lora_manager)
        kv = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_cpu_blocks=num_swap_blocks,
        )
        self.stop = StopRules.build(self.eos_token_ids, self.max_model_len)
        self.scheduler = self.scheduler_class(
            config, kv, self.stop, [self.lora] if self.lora is not None else []
        )
        self.counters = EngineCounters()
        self._collector = StatsCollector(self._stats, self.scheduler.stats, kv, self.counters)
        self._structured: StructuredOutputs | None = None  # built by the first constrained request
        self.builder = StepBuilder(config, self.max_model_len, self.device, self.stop, self._grammar_mask)
        if self.lora is not None:  # each token's adapter slot goes into the forward
            self.builder.input_batch.token_inputs.append(token_slots)
        self.outputs = OutputProcessor(self.tokenizer, self._satisfied)
        self.requests: dict[str | int, Request] = {}
        self._errors: list[RequestOutput] = []
        self._listeners: list[StepListener] = []
        self.executor = self.executor_class(self.runner, self._threads)
        weakref.finalize(self, self.executor.close)
        self.images = EngineImages(self.model, config)
        if self.images.position_fn is not None:  # positions that depend on a row's images (multimodal RoPE)
            self.builder.input_batch.token_inputs.append(self.images.token_positions)

    def _load(
        self,
        model: str,
        config: EngineConfig,
        dtype: str,
        implementation: str,
        load: Callable[[torch.device, int, int], torch.nn.Module] | None,
    ) -> str:
        """The device (tensor-parallel ranks started or joined here), CPU threads and the model; returns the
        attention backend."""
        tp = config.tensor_parallel_size
        # tensor parallelism: this process is rank 0 (workers started or joined here; see tp_launch)
        self.tp_group: TPGroup | None = None
        if tp > 1:
            if load is None:  # a custom loader checks its own model before the ranks start
                check_tensor_parallel(model, implementation, tp)
            setup = WorkerSetup(model, dtype, implementation, config, load, worker_attach(model, config))
            self.tp_group = start_ranks(setup)
            weakref.finalize(self, self.tp_group.close)  # workers stop when the engine is collected
            self.device = self.tp_group.device
        else:
            self.device = resolve_device(config.device)
        self._thread_policy = threads.apply(self.device)  # CPU threads: one decision for API and CLI alike
        # and taken again while it runs (one process: tensor-parallel ranks would count each other as load)
        self._threads = threads.monitor(self._thread_policy, self.device) if tp == 1 else None
        backend = resolve_backend(config.attention_backend, self.device)
        self.model_path = model
        # implementation: auto (native when batchgen has the architecture), native, or transformers
        self.model = (
            load(self.device, 0, tp)
            if load is not None
            else load_model(
                model, dtype=dtype, device=self.device, implementation=implementation, tp_rank=0, tp_size=tp
            )
        )
        return backend

    def _build_runner(self, config: EngineConfig, backend: str) -> tuple[int, int]:
        """The model runner (this process's, or rank 0's under tensor parallelism) with its KV cache and swap
        space allocated; returns (KV blocks, CPU swap blocks)."""
        if self.tp_group is not None:
            self.runner: ModelRunner = TPModelRunner(
                self.model, config, self.device, backend, self.max_model_len, self.tp_group.channel
            )
            self.tp_group.runner = self.runner
        else:
            self.runner = ModelRunner(self.model, config, self.device, backend, self.max_model_len)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self._stats = EngineStats(
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
        pooling: PoolingState | None = None,
        lora_request: LoRARequest | None = None,
        images: Seq[ImageSlot] = (),
        addons: Seq[AddOn] = (),
    ) -> None:
        """Queue a request. ``prompt_logprobs_start``: compute the logprobs of the prompt tokens from this
        position on (scoring: the continuation's first token), reusing the prefix cache before it.
        ``pooling``: a prefill-only pooling request (:mod:`batchgen.engine.features.pooling`; no ``params``) whose
        pooled hidden state is written into the given state; it gets no logit row and samples nothing: the
        step that completes its prompt finishes it. ``lora_request``: the adapter to run it under
        (needs ``enable_lora``; an adapter that cannot be read or applied fails this request alone). ``images``: the
        prompt's images, their placeholders already expanded in ``prompt`` (:mod:`batchgen.engine.features.multimodal`).
        ``addons``: what the caller asks of the request's steps besides (:class:`AddOn`: e.g.
        :class:`~batchgen.engine.features.end_probability.EndProbability`)."""
        if lora_request is not None and self.lora is None:
            raise ValueError("a lora_request needs an engine built with enable_lora=True")
        if pooling is not None and params is not None:
            raise ValueError("a pooling request takes no sampling params")
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = (
            list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
        )
        request = Request(request_id, token_ids, params, prompt_text, self.tokenizer)
        request.addons = PromptLogprobsAddOn.wanted(params, prompt_logprobs_start)
        if params.constrained:
            request.addons.append(GRAMMAR)
        request.addons.extend(addons)
        group = make_group(request, request.new_sequence(list(token_ids), 0), self.stop, pooling)
        self.counters.num_requests += 1
        error = self._validate(token_ids, params, pooling is not None)
        if error is None:
            error = group.unservable(self.scheduler.kv, self.config.max_num_seqs, self.stop)
        if error is None and lora_request is not None:
            assert self.lora is not None
            error = self.lora.bind(request, lora_request)
        # A constraint is compiled (cached) now, so a bad schema or regex fails this request alone.
        if error is None and params.constrained:
            error = self.structured.validate(params) if structured_available() else _NO_XGRAMMAR
        seq_ids = self.images.place(request_id, token_ids, images) if images and error is None else token_ids
        if isinstance(seq_ids, str):
            error = seq_ids
        if error is not None:
            self.counters.num_error_requests += 1
            self._errors.append(error_output(request, error))
            return
        if images:  # the sequence carries the images' token ids (batchgen.engine.features.multimodal)
            request.seqs[0].token_ids[:] = seq_ids
            spans = self.images.addon(images)
            if spans is not None:
                request.addons.append(spans)
        self._queue(request, group)
        self.counters.prompt_tokens += len(token_ids)

    def _queue(self, request: Request, group: RequestGroup) -> None:
        """A valid request enters the scheduler, in a group of its kind."""
        self.requests[request.request_id] = request
        self.scheduler.add(group)

    def _validate(self, token_ids: list[int], params: SamplingParams, pooling: bool = False) -> str | None:
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
        if pooling and n > self.max_model_len:
            return (
                f"prompt has {n} tokens but engine.max_model_len is {self.max_model_len}; shorten the prompt "
                f"or raise engine.max_model_len"
            )
        if not pooling and n >= self.max_model_len:
            return (
                f"prompt has {n} tokens but engine.max_model_len is {self.max_model_len}: it must leave room "
                f"for at least one generated token; shorten the prompt or raise engine.max_model_len"
            )
        return None

    def abort_request(self, request_id: str | int) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self.scheduler.abort_request(request)
            self._forget(request)

    def _forget(self, request: Request) -> None:
        """A request leaves the engine (finished or aborted): what it held besides KV blocks (its adapter slot:
        the scheduler's admission gates), its samples' generators and its images' pixels go."""
        self.requests.pop(request.request_id, None)
        if request.params.seed is not None:
            self.builder.released += [s.seq_id for s in request.seqs]
        for gate in self.scheduler.gates:
            gate.give_back(request)
        self.images.release(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self._errors) or self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        return len(self.requests) + len(self._errors)

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(StepInfo)`` after every step (benchmarks' timelines, progress displays)."""
        self._listeners.append(listener)

    # ----------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One step: schedule, execute (run the model, sample), update. Returns the requests finished in it."""
        t0 = time.perf_counter()
        finished, self._errors = self._errors, []
        out = self.scheduler.schedule()
        if out or out.swap_out or out.swap_in:
            output = self.executor.execute(self._step_input(out))
            finished += self._update(out, output)
        elif self.scheduler.has_unfinished() and not finished:
            raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
        self._notify(finished, out, t0)
        return finished

    def _step_input(
        self,
        out: SchedulerOutput,
        forward: ForwardInput | None = None,
        fill: tuple[Tensor, Tensor] | None = None,
    ) -> StepInput:
        """The step's plain input: block moves, the forward (built now unless given), the sampling (built now:
        it sees every token so far), the adapter slot loads in step order (:mod:`~batchgen.engine.features.lora_manager`)."""
        if forward is None:
            forward = self.builder.prepare_inputs(out)
        sampling = self.builder.sampling_input(out) if out else SamplingInput()
        loads = self.lora.take_loads() if self.lora is not None else []
        return StepInput(self.builder.moves(out), forward, sampling, fill, loads)

    def _update(self, out: SchedulerOutput, output: RunnerOutput) -> list[RequestOutput]:
        """Apply a step's output (:meth:`Scheduler.update`); the outputs of the requests it finished."""
        if not out.seqs:  # a step that only moved blocks
            return []
        failed = self.images.failures()  # before the step's finished requests let their images go
        failed_requests = {rid: self.requests.get(rid) for rid in failed}
        done = self.scheduler.update(out, output)
        self._collector.collect()  # per step: the peaks see every step
        if startup_trace.enabled and output.token_ids:
            startup_trace.mark("first_token")
        outs = [self._request_output(r) for r in done]
        if failed:
            outs = self._fail_requests(failed, failed_requests, outs)
        return outs

    def _fail_requests(
        self,
        failed: dict[str | int, str],
        requests: dict[str | int, Request | None],
        outs: list[RequestOutput],
    ) -> list[RequestOutput]:
        """``outs`` with each failed request's error output: a request still running is aborted, one that
        finished in this step (on an image without features) has its output replaced."""
        keep = [o for o in outs if o.request_id not in failed]
        for rid, reason in failed.items():
            request = requests.get(rid)
            if request is None:
                continue
            if rid in self.requests:
                self.abort_request(rid)
            self.counters.num_error_requests += 1
            keep.append(error_output(request, reason))
        return keep

    @property
    def stats(self) -> EngineStats:
        """The engine's figures, snapshotted from its components' counters now (one object, updated in place:
        use :meth:`EngineStats.snapshot` to keep one)."""
        return self._collector.collect()

    @property
    def thread_policy(self) -> threads.ThreadPolicy:
        """The CPU thread decision in force (re-taken while the engine runs: :class:`threads.ThreadMonitor`)."""
        return self._threads.policy if self._threads is not None else self._thread_policy

    def look_at_threads(self) -> None:
        """Take the CPU thread decision afresh before the next step, from the load then (a caller about to time
        steps after a pause; no-op where the count is not the engine's to change)."""
        if self._threads is not None:
            self._threads.look_now()

    def _grammar_mask(self, seqs: list[Sequence]) -> LogitsMask | None:
        """The grammar mask of a step's sampled sequences (None while no constrained request was seen)."""
        return self._structured.mask(seqs) if self._structured is not None else None

    def _satisfied(self, seq: Sequence) -> bool | None:
        """Whether ``seq``'s output completes its grammar (None: unconstrained)."""
        return self._structured.satisfied(seq) if self._structured is not None else None

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

    def _notify(self, finished: list[RequestOutput], out: SchedulerOutput | None, t0: float) -> None:
        if not self._listeners:
            return
        seqs, tokens = (len(out.seqs), out.num_batched_tokens) if out is not None else (0, 0)
        info = StepInfo(self.stats, finished, seqs, tokens, time.perf_counter() - t0)
        for listener in self._listeners:
            listener(info)

    def _request_output(self, request: Request) -> RequestOutput:
        """The output of a request whose every sample finished (texts decoded once, by the output processor)."""
        self._forget(request)
        self.counters.num_finished_requests += 1
        return self.outputs.request_output(request)
