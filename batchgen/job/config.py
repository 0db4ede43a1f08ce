"""The job's configuration schema: typed dataclasses, one per group, and their validation.

Groups: ``model`` (:class:`ModelOptions`), ``data`` (:class:`DataOptions`), ``engine`` (the engine's own
:class:`~batchgen.engine.config.EngineConfig`), ``sampling`` (:class:`~batchgen.sampling_params.SamplingParams`
itself: ``sampling.*`` keys are its fields) and ``run`` (:class:`RunOptions`). Hydra stores them in its
ConfigStore (:mod:`batchgen.job.hydra_setup`), so a misspelt key or a value of the wrong type is rejected with
Hydra's own message before any work; each field's docstring is its ``batchgen --help`` text
(:mod:`batchgen.job.help`).

Invariants:
- :func:`to_job_config` returns a fully validated :class:`JobConfig` or raises :class:`ConfigError` naming
  the offending key (the CLI exits with status 2).
- The job's sampling defaults are SamplingParams' except ``seed``: 0, so rows are seeded by default.
- ``data.shard.index`` / ``data.shard.count`` default to ``$SLURM_ARRAY_TASK_ID`` / ``$SLURM_ARRAY_TASK_COUNT``
  (wired in ``conf/config.yaml``; the Python defaults are 0 / 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchgen.data.layout import RESERVED_COLUMNS
from batchgen.engine.config import EngineConfig
from batchgen.errors import ConfigError
from batchgen.sampling_params import SamplingParams

DTYPES = ("auto", "float32", "bfloat16", "float16")
PROGRESS_MODES = ("auto", "bar", "log", "off")
JOB_SEED = 0
"""Default of ``sampling.seed`` in a job: every row samples with a seed derived from it and the row id."""


def default_sampling() -> SamplingParams:
    """The job's default ``sampling.*``: SamplingParams' defaults with the job seed."""
    return SamplingParams(seed=JOB_SEED)


def SamplingOptions(**kwargs: Any) -> SamplingParams:  # noqa: N802 - the name of the class it replaces
    """Deprecated: the ``sampling`` group is :class:`~batchgen.sampling_params.SamplingParams` itself. Returns
    SamplingParams with the job's defaults (``seed=0``) for callers of the former mirror class."""
    return SamplingParams(**{"seed": JOB_SEED, **kwargs})


@dataclass
class ModelOptions:
    """``model.*``: which checkpoint to run."""

    path: str | None = None
    """Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files); null = the embedded tiny Llama, built locally on first use (cached under $BATCHGEN_CACHE or ~/.cache/batchgen)."""
    dtype: str = "auto"
    """Weights and activations dtype: auto (the engine's choice for the checkpoint and device), float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass
class ShardOptions:
    """``data.shard.*``: which contiguous slice of the input rows this task processes."""

    index: int = 0
    """This task's shard, 0 <= index < count (default: $SLURM_ARRAY_TASK_ID, else 0; use a 0-based array such as --array=0-15)."""
    count: int = 1
    """Number of shards the input is split into (default: $SLURM_ARRAY_TASK_COUNT, else 1). Shard i gets global rows [i*N//count, (i+1)*N//count)."""


@dataclass
class DataOptions:
    """``data.*``: input, output and how rows become prompts."""

    input: str | None = None
    """Parquet input: a file, a directory (every *.parquet below it, recursively) or a glob such as 'data/*.parquet'; null = the small sample shipped with batchgen. Files are read in sorted path order; the global row index is the position in that order."""
    output: str = "batchgen_output"
    """Output directory. With data.shard.count > 1 each shard writes into <output>/shard-IIIII-of-NNNNN/."""
    prompt_column: str = "prompt"
    """String column holding the prompt text (used when data.messages_column is null)."""
    continuation_column: str | None = None
    """task=score: string column of the continuation scored given data.prompt_column (null = score the
    prompt_column text whole: rolling log-likelihood and perplexity)."""
    messages_column: str | None = None
    """Column of chat messages (list of {role, content} structs, or a JSON string of that list), rendered with the tokenizer's chat template (add_generation_prompt=True). Overrides data.prompt_column."""
    id_column: str | None = None
    """Column copied to the output 'id' column and used to derive per-row seeds; null = the global row index."""
    keep_columns: list[str] = field(default_factory=list)
    """Input columns copied unchanged into the output, e.g. [category,source]."""
    sampling_column: str | None = "sampling"
    """Optional struct (or JSON string) column of per-row overrides of sampling.* (e.g. {max_tokens: 64, temperature: 0.2}); null fields keep the job's value. Ignored when the input has no column of this name and the name is the default 'sampling'; set to null to ignore it always. 'n' cannot be overridden per row."""
    window_rows: int = 1024
    """Rows per window: the unit of tokenization, prefix grouping, output part files and resume. Must stay the same across reruns into the same output."""
    group_by_prefix: bool = True
    """Order each window's prompts by token ids (prefix-trie order) so shared prefixes hit the prefix cache; false = input order (output order is input order either way)."""
    overwrite: bool = False
    """Discard batchgen's files (parts, manifest, report) already in the output directory instead of resuming or refusing."""
    shard: ShardOptions = field(default_factory=ShardOptions)


@dataclass
class RunOptions:
    """``run.*``: progress reporting and signal handling."""

    progress: str = "auto"
    """auto (a tqdm bar on a terminal, periodic log lines otherwise, e.g. in Slurm logs), bar, log or off."""
    log_interval_s: float = 30.0
    """Seconds between progress log lines when the progress bar is not used."""
    stop_grace_s: float = 0.0
    """After SIGINT/SIGTERM/SIGUSR1: seconds to keep working on windows already started (no new ones) before abandoning them; 0 = abandon at once. Either way finished windows are kept and the job exits with 75."""

    def __post_init__(self) -> None:
        if self.progress not in PROGRESS_MODES:
            raise ConfigError(
                f"run.progress must be one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}"
            )
        if self.log_interval_s <= 0:
            raise ConfigError(f"run.log_interval_s must be > 0, got {self.log_interval_s}")
        if self.stop_grace_s < 0:
            raise ConfigError(f"run.stop_grace_s must be >= 0, got {self.stop_grace_s}")


@dataclass
class JobConfig:
    """The whole job: ``batchgen key=value ...``."""

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=default_sampling)
    run: RunOptions = field(default_factory=RunOptions)
    task: str = "generate"
    """'generate' (completions) or 'score': log-likelihoods of data.continuation_column given data.prompt_column,
    or, without a continuation column, the rolling log-likelihood / perplexity of data.prompt_column."""


GROUPS: dict[str, type] = {
    "model": ModelOptions,
    "data": DataOptions,
    "engine": EngineConfig,
    "sampling": SamplingParams,
    "run": RunOptions,
}
"""The config groups, in the order of ``batchgen --help``."""


def validate(cfg: JobConfig) -> None:
    """Each group's own checks (again: fields may have been assigned since construction), then the
    cross-field checks the dataclasses cannot express; raises ConfigError naming the key."""
    for name in GROUPS:
        _group_checked(name, dataclasses.replace, getattr(cfg, name))
    _validate_data(cfg.data)
    if cfg.task not in ("generate", "score"):
        raise ConfigError(f"task must be 'generate' or 'score', got {cfg.task!r}")
    if cfg.task == "score" and cfg.data.messages_column:
        raise ConfigError("task=score scores data.prompt_column text; data.messages_column is not supported")


def _validate_data(d: DataOptions) -> None:
    if d.window_rows < 1:
        raise ConfigError(f"data.window_rows must be >= 1, got {d.window_rows}")
    if d.shard.count < 1:
        raise ConfigError(f"data.shard.count must be >= 1, got {d.shard.count}")
    if not 0 <= d.shard.index < d.shard.count:
        raise ConfigError(
            f"data.shard.index={d.shard.index} is outside [0, data.shard.count={d.shard.count}) "
            "(the defaults come from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT: use a 0-based "
            "array such as --array=0-15, or set data.shard.index / data.shard.count)"
        )
    if not d.output:
        raise ConfigError("data.output must be a directory path")
    if not d.prompt_column and not d.messages_column:
        raise ConfigError("set data.prompt_column or data.messages_column")
    seen = set()
    for c in d.keep_columns:
        if c in seen:
            raise ConfigError(f"data.keep_columns lists {c!r} twice")
        seen.add(c)
        if c in RESERVED_COLUMNS and not (c == "id" and d.id_column == "id"):
            raise ConfigError(
                f"data.keep_columns: {c!r} is an output column name of batchgen "
                f"({', '.join(RESERVED_COLUMNS)}); rename the input column"
            )


def _group_checked(name: str, make: Callable[[Any], Any], arg: Any) -> Any:
    """``make(arg)``, which builds group `name`, with its ValueError turned into a ConfigError naming the group:
    ``engine.block_size must be ...`` stays as is, ``n must be >= 1`` becomes ``sampling.n must be >= 1``."""
    try:
        return make(arg)
    except ValueError as e:
        if isinstance(e, ConfigError) or str(e).startswith(f"{name}."):
            raise ConfigError(str(e)) from e
        first = str(e).split(" ", 1)[0]
        fields = {f.name for f in dataclasses.fields(GROUPS[name])}
        raise ConfigError(f"{name}.{e}" if first in fields else f"{name}: {e}") from e


def to_job_config(cfg: Any) -> JobConfig:
    """Convert a composed DictConfig (or a plain dict of groups, or a JobConfig) into a validated JobConfig.

    Each group's dataclass is built here, so its ``__post_init__`` checks run; their ValueErrors become
    ConfigError so the CLI reports them as configuration errors.
    """
    if isinstance(cfg, JobConfig):
        job = cfg
    else:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            if OmegaConf.get_type(cfg) is not JobConfig:  # composed without the schema: type it now
                cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), cfg)
        except OmegaConfBaseException as e:
            raise ConfigError(str(e)) from e
        job = JobConfig(**{name: _group_checked(name, OmegaConf.to_object, cfg[name]) for name in GROUPS})
        job.task = str(cfg.get("task", "generate"))
    validate(job)
    return job
