"""Job configuration: typed dataclasses registered in Hydra's ConfigStore.

The job config has five groups: ``model``, ``data``, ``engine`` (the engine's own
:class:`~batchgen.engine.config.EngineConfig`, reused as is), ``sampling`` (mirrors
:class:`~batchgen.sampling_params.SamplingParams`) and ``run`` (progress, signals). Because every node is
typed, Hydra rejects a misspelt key or a value of the wrong type with its own message before any work.

Every field carries a docstring (the string literal right below it); :func:`render_help` turns them into
the ``batchgen --help`` text, so the help and the code cannot drift apart.

Invariants:
- ``to_job_config`` returns a fully validated :class:`JobConfig` or raises :class:`ConfigError` naming the
  offending key (the CLI exits with status 2).
- ``data.shard.index`` / ``data.shard.count`` default to ``$SLURM_ARRAY_TASK_ID`` / ``$SLURM_ARRAY_TASK_COUNT``
  (wired in ``conf/config.yaml``; the Python defaults are 0 / 1).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from batchgen.engine.config import EngineConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
PROGRESS_MODES = ("auto", "bar", "log", "off")
# Output column names the writer owns; kept input columns may not reuse them.
RESERVED_COLUMNS = (
    "id",
    "sample_index",
    "generated_text",
    "token_ids",
    "num_prompt_tokens",
    "num_generated_tokens",
    "num_cached_tokens",
    "finish_reason",
    "status",
    "error",
    "logprobs",
)


class ConfigError(ValueError):
    """An invalid configuration or input, detected before any work; the CLI exits with status 2."""


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
class SamplingOptions:
    """``sampling.*``: the job's sampling parameters (mirrors batchgen.SamplingParams)."""

    n: int = 1
    """Samples per prompt; with n > 1 the output has one row per sample and a sample_index column."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sum reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1 = off)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's (0 = off)."""
    repetition_penalty: float = 1.0
    """Penalise tokens already in the prompt or output (>1 discourages repeats; 1 = off)."""
    presence_penalty: float = 0.0
    """Subtract this from the logits of tokens already generated (0 = off)."""
    frequency_penalty: float = 0.0
    """Subtract this times the count of each token already generated (0 = off)."""
    max_tokens: int | None = 16
    """Most tokens to generate per sample (null = until EOS or engine.max_model_len)."""
    min_tokens: int = 0
    """Generate at least this many tokens before EOS or stop strings may end a sample."""
    stop: list[str] | None = None
    """Stop strings, e.g. ['###','\\n\\n']; the output ends before them."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a sample, in addition to the model's EOS tokens."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of generated_text."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Return the log-probabilities of this many top tokens per generated token (adds a 'logprobs' column); null = off."""
    seed: int | None = 0
    """Job seed. Each row samples with its own seed derived from (seed, row id), so results do not depend on batch composition, grouping or resume; null = unseeded (not reproducible)."""
    skip_special_tokens: bool = True
    """Drop special tokens from generated_text."""


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
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    run: RunOptions = field(default_factory=RunOptions)


GROUPS: dict[str, type] = {
    "model": ModelOptions,
    "data": DataOptions,
    "engine": EngineConfig,
    "sampling": SamplingOptions,
    "run": RunOptions,
}


def sampling_kwargs(opts: SamplingOptions) -> dict[str, Any]:
    """The sampling options as SamplingParams keyword arguments (lists copied)."""
    out = dataclasses.asdict(opts)
    for k in ("stop", "stop_token_ids"):
        if out[k] is not None:
            out[k] = list(out[k])
    return out


def validate(cfg: JobConfig) -> None:
    """Cross-field checks the dataclasses cannot express; raises ConfigError naming the key."""
    d = cfg.data
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
    s = cfg.sampling
    if s.n < 1:
        raise ConfigError(f"sampling.n must be >= 1, got {s.n}")
    try:
        from batchgen.sampling_params import SamplingParams
    except ImportError:  # pragma: no cover - sampler not installed yet
        return
    try:
        SamplingParams(**sampling_kwargs(s))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sampling: {e}") from e


def to_job_config(cfg: Any) -> JobConfig:
    """Convert a composed DictConfig (or a JobConfig) into a validated JobConfig.

    Dataclass ``__post_init__`` checks (including EngineConfig's) run here; their ValueErrors become
    ConfigError so the CLI reports them as configuration errors.
    """
    if isinstance(cfg, JobConfig):
        job = cfg
    else:
        from omegaconf import OmegaConf

        try:
            obj = OmegaConf.to_object(cfg)
        except ValueError as e:  # raised by a __post_init__ while instantiating
            raise ConfigError(str(e)) from e
        if isinstance(obj, dict):  # composed without the schema (e.g. a plain dict config)
            try:
                job = JobConfig(
                    model=ModelOptions(**obj.get("model", {})),
                    data=DataOptions(
                        **{k: v for k, v in obj.get("data", {}).items() if k != "shard"},
                        shard=ShardOptions(**obj.get("data", {}).get("shard", {})),
                    ),
                    engine=EngineConfig(**obj.get("engine", {})),
                    sampling=SamplingOptions(**obj.get("sampling", {})),
                    run=RunOptions(**obj.get("run", {})),
                )
            except (TypeError, ValueError) as e:
                raise ConfigError(str(e)) from e
        else:
            job = obj
    validate(job)
    return job


# --------------------------------------------------------------------------------------------- help text
@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right below each field."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
    else:
        return "???"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def option_docs() -> list[tuple[str, str, str]]:
    """Every leaf option as (dotted key, default, doc), in declaration order."""
    out: list[tuple[str, str, str]] = []

    def walk(prefix: str, cls: type) -> None:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}"
            ftype = f.default_factory if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
            if dataclasses.is_dataclass(ftype):
                walk(key, ftype)  # type: ignore[arg-type]
                continue
            out.append((key, _default_text(f), docs.get(f.name, "")))

    for name, cls in GROUPS.items():
        walk(name, cls)
    return out


def render_options(width: int = 100) -> str:
    """The option list shown by ``batchgen --help``."""
    lines: list[str] = []
    group = None
    for key, default, doc in option_docs():
        g = key.split(".")[0]
        if g != group:
            group = g
            gdoc = (inspect.getdoc(GROUPS[g]) or "").splitlines()[0]
            lines.append(
                f"\n{g}:  {gdoc}" if g != "engine" else f"\n{g}:  ``engine.*``: the paged-attention engine."
            )
        lines.append(f"  {key}={default}")
        for wl in textwrap.wrap(doc, width=width - 6, break_on_hyphens=False) or [""]:
            if wl:
                lines.append(f"      {wl}")
    return "\n".join(lines).replace("``", "").lstrip("\n")


HELP_HEADER = """batchgen: offline batch generation with a paged-attention engine.
Parquet prompts in, Parquet generations out; resumable, prefix-grouped, shardable (Slurm arrays).

Usage:
  batchgen [key=value ...]
  batchgen data.input=prompts.parquet data.output=out/ model.path=/ckpt/qwen2.5-0.5b sampling.max_tokens=256
  batchgen                      # the embedded demo: tiny model + shipped sample prompts, on CPU
  batchgen --cfg job            # print the resolved configuration and exit
"""

HELP_FOOTER = """Exit status: 0 done; 75 interrupted by a signal (rerun the same command to resume);
2 invalid configuration or input; 1 other errors (including Hydra's own messages about unknown keys).
Hydra flags: batchgen --hydra-help"""


def help_template() -> str:
    """Hydra help template (``hydra.help.template``): header, config groups, every option with its doc."""
    body = render_options()
    # string.Template escaping for Hydra's substitution; no '${' may appear (OmegaConf interpolation).
    body = body.replace("$", "$$")
    assert "$${" not in body, "option docs must not contain '${'"
    return (
        "${hydra.help.header}\n"
        "== Configuration groups (group=option) ==\n$APP_CONFIG_GROUPS\n"
        "== Options (key=default) ==\n" + body + "\n\n${hydra.help.footer}\n"
    )


def register_configs() -> None:
    """Register the schema, group options and the help text in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="batchgen_schema", node=JobConfig)
    cs.store(group="model", name="tiny", node=ModelOptions())
    cs.store(group="data", name="default", node=DataOptions())
    cs.store(group="engine", name="default", node=EngineConfig())
    cs.store(group="sampling", name="default", node=SamplingOptions())
    cs.store(group="sampling", name="greedy", node=SamplingOptions(temperature=0.0))
    cs.store(group="run", name="default", node=RunOptions())
    cs.store(
        group="hydra/help",
        name="batchgen",
        node={
            "app_name": "batchgen",
            "header": HELP_HEADER.replace("$", "$$"),
            "footer": HELP_FOOTER.replace("$", "$$"),
            "template": help_template(),
        },
    )


def shard_dir_name(index: int, count: int) -> str:
    """Sub-directory of data.output for shard `index` of `count` ('' when count == 1)."""
    return "" if int(count) == 1 else f"shard-{int(index):05d}-of-{int(count):05d}"


def _shard_dir_resolver(output: Any, index: Any, count: Any) -> str:
    sub = shard_dir_name(int(index), int(count))
    out = str(output).rstrip("/") or "/"
    return f"{out}/{sub}" if sub else out


def _array_env_resolver(name: str, default: Any = None) -> Any:
    """``$name`` from a Slurm job array, except inside a submitit job: submitit runs every job of a Hydra sweep
    as an array task, so there the array index says which sweep job this is, not which shard to process."""
    import os

    if os.environ.get("SUBMITIT_EXECUTOR"):
        return default
    return os.environ.get(name, default)


def register_resolvers() -> None:
    """``${batchgen.shard_dir:${data.output},${data.shard.index},${data.shard.count}}`` (used by hydra.run.dir)
    and ``${batchgen.array_env:SLURM_ARRAY_TASK_ID,0}`` (the shard defaults)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("batchgen.shard_dir"):
        OmegaConf.register_new_resolver("batchgen.shard_dir", _shard_dir_resolver)
    if not OmegaConf.has_resolver("batchgen.array_env"):
        OmegaConf.register_new_resolver("batchgen.array_env", _array_env_resolver)
