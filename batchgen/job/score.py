"""``batchgen task=score``: log-likelihoods instead of generations, window by window, resumable like generation.

With ``data.continuation_column`` set, each row scores the continuation given the context in
``data.prompt_column`` (split like lm-evaluation-harness: the pair is tokenized whole), writing
``loglikelihood`` (summed over the continuation's tokens), ``num_continuation_tokens``, ``is_greedy`` (every
continuation token is the argmax) and ``num_cached_tokens``. Without it, each row's ``data.prompt_column`` text
is scored whole (rolling windows of ``engine.max_model_len - 2`` tokens, the first token conditioned on bos/eos):
``loglikelihood_rolling``, ``num_tokens`` and ``perplexity``. Invalid rows (null, not a string, empty, too long)
become ``status=error`` rows. Rows sharing a context hit the prefix cache (only the continuation is computed).
With ``data.lora_column`` each row is scored under its LoRA adapter (null: the base model); a row naming an
unknown or unreadable adapter is an error row.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import pyarrow as pa

from batchgen.data.prompts import row_adapter
from batchgen.data.reader import iter_windows
from batchgen.job.tally import window_adapter_rows
from batchgen.job.window_output import commit_window
from batchgen.lora_request import LoRARequest
from batchgen.scoring import rolling_windows, score_token_pairs, split_pair

_TYPES = {
    "loglikelihood": pa.float64(),
    "num_continuation_tokens": pa.int64(),
    "is_greedy": pa.bool_(),
    "loglikelihood_rolling": pa.float64(),
    "num_tokens": pa.int64(),
    "perplexity": pa.float64(),
    "num_cached_tokens": pa.int64(),
    "status": pa.string(),
    "error": pa.string(),
}


def _adapters(plan, engine, table: pa.Table) -> tuple[list[LoRARequest | None], list[str | None]]:
    """Each row's LoRA adapter (None: the base model) and, for a row whose adapter is unknown or cannot be
    read, the error that makes it an error row (``data.lora_column``; none set: the base model for all)."""
    d = plan.cfg.data
    n = table.num_rows
    if not d.lora_column:
        return [None] * n, [None] * n
    known = plan.prompt_spec.lora_requests
    loras: list[LoRARequest | None] = []
    errors: list[str | None] = []
    for name in table.column(d.lora_column).to_pylist():
        lora, why = row_adapter(name, d.lora_column, known)
        if lora is not None:
            why = engine.lora.check(lora)  # an unreadable adapter fails its rows, not the job
        loras.append(lora)
        errors.append(why)
    return loras, errors


@dataclass
class WindowPairs:
    """A window's rows as scoring takes them: each row's ``status`` / ``error`` (its checks: a non-empty
    context and continuation, the length limit, its adapter), and the ``(context, continuation)`` token pairs
    the engine scores, ``owner[k]`` the row of pair ``k`` (rolling windows: several per row), ``loras[k]`` its
    adapter."""

    status: list[str]
    error: list[str | None]
    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    loras: list[LoRARequest | None] = field(default_factory=list)


def window_pairs(plan, engine, table: pa.Table) -> WindowPairs:
    """The window's token pairs and error rows (module docstring), as the job scores them."""
    d = plan.cfg.data
    tok = engine.tokenizer
    limit = engine.max_model_len - 1  # the engine samples one token after the scored input
    contexts = table.column(d.prompt_column).to_pylist()
    conts = table.column(d.continuation_column).to_pylist() if d.continuation_column else None
    row_loras, lora_errors = _adapters(plan, engine, table)
    n = len(contexts)
    w = WindowPairs(["ok"] * n, [None] * n)
    status, error, pairs, owner = w.status, w.error, w.pairs, w.owner
    for i, ctx in enumerate(contexts):
        cont = conts[i] if conts is not None else None
        why = None
        if not isinstance(ctx, str) or not ctx:
            why = f"{d.prompt_column} must be a non-empty string"
        elif conts is not None and (not isinstance(cont, str) or not cont):
            why = f"{d.continuation_column} must be a non-empty string"
        why = why or lora_errors[i]
        if why:
            status[i], error[i] = "error", why
            continue
        if conts is not None:
            c, x = split_pair(tok, ctx, cont)
            if not c or not x or len(c) + len(x) >= limit:
                status[i], error[i] = (
                    "error",
                    f"context + continuation must have 1..{limit - 1} tokens each side",
                )
                continue
            pairs.append((c, x))
            owner.append(i)
        else:
            prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
            for c, x in rolling_windows(tok.encode(ctx, add_special_tokens=False), prefix, limit - 1):
                pairs.append((c, x))
                owner.append(i)
    w.loras = [row_loras[i] for i in owner]
    return w


def _score_window(plan, engine, table: pa.Table) -> tuple[dict[str, list], int, int]:
    d = plan.cfg.data
    w = window_pairs(plan, engine, table)
    status, error, pairs, owner, loras = w.status, w.error, w.pairs, w.owner, w.loras
    n = len(status)
    scores = score_token_pairs(engine, pairs, loras=loras) if pairs else []
    ll, ntok, greedy, cached = [0.0] * n, [0] * n, [True] * n, [0] * n
    for i, s in zip(owner, scores):
        ll[i] += s.loglikelihood
        ntok[i] += s.num_tokens
        greedy[i] = greedy[i] and s.is_greedy
        cached[i] += s.num_cached_tokens
    ok = [s == "ok" for s in status]
    cols: dict[str, list] = {}
    if d.continuation_column:
        cols["loglikelihood"] = [v if k else None for v, k in zip(ll, ok)]
        cols["num_continuation_tokens"] = [v if k else None for v, k in zip(ntok, ok)]
        cols["is_greedy"] = [v if k else None for v, k in zip(greedy, ok)]
    else:
        cols["loglikelihood_rolling"] = [v if k else None for v, k in zip(ll, ok)]
        cols["num_tokens"] = [v if k else None for v, k in zip(ntok, ok)]
        cols["perplexity"] = [math.exp(-v / t) if k and t else None for v, t, k in zip(ll, ntok, ok)]
    cols["num_cached_tokens"] = cached
    cols["status"] = status
    cols["error"] = error
    prompt_tokens = sum(len(c) + len(x) for c, x in pairs)
    return cols, prompt_tokens, sum(cached)


def run_score_windows(
    plan, outdir, engine, todo, stop, progress, count_adapter, after_commit=None, on_window=None
) -> tuple[int, int]:
    """Score and commit each unfinished window; returns (windows, rows) done. Stops between windows on a
    signal (a window is the unit of resume). ``count_adapter(name, ok)``: called for each row of a job with
    ``model.lora_modules`` (name None: the base model). ``after_commit()``: called after each commit; then
    ``progress`` counts the window's rows (its error rows among them) and ``on_window(windows)`` is called
    with the windows committed so far."""
    d = plan.cfg.data
    windows = rows = 0
    for w in iter_windows(plan.input, todo, plan.columns):
        if stop.requested:
            break
        t0 = time.time()
        cols, prompt_tokens, cached = _score_window(plan, engine, w.table)
        by_adapter = None
        if plan.cfg.model.lora_modules:  # rows per adapter, summed over runs by the report
            raw = w.table.column(d.lora_column).to_pylist() if d.lora_column else [None] * w.table.num_rows
            names = [v if isinstance(v, str) else None for v in raw]
            ok = [st == "ok" for st in cols["status"]]
            by_adapter = window_adapter_rows(names, ok)
            for name, good in zip(names, ok):
                count_adapter(name, good)
        errors = sum(st != "ok" for st in cols["status"])
        cols = {k: pa.array(v, _TYPES[k]) for k, v in cols.items()}
        commit_window(outdir, stop, w, d, "score", cols, t0, prompt_tokens, cached, by_adapter)
        if after_commit is not None:
            with stop.saving():
                after_commit()
        progress.update(w.spec.num_rows, stats=engine.stats, errors=errors)
        windows += 1
        rows += w.spec.num_rows
        if on_window is not None:
            on_window(windows)
    return windows, rows
