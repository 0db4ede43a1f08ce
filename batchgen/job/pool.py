"""``batchgen task=embed`` / ``task=classify``: pooling instead of generation, window by window, resumable.

Each window's ``data.prompt_column`` texts are tokenised in one batch and pooled by a
:class:`~batchgen.pooling.runner.PoolingRunner` (length-sorted inside the window: unpadded encoder batches, or
token order on the paged engine so shared instruction prefixes hit the prefix cache); the window's part is
committed atomically with its manifest entry, so a job killed at any moment resumes from the first window not
committed and duplicates nothing. Output columns, one row per input row in input order: ``id``, the kept
columns, then ``embedding`` (fixed-size list of float32) for task=embed, or ``probs`` (fixed-size list of
float32, one per label; a one-label reward head's raw score) and ``label`` (the most likely label's name) for
task=classify, then ``num_prompt_tokens``, ``status`` and ``error``. Invalid rows (null, not a string, empty,
longer than the model takes) are ``status=error`` rows with null values.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from batchgen.data.reader import iter_windows
from batchgen.errors import ConfigError
from batchgen.job.window_output import commit_window


def pooling_model_facts(task: str, path: str) -> Any:
    """What planning needs from a pooling checkpoint (architecture, max length), from its config files only;
    a checkpoint that cannot do the task is a ConfigError naming ``model.path`` / ``task``."""
    from batchgen.pooling.checkpoint import read_checkpoint

    try:
        info = read_checkpoint(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model.path: cannot use {path!r} for task={task}: {e}") from e
    if task == "classify" and info.task != "classify":
        raise ConfigError(
            f"task=classify needs a *ForSequenceClassification checkpoint; {path!r} is "
            f"{info.architecture or info.model_type} (use task=embed or task=generate)"
        )
    max_len = info.max_seq_length
    if max_len is None:
        max_len = json.loads((info.path / "config.json").read_text()).get("max_position_embeddings") or 512
    return SimpleNamespace(architecture=info.architecture or info.model_type, max_model_len=int(max_len))


def start_runner(plan: Any) -> Any:
    """The :class:`PoolingRunner` of the plan's checkpoint (a failure to load is a ConfigError)."""
    from batchgen.pooling.checkpoint import read_checkpoint
    from batchgen.pooling.runner import PoolingRunner

    cfg = plan.cfg
    try:
        info = read_checkpoint(plan.model_path)
        return PoolingRunner(
            info, cfg.task, cfg.engine, dtype=cfg.model.dtype, implementation=cfg.model.implementation
        )
    except Exception as e:  # noqa: BLE001 - a model that does not load is a configuration problem
        raise ConfigError(f"cannot load model.path={plan.model_path!r} for task={cfg.task}: {e}") from e


def texts_to_tokens(runner: Any, texts: list[Any], column: str) -> tuple[list[list[int]], list[str | None]]:
    """Token ids per row (empty for a bad row) and the reason a row is bad: not a non-empty string, or refused
    by the runner (:meth:`PoolingRunner.check`: no tokens, longer than the model takes)."""
    why: list[str | None] = [
        None if isinstance(t, str) and t else f"{column} must be a non-empty string" for t in texts
    ]
    good = [i for i, w in enumerate(why) if w is None]
    tokens: list[list[int]] = [[] for _ in texts]
    if good:
        for i, t in zip(good, runner.tokenize([texts[i] for i in good])):
            tokens[i], why[i] = t, runner.check(t)
    return tokens, why


def _pool_window(plan: Any, runner: Any, table: pa.Table, spec: Any) -> tuple[dict[str, pa.Array], int]:
    d = plan.cfg.data
    texts = table.column(d.prompt_column).to_pylist()
    tokens, why = texts_to_tokens(runner, texts, d.prompt_column)
    todo = [i for i, w in enumerate(why) if w is None]
    rows = runner.run([tokens[i] for i in todo], spec)
    values: list[list[float] | None] = [None] * len(texts)
    labels: list[str | None] = [None] * len(texts)
    for i, r in zip(todo, rows):
        values[i], labels[i], why[i] = r.values, r.label, r.error
    width = runner.hidden_size if plan.cfg.task == "embed" else max(1, runner.info.num_labels)
    if plan.cfg.task == "embed" and spec.dimensions is not None:
        width = spec.dimensions
    vec_type = pa.list_(pa.float32(), width)
    cols: dict[str, pa.Array] = {}
    if plan.cfg.task == "embed":
        cols["embedding"] = pa.array(values, vec_type)
    else:
        cols["probs"] = pa.array(values, vec_type)
        cols["label"] = pa.array(labels, pa.string())
    ok = [w is None for w in why]
    cols["num_prompt_tokens"] = pa.array([len(t) if k else None for t, k in zip(tokens, ok)], pa.int64())
    cols["status"] = pa.array(["ok" if k else "error" for k in ok], pa.string())
    cols["error"] = pa.array(why, pa.string())
    return cols, sum(len(t) for t, k in zip(tokens, ok) if k)  # the rows pooled (not those refused)


def run_pool_windows(
    plan: Any,
    outdir: Any,
    runner: Any,
    todo: Any,
    stop: Any,
    progress: Any,
    after_commit: Any = None,
    on_window: Any = None,
) -> tuple[int, int, int]:
    """Pool and commit each unfinished window; returns (windows, rows, prompt tokens pooled) done. Stops
    between windows on a signal (a window is the unit of resume). ``after_commit()``: called after each
    commit; then ``progress`` counts the window's rows (its error rows among them) and ``on_window(windows)``
    is called with the windows committed so far."""
    from batchgen.pooling.params import PoolingParams

    d, p = plan.cfg.data, plan.cfg.pooling
    try:
        spec = runner.spec(PoolingParams(p.method, p.normalize, p.dimensions))
    except ValueError as e:
        raise ConfigError(f"pooling: {e}") from e
    windows = rows = tokens = 0
    for w in iter_windows(plan.input, todo, plan.columns):
        if stop.requested:
            break
        t0 = time.time()
        cols, prompt_tokens = _pool_window(plan, runner, w.table, spec)
        commit_window(outdir, stop, w, d, plan.cfg.task, cols, t0, prompt_tokens)
        if after_commit is not None:
            with stop.saving():
                after_commit()
        engine = getattr(runner, "engine", None)
        errors = sum(st != "ok" for st in cols["status"].to_pylist())
        progress.update(w.spec.num_rows, stats=engine.stats if engine is not None else None, errors=errors)
        windows += 1
        rows += w.spec.num_rows
        tokens += prompt_tokens
        if on_window is not None:
            on_window(windows)
    return windows, rows, tokens
