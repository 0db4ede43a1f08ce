"""An lm-evaluation-harness model over the batchgen engine: ``lm_eval --model batchgen``.

Implements ``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` the way lm-eval's own ``hf``
backend (``HFLM``) does — the same context/continuation split (``_encode_pair``), prefix token, rolling windows,
left truncation and stop handling — so per-request results equal ``hf``'s on the same checkpoint, while the
requests run through batchgen's continuous batching and prefix cache (many continuations of one context compute
the context once).

Example (offline, a local task directory)::

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from batchgen.lm_eval_adapter import BatchgenLM

    lm = BatchgenLM(pretrained="/path/to/checkpoint", kv_cache_memory="2GiB")
    results = simple_evaluate(model=lm, tasks=["my_task"], task_manager=TaskManager(include_path="tasks/"))

or from the command line (the adapter registers itself as ``batchgen`` when imported)::

    python -m batchgen.lm_eval_adapter --model_args pretrained=/path/to/ckpt --tasks my_task \\
        --include_path tasks/

Requires the ``eval`` extra (``pip install 'batchgen[eval]'``).
"""

from __future__ import annotations

import math
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams
from batchgen.scoring import rolling_windows, score_token_pairs


def _as_bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("batchgen")
class BatchgenLM(LM):
    """``pretrained``: a checkpoint directory. ``max_length``: the longest input (default: the engine's
    ``max_model_len - 1``, like HFLM's model length). ``add_bos_token``: encode with special tokens (HFLM's
    default False). Other keyword arguments are :class:`batchgen.engine.config.EngineConfig` fields
    (``kv_cache_memory``, ``max_num_seqs``, ``device``, ...); ``batch_size`` and ``device`` strings from
    lm-eval's command line are accepted (batching is continuous: ``batch_size`` is ignored)."""

    def __init__(
        self,
        pretrained: str,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool = False,
        prefix_token_id: int | None = None,
        dtype: str = "auto",
        batch_size: Any = None,
        **engine_options: Any,
    ) -> None:
        super().__init__()
        engine_options.pop("trust_remote_code", None)
        self.llm = LLM(pretrained, dtype=dtype, **engine_options)
        self.tokenizer = self.llm.tokenizer
        engine_len = self.llm.engine.max_model_len
        self._max_length = int(max_length) if max_length else engine_len - 1
        # The engine needs room for one sampled token after a scored input of max_length + 1 tokens.
        self._max_length = min(self._max_length, engine_len - 2)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _as_bool(add_bos_token)
        self.custom_prefix_token_id = prefix_token_id

    # ------------------------------------------------------------------ tokenization (as HFLM)
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=self.add_bos_token)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    def _truncate(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """HFLM feeds ``(ctx + cont)[-(max_length + 1):][:-1]``: keep at most max_length + 1 tokens."""
        keep = self.max_length + 1
        if len(ctx) + len(cont) > keep:
            whole = (ctx + cont)[-keep:]
            ctx, cont = whole[: len(whole) - len(cont)], whole[len(whole) - len(cont) :]
        return ctx, cont

    # ----------------------------------------------------------------------------- requests
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            if context == "":
                ctx, cont = [self.prefix_token_id], self.tok_encode(continuation)
            else:
                ctx, cont = self._encode_pair(context, continuation)
            pairs.append(self._truncate(ctx, cont))
        scores = score_token_pairs(self.llm.engine, pairs, use_tqdm=not disable_tqdm)
        results = [(s.loglikelihood, s.is_greedy) for s in scores]
        for req, r in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args[:1]
            for ctx, cont in rolling_windows(self.tok_encode(text), self.prefix_token_id, self.max_length):
                pairs.append((ctx, cont))
                owner.append(i)
        scores = score_token_pairs(self.llm.engine, pairs, use_tqdm=not disable_tqdm)
        totals = [0.0] * len(requests)
        for i, s in zip(owner, scores):
            totals[i] += s.loglikelihood
        for req, r in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, r)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, untils = [], [], []
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            until = until + [eos] if eos not in until else until
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = _as_bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0))
            if not do_sample:
                temperature = 0.0
            ids = self.tok_encode(context)
            ids = ids[-(self.max_length - max_gen) :] if self.max_length > max_gen else ids[-1:]
            prompts.append(ids)
            stops = [u for u in until if u]
            params.append(
                SamplingParams(
                    temperature=temperature,
                    top_p=float(kwargs.pop("top_p", 1.0)),
                    max_tokens=max_gen,
                    stop=stops or None,
                )
            )
            untils.append(stops)
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        results = []
        for req, out, until in zip(requests, outs, untils):
            s = self.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
            for term in until:
                s = s.split(term)[0]
            results.append(s)
            self.cache_hook.add_partial("generate_until", req.args, s)
        return results


def _perplexity(loglikelihood: float, num_tokens: int) -> float:
    return math.exp(-loglikelihood / max(1, num_tokens))


if __name__ == "__main__":  # python -m batchgen.lm_eval_adapter <lm_eval CLI arguments> --model batchgen
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
