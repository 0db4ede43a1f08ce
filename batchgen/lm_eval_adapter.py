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

from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams
from batchgen.scoring import score_token_pairs


def _opt_bool(v: Any) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    return str(v).lower() in ("1", "true", "yes")


@register_model("batchgen")
class BatchgenLM(TemplateLM):
    """``pretrained``: a checkpoint directory. ``max_length``: the longest model input (default: the engine's
    ``max_model_len - 2``: a scored input of ``max_length + 1`` tokens plus the one token the engine samples
    must fit). ``add_bos_token``: as HFLM's (None = the tokenizer's default). Other keyword arguments are
    :class:`batchgen.engine.config.EngineConfig` fields (``kv_cache_memory``, ``max_num_seqs``, ``device``,
    ...). ``batch_size`` from lm-eval's command line is accepted and ignored (batching is continuous)."""

    backend = "causal"

    def __init__(
        self,
        pretrained: str,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        dtype: str = "auto",
        batch_size: Any = None,
        **engine_options: Any,
    ) -> None:
        super().__init__()
        engine_options.pop("trust_remote_code", None)
        if engine_options.get("device") == "cuda:0":
            engine_options["device"] = "cuda"
        self.llm = LLM(pretrained, dtype=dtype, **engine_options)
        self.tokenizer = self.llm.tokenizer
        limit = self.llm.engine.max_model_len - 2
        self._max_length = min(int(max_length), limit) if max_length else limit
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = _opt_bool(add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)

    # ------------------------------------------------------------------ tokenization (as HFLM)
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def _special(self, string: str, add_special_tokens: bool | None) -> dict:
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        if has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            return {"add_special_tokens": False}
        return {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kw
    ) -> list[int]:
        ids = self.tokenizer.encode(string, **self._special(string, add_special_tokens))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------- requests
    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool):
        keep = self.max_length + 1  # HFLM scores (ctx + cont)[-(max_length + 1):]
        cut = []
        for ctx, cont in pairs:
            if len(ctx) + len(cont) > keep:
                whole = (ctx + cont)[-keep:]
                ctx, cont = whole[: keep - len(cont)], cont
            cut.append((ctx, cont))
        return score_token_pairs(self.llm.engine, cut, use_tqdm=not disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        scores = self._score([(list(c), list(x)) for _, c, x in requests], disable_tqdm)
        results = [(s.loglikelihood, s.is_greedy) for s in scores]
        for (key, _, _), r in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args[:1]
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for ctx, cont in map(lm_utils.make_disjoint_window, windows):
                pairs.append((list(ctx), list(cont)))
                owner.append(i)
        scores = self._score(pairs, disable_tqdm)
        totals = [0.0] * len(requests)
        for i, s in zip(owner, scores):
            totals[i] += s.loglikelihood
        for req, r in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, r)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if self.max_length <= max_gen:
                raise ValueError(f"max_gen_toks ({max_gen}) must be less than max_length ({self.max_length})")
            prompts.append(self.tok_encode(context, left_truncate_len=self.max_length - max_gen))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            params.append(
                SamplingParams(
                    temperature=temperature,
                    top_p=float(kwargs.pop("top_p", None) or 1.0),
                    max_tokens=max_gen,
                    stop=[u for u in until if u] or None,
                    include_stop_str_in_output=True,  # cut below, as HFLM does, on the decoded text
                )
            )
            stops.append(until)
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        results = []
        for req, out, until in zip(requests, outs, stops):
            s = postprocess_generated_text(self.tok_decode(out.outputs[0].token_ids), until, None)
            results.append(s)
            self.cache_hook.add_partial("generate_until", req.args, s)
        return results


if __name__ == "__main__":  # python -m batchgen.lm_eval_adapter --model batchgen <lm_eval CLI arguments>
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
