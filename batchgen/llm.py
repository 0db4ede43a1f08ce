"""The Python API: ``batchgen.LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields

from tqdm.auto import tqdm

from batchgen.driver import Driver, EngineRequest, Requests
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.core.outputs import RequestOutput
from batchgen.lora_request import LoRARequest
from batchgen.pooling.checkpoint import read_checkpoint, resolve_task
from batchgen.pooling.outputs import ClassificationOutput, EmbeddingOutput, PoolingRequestOutput
from batchgen.pooling.params import POOLING_TASKS, PoolingParams
from batchgen.pooling.runner import PooledRow, PoolingRunner
from batchgen.prompt_inputs import ParsedPrompt, Prompt, parse_prompts
from batchgen.sampling_params import SamplingParams
from batchgen.scoring import Score, rolling_loglikelihood, score_token_pairs, split_pair


class LLM:
    """An engine over one model. ``engine_options`` are the fields of :class:`EngineConfig`
    (``block_size``, ``max_num_seqs``, ``kv_cache_memory``, ``num_blocks``, ``enable_prefix_caching``, ...).

    ``model_impl`` (vLLM's name) chooses the model code: ``"auto"`` (default: batchgen's native implementation
    when it has one for the architecture, else transformers' modeling code over batchgen's paged attention),
    ``"native"`` or ``"transformers"``.

    ``task``: ``"auto"`` (default: from the checkpoint — a ``*ForSequenceClassification`` architecture
    classifies, a sentence-transformers layout or a bare backbone / encoder embeds, anything else generates; the
    choice is logged), ``"generate"``, ``"embed"`` or ``"classify"``. Pooling tasks use :meth:`embed` /
    :meth:`classify`.

    >>> llm = LLM("/path/to/checkpoint", kv_cache_memory="1GiB")
    >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        tokenizer: str | None = None,
        model_impl: str = "auto",
        task: str = "auto",
        **engine_options,
    ) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        if engine_options.get("data_parallel_size", 1) != 1:
            raise ValueError(
                "data_parallel_size > 1: an LLM is one engine in this process; run several replicas with the "
                "job (engine.data_parallel_size=N) or with Ray Data (batchgen.ray.Generator, concurrency=N)"
            )
        config = EngineConfig(**engine_options)
        self.task = resolve_task(model, task)
        self.pooler: PoolingRunner | None = None
        if self.task in POOLING_TASKS:
            self.pooler = PoolingRunner(
                read_checkpoint(model), self.task, config, dtype, tokenizer, model_impl
            )
            self.engine = self.pooler.engine  # None for encoders (they run outside the paged engine)
        else:
            self.engine = LLMEngine(
                model, config, dtype=dtype, tokenizer=tokenizer, implementation=model_impl
            )
            if config.mm_processor_kwargs:  # refused now, not at the first image
                from batchgen.multimodal import prepare

                prepare.image_prompts_for(self.engine)

    @property
    def tokenizer(self):
        return self.pooler.tokenizer if self.pooler is not None else self.engine.tokenizer

    # ---------------------------------------------------------------------------------------- pooling
    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One embedding per prompt (strings, token-id lists or vLLM's prompt dicts), in input order:
        ``out.outputs.embedding``.
        ``pooling``: ``last`` / ``mean`` / ``cls`` (None: the checkpoint's sentence-transformers pooling, else
        CLS for encoders, the last token for decoders); ``normalize``: L2-normalise (None: the checkpoint's
        choice, True when it has none); ``dimensions``: keep the first values (Matryoshka; normalised after).
        Instruction prefixes ("Instruct: ...\nQuery: ") are plain text; decoder rows sharing one compute it
        once with last-token pooling. A row that cannot run has ``error`` set."""
        runner = self._pooler("embed")
        spec = runner.spec(PoolingParams(pooling, normalize, dimensions))
        return self._pool(runner, prompts, spec, "embed", use_tqdm)

    def classify(
        self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """Class scores of a ``*ForSequenceClassification`` checkpoint, in input order: ``out.outputs.probs``
        (softmax over ``id2label``; a one-label reward/regression head gives its raw score) and
        ``out.outputs.label`` (the most likely label's name)."""
        runner = self._pooler("classify")
        return self._pool(runner, prompts, runner.spec(None), "classify", use_tqdm)

    def reward(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """:meth:`classify` for a reward model (one-label head): ``out.outputs.score``."""
        return self.classify(prompts, use_tqdm)

    def _pooler(self, task: str) -> PoolingRunner:
        if self.pooler is None or self.pooler.task != task:
            raise ValueError(
                f"this LLM was loaded for task={self.task!r}; load it with LLM(path, task={task!r}) to {task}"
            )
        return self.pooler

    def _pool(self, runner, prompts, spec, task: str, use_tqdm: bool) -> list[PoolingRequestOutput]:
        parsed = parse_prompts(prompts)
        token_lists = _token_lists(runner.tokenize, parsed)
        bar = tqdm(total=len(token_lists), desc=task, disable=not use_tqdm, dynamic_ncols=True)
        try:
            rows = runner.run(token_lists, spec, on_done=bar.update)
        finally:
            bar.close()
        outs = []
        for i, (toks, row) in enumerate(zip(token_lists, rows)):
            if parsed[i].token_ids is None and not parsed[i].text:  # no tokens: an error row, as in a job
                row = PooledRow(error=EMPTY_PROMPT)
            if row.error is not None:
                value = None
            elif task == "embed":
                value = EmbeddingOutput(row.values)
            else:
                value = ClassificationOutput(row.values, row.label)
            outs.append(PoolingRequestOutput(f"{task}-{i}", toks, value, row.error))
        return outs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. A prompt is a string, a list of token
        ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (vLLM's ``TextPrompt`` / ``TokensPrompt``).

        ``lora_request`` (an engine built with ``enable_lora=True``): one :class:`LoRARequest` for every prompt,
        or a list with one ``LoRARequest | None`` per prompt (None: the base model). Rows of different adapters
        run in the same steps. An adapter that cannot be read or applied fails its prompts alone (``error``)."""
        prompts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        base = self.engine.stats.num_requests
        ids = [f"gen-{base + i}" for i in range(len(prompts))]
        engine = self.engine
        results: dict[str | int, RequestOutput] = {}
        entries: list = []
        with_images = any(p.images for p in prompts)
        if with_images:  # prepared in worker threads while the engine runs
            from batchgen.multimodal import prepare

            sides: dict[str, object] = {}  # one image side per set of processor options

            def side_key(prompt: ParsedPrompt) -> str:
                key = json.dumps(prompt.mm_processor_kwargs or {}, sort_keys=True, default=str)
                if key not in sides:
                    try:
                        sides[key] = prepare.image_prompts_for(
                            engine, processor_kwargs=prompt.mm_processor_kwargs
                        )
                    except ValueError as e:  # options its processor does not take: the prompt's error
                        sides[key] = str(e)
                return key

            keys = {i: side_key(p) for i, p in enumerate(prompts) if p.images}
            tokens = {
                i: p.token_ids or list(engine.tokenizer.encode(p.text))
                for i, p in enumerate(prompts)
                if p.images
            }

            def image_requests(chunk: list[tuple[int, str, SamplingParams, LoRARequest | None]]) -> list:
                ready: list = [None] * len(chunk)
                by_side: dict[str, list[int]] = {}
                for j, (i, *_) in enumerate(chunk):
                    by_side.setdefault(keys[i], []).append(j)
                for key, js in by_side.items():
                    items = [(tokens[chunk[j][0]], prompts[chunk[j][0]].images) for j in js]
                    for j, item in zip(js, prepare.prepare_many(sides[key], items)):
                        ready[j] = item
                return [
                    # images that cannot be used: an error output, never sent
                    prepare.error_output(rid, prompts[i].token_ids or [], p.n, item, prompts[i].text)
                    if isinstance(item, str)
                    else EngineRequest(rid, item.token_ids, p, lora_request=lora, images=tuple(item.images))
                    for (i, rid, p, lora), item in zip(chunk, ready)
                ]

            ramp = not prepare.shares_cores(engine)  # else the engine waits for them all: group the work
            ahead = iter(
                prepare.prepare_ahead(
                    image_requests,
                    [(i, ids[i], params[i], loras[i]) for i in tokens],
                    ramp=ramp,
                    order=None if ramp else prepare.by_images([prompts[i].images for i in tokens]),
                )
            )
        for rid, prompt, p, lora in zip(ids, prompts, params, loras):
            if prompt.images:
                entries.append(next(ahead))
            else:
                entries.append(EngineRequest(rid, prompt.engine_prompt, p, lora_request=lora))

        def collect(finished: list[RequestOutput]) -> None:
            for out in finished:
                results[out.request_id] = out
            bar.update(len(finished))

        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, dynamic_ncols=True)
        task = (
            prepare.PreparedInOrder(entries, collect, prepare.engine_busy(engine))
            if with_images
            else Requests(entries, collect)
        )
        try:
            Driver(engine, task).run()
        finally:
            if with_images:
                task.cancel()  # the preparations not started yet
            bar.close()
        outs = [results[rid] for rid in ids]
        for out, prompt in zip(outs, prompts):
            if prompt.text is not None and (prompt.token_ids is not None or prompt.images):
                out.prompt = prompt.text  # a TokensPrompt's own text; an image prompt's text
        return outs

    def plan(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ):
        """The plan of ``generate(prompts, sampling_params)`` before running it (a
        :class:`batchgen.job.dry_run.Plan`: ``str(plan)`` prints it, ``plan.data`` is its dict): prompt tokens,
        the predicted prefix hit rate in generate's order, memory figures, and the predicted wall time from a
        short calibration of this engine on a stratified sample of the prompts (whose blocks then stay in its prefix
        cache: a ``generate`` right after may share more than predicted)."""
        from batchgen.job.dry_run import plan_prompts

        return plan_prompts(self.engine, prompts, sampling_params, lora_request)

    # ------------------------------------------------------------------------------------------- chat
    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{role, content}`` messages) or a list of them,
        rendered with the tokenizer's chat template (``chat_template`` overrides it; ``chat_template_kwargs``
        go to ``apply_chat_template``, e.g. ``{"enable_thinking": False}``). ``content`` is a string or a list
        of OpenAI ``{"type": "text", "text": ...}`` parts, and for an image-text model image parts
        (``{"type": "image_url", "image_url": {"url": ...}}``), rendered by the checkpoint's processor chat
        template (:mod:`batchgen.multimodal.chat`); ``mm_processor_kwargs``: the image processor's options for
        their images, over the engine's. Like vLLM's ``LLM.chat``."""
        from batchgen.chat import render
        from batchgen.multimodal.chat import has_images

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if any(has_images(c) for c in conversations):
            from batchgen.multimodal.prepare import chat_prompts

            image_prompts = chat_prompts(
                self.engine, conversations, add_generation_prompt, chat_template, chat_template_kwargs
            )
            if mm_processor_kwargs:
                for prompt in image_prompts:
                    if "multi_modal_data" in prompt:
                        prompt["mm_processor_kwargs"] = dict(mm_processor_kwargs)
            return self.generate(image_prompts, sampling_params, use_tqdm=use_tqdm)
        prompts = [
            render(self.tokenizer, c, add_generation_prompt, chat_template, chat_template_kwargs)
            for c in conversations
        ]
        # The template writes its own special tokens (bos): encode without adding them again.
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(token_ids, sampling_params, use_tqdm=use_tqdm)
        for out, p in zip(outs, prompts):
            out.prompt = p
        return outs

    # ---------------------------------------------------------------------------------------- scoring
    def score(
        self,
        contexts: str | Sequence[str] | Sequence[Sequence[int]],
        continuations: str | Sequence[str] | Sequence[Sequence[int]],
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[Score]:
        """Log-likelihood of each continuation given its context (strings or token-id lists): summed
        logprob, token count, greedy or not. Strings are split the way lm-evaluation-harness does (the pair is
        tokenized whole; trailing spaces of the context belong to the continuation). Contexts shared by several
        continuations come from the prefix cache after the first. ``lora_request``: score under a LoRA adapter,
        one for every pair or one ``LoRARequest | None`` per pair (as in :meth:`generate`)."""
        if isinstance(contexts, str):
            contexts, continuations = [contexts], [continuations]  # type: ignore[list-item]
        if len(contexts) != len(continuations):
            raise ValueError(f"got {len(contexts)} contexts for {len(continuations)} continuations")
        pairs = [
            split_pair(self.tokenizer, c, x) if isinstance(c, str) else (list(c), list(x))
            for c, x in zip(contexts, continuations)
        ]
        return score_token_pairs(self.engine, pairs, use_tqdm, _per_prompt(lora_request, len(pairs)))

    def loglikelihood_rolling(
        self, texts: str | Sequence[str], max_length: int | None = None, use_tqdm: bool = False
    ) -> list[tuple[float, int]]:
        """``(summed log-likelihood, number of tokens)`` of every token of each text (the first conditioned on
        bos, or eos when there is none), over windows of at most ``max_length`` tokens (default: the engine's
        ``max_model_len - 2``). Perplexity is ``exp(-loglikelihood / tokens)``."""
        if isinstance(texts, str):
            texts = [texts]
        tok = self.tokenizer
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        max_len = min(max_length or self.engine.max_model_len - 2, self.engine.max_model_len - 2)
        toks = [tok.encode(t, add_special_tokens=False) for t in texts]
        return rolling_loglikelihood(self.engine, toks, prefix, max_len, use_tqdm)


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt from ``lora_request`` (one for all, or a list of ``n``)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora requests for {n} prompts")
    return loras


EMPTY_PROMPT = "prompt must be a non-empty string"
"""The error of an empty text prompt to :meth:`LLM.embed` / :meth:`LLM.classify` (a job's error row says the
same, naming its prompt column)."""


def _token_lists(tokenize, prompts: list[ParsedPrompt]) -> list[list[int]]:
    """Token ids of each prompt: texts tokenised in one batch by ``tokenize`` (texts -> id lists), token ids as
    given; an empty text has none (an error row, never the tokenizer's special tokens alone)."""
    texts = [i for i, p in enumerate(prompts) if p.token_ids is None and p.text]
    out = [p.token_ids if p.token_ids is not None else [] for p in prompts]
    for i, t in zip(texts, tokenize([prompts[i].text for i in texts])):
        out[i] = t
    return out  # type: ignore[return-value]
