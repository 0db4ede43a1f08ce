"""The engine loop: admit requests, schedule a step, run the model, sample, finish sequences."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence as Seq

import torch

from batchgen.engine.attention import resolve_backend
from batchgen.engine.config import EngineConfig
from batchgen.engine.detokenizer import IncrementalDetokenizer, find_stop
from batchgen.engine.interface import StepInfo, StepListener
from batchgen.engine.kv_cache import KVCacheManager
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.outputs import CompletionOutput, RequestOutput
from batchgen.engine.sampler import Sampler, SamplingRow
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Request, Sequence
from batchgen.engine.stats import EngineStats
from batchgen.models.loader import load_model, load_tokenizer
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.device={device!r} but no CUDA device is available; use device=cpu or auto")
    return dev


def sample_seed(seed: int, sample_index: int) -> int:
    """A stable 63-bit seed for sample ``sample_index`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class LLMEngine:
    """Turns requests into generations over the paged KV cache.

    ``add_request`` queues a request; ``step`` runs one scheduler step and returns the requests that finished
    in it (in completion order); ``has_unfinished`` tells whether more steps are needed. A request that cannot
    be served (empty prompt, too long, larger than the whole KV pool) finishes at the next ``step`` with
    ``error`` set; it never disturbs the others.
    """

    def __init__(
        self,
        model: str,
        engine_config: EngineConfig | None = None,
        dtype: str = "auto",
        tokenizer: str | None = None,
    ) -> None:
        self.config = config = engine_config or EngineConfig()
        self.device = resolve_device(config.device)
        backend = resolve_backend(config.attention_backend, self.device)
        self.model_path = model
        self.model = load_model(model, dtype=dtype, device=self.device)
        self.tokenizer = load_tokenizer(tokenizer or model)
        mc = self.model.config
        # The model's limit: max_position_embeddings, or a smaller sliding window (we attend to everything).
        self.max_model_len = config.max_model_len or mc.max_model_len
        if config.max_model_len and config.max_model_len > mc.max_model_len:
            raise ValueError(
                f"engine.max_model_len={config.max_model_len} exceeds the model's limit of {mc.max_model_len} "
                f"tokens (max_position_embeddings / sliding_window); lower it"
            )
        eos = set(mc.eos_token_ids or [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)

        self.runner = ModelRunner(self.model, config, self.device, backend)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = Sampler(seed=config.seed)
        self.stats = EngineStats(
            num_blocks=num_blocks,
            block_size=config.block_size,
            bytes_per_block=self.runner.bytes_per_block,
            max_model_len=self.max_model_len,
        )
        self.requests: dict[str | int, Request] = {}
        self._listeners: list[StepListener] = []
        self._errors: list[RequestOutput] = []
        self._arrivals = 0
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s); at most %d sequences of max_model_len=%d at once",
            num_blocks,
            config.block_size,
            num_blocks * self.runner.bytes_per_block / 2**30,
            backend,
            num_blocks * config.block_size // self.max_model_len,
            self.max_model_len,
        )

    # ------------------------------------------------------------------------------------- requests
    def add_request(
        self, request_id: str | int, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        prompt_text = None
        if isinstance(prompt, str):
            prompt_text = prompt
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = [int(t) for t in prompt]
        self.stats.num_requests += 1
        request = Request(request_id, token_ids, params, self._arrivals, prompt=prompt_text)
        self._arrivals += 1
        error = self._validate(token_ids, params)
        if error is not None:
            self._errors.append(self._error_output(request, error))
            return
        self.requests[request_id] = request
        seq = self._new_sequence(request, list(token_ids), 0)
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> str | None:
        n = len(token_ids)
        if n == 0:
            return "empty prompt: it has no tokens"
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        if n >= self.max_model_len:
            return (
                f"prompt has {n} tokens but engine.max_model_len is {self.max_model_len}: it must leave room "
                f"for at least one generated token; shorten the prompt or raise engine.max_model_len"
            )
        longest = min(n + (params.max_tokens or self.max_model_len), self.max_model_len)
        if self.scheduler.blocks_needed(longest) > self.kv.num_blocks:
            return (
                f"prompt ({n} tokens) plus max_tokens needs {self.scheduler.blocks_needed(longest)} KV blocks but "
                f"the pool holds {self.kv.num_blocks}; raise engine.kv_cache_memory / num_blocks or lower "
                f"max_tokens"
            )
        return None

    def _error_output(self, request: Request, error: str) -> RequestOutput:
        self.stats.num_error_requests += 1
        outputs = [
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
            for i in range(request.params.n)
        ]
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, 0, error, request.prompt)

    def _new_sequence(self, request: Request, token_ids: list[int], sample_index: int) -> Sequence:
        params = request.params
        seq = Sequence(request, token_ids, len(request.prompt_token_ids), sample_index=sample_index)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(sample_seed(params.seed, sample_index))
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
        if params.logprobs is not None:
            seq.logprobs = []
        request.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str | int) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return bool(self._errors) or self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        return len(self.requests) + len(self._errors)

    def add_step_listener(self, listener: StepListener) -> None:
        """Call ``listener(StepInfo)`` after every step (benchmarks' timelines, progress displays)."""
        self._listeners.append(listener)

    # ----------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        finished, num_seqs, num_tokens = self._step()
        if self._listeners:
            info = StepInfo(self.stats, finished, num_seqs, num_tokens, time.perf_counter() - t0)
            for listener in self._listeners:
                listener(info)
        return finished

    def _step(self) -> tuple[list[RequestOutput], int, int]:
        finished, self._errors = self._errors, []
        batch = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.prompt_tokens_cached = self.scheduler.prompt_tokens_cached
        if not batch:
            if self.scheduler.has_unfinished() and not finished:
                raise RuntimeError("scheduler made no progress with requests pending (pool too small?)")
            return finished, 0, 0
        self.runner.copy_blocks(batch.copies)
        self.stats.num_cow_copies += len(batch.copies)

        chunks, starts, tables, sample_rows = [], [], [], []
        num_decodes = 0
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            chunks.append(seq.token_ids[start : start + n])
            starts.append(start)
            tables.append(self.kv.block_table(seq.seq_id))
            if n == 1:
                num_decodes += 1
            if start + n == seq.num_tokens:
                sample_rows.append(b)
            self.stats.prompt_tokens_computed += max(0, min(start + n, seq.num_prompt_tokens) - start)
        logits = self.runner.execute(chunks, starts, tables, num_decodes, sample_rows)

        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n

        # Rows to sample: one per sampling sequence, n per request whose prompt just finished (fork point).
        rows: list[SamplingRow] = []
        targets: list[tuple[Sequence, int]] = []  # (parent sequence, sample index to create or -1)
        row_index: list[int] = []
        for i, b in enumerate(sample_rows):
            seq = batch.seqs[b]
            request = seq.request
            fork_now = seq.num_output_tokens == 0 and request.params.n > 1 and len(request.seqs) == 1
            indices = range(request.params.n) if fork_now else [-1]
            for k in indices:
                child = seq if k <= 0 else self._new_sequence(request, list(seq.token_ids), k)
                if k > 0:
                    self.kv.fork(seq.seq_id, child.seq_id)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.scheduler.add_running(child)
                rows.append(self._sampling_row(child))
                targets.append((child, k))
                row_index.append(i)
        if len(row_index) != len(sample_rows):
            logits = logits[torch.tensor(row_index, device=logits.device)]
        out = self.sampler(logits, rows)

        for (seq, _), token, lp in zip(targets, out.token_ids, out.logprobs):
            self._append_token(seq, int(token), lp)
            if seq.is_finished:
                done = self._on_seq_finished(seq)
                if done is not None:
                    finished.append(done)

        st = self.stats
        st.num_steps += 1
        st.running_seqs = len(self.scheduler.running)
        st.waiting_seqs = len(self.scheduler.waiting)
        st.peak_running_seqs = max(st.peak_running_seqs, st.running_seqs)
        kvs = self.kv.stats()
        st.kv_blocks_used = kvs.blocks_used
        st.kv_usage = kvs.blocks_used / self.kv.num_blocks
        st.peak_kv_usage = max(st.peak_kv_usage, st.kv_usage)
        st.kv_utilization = kvs.kv_utilization
        st.kv_fragmentation = kvs.internal_fragmentation
        if kvs.blocks_used:
            st.min_kv_utilization = min(st.min_kv_utilization, kvs.kv_utilization)
            st.peak_kv_fragmentation = max(st.peak_kv_fragmentation, kvs.internal_fragmentation)
        return finished, len(batch.seqs), sum(batch.num_new_tokens)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.params
        banned: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            banned = list(self.eos_token_ids) + list(params.stop_token_ids or [])
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.request.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
            banned_token_ids=banned,
        )

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        params = seq.params
        seq.token_ids.append(token)
        self.stats.generated_tokens += 1
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        num_out = seq.num_output_tokens
        reason: str | None = None
        if params.stop_token_ids and token in params.stop_token_ids and num_out >= params.min_tokens:
            reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids and num_out >= params.min_tokens:
            reason, seq.stop_reason = "stop", None
        if seq.detokenizer is not None:
            new_text = seq.detokenizer.append(token)
            if reason is None and num_out >= params.min_tokens:
                hit = find_stop(
                    seq.detokenizer.text, len(new_text), params.stop, params.include_stop_str_in_output
                )
                if hit is not None:
                    seq.text, idx = hit
                    reason, seq.stop_reason = "stop", params.stop[idx]
        if reason is None and (
            (params.max_tokens is not None and num_out >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    def _on_seq_finished(self, seq: Sequence) -> RequestOutput | None:
        request = seq.request
        if seq.detokenizer is None or seq.stop_reason is None or not isinstance(seq.stop_reason, str):
            seq.text = self.tokenizer.decode(
                seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens
            )
        request.num_finished += 1
        if request.num_finished < request.params.n:
            return None
        self.requests.pop(request.request_id, None)
        self.stats.num_finished_requests += 1
        outputs = [
            CompletionOutput(
                index=s.sample_index,
                text=s.text,
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason or "length",
                logprobs=s.logprobs,
                stop_reason=s.stop_reason,
            )
            for s in sorted(request.seqs, key=lambda s: s.sample_index)
        ]
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            outputs,
            request.num_cached_tokens,
            None,
            request.prompt,
        )
