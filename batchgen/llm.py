"""The Python API: ``batchgen.LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from tqdm.auto import tqdm

from batchgen.engine.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """An engine over one model. ``engine_options`` are the fields of :class:`EngineConfig`
    (``block_size``, ``max_num_seqs``, ``kv_cache_memory``, ``num_blocks``, ``enable_prefix_caching``, ...).

    ``model_impl`` (vLLM's name) chooses the model code: ``"auto"`` (default: batchgen's native implementation
    when it has one for the architecture, else transformers' modeling code over batchgen's paged attention),
    ``"native"`` or ``"transformers"``.

    >>> llm = LLM("/path/to/checkpoint", kv_cache_memory="1GiB")
    >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        tokenizer: str | None = None,
        model_impl: str = "auto",
        **engine_options,
    ) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}")
        self.engine = LLMEngine(
            model, EngineConfig(**engine_options), dtype=dtype, tokenizer=tokenizer, implementation=model_impl
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in input order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        base = engine.stats.num_requests
        ids = [f"gen-{base + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, prompt, p)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
        return [results[rid] for rid in ids]
