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
- A composed configuration holds no key the schema does not know, whatever the override's prefix (``+`` and
  ``++`` add keys past Hydra's own check): :func:`to_job_config` rejects it, suggesting the closest key.
- On the command line (and in YAML files) ``sampling.stop`` strings may spell a newline, tab or carriage return
  as ``\\n``, ``\\t``, ``\\r`` (Hydra passes them through literally); ``\\\\`` is a backslash
  (:func:`decode_escapes`). Python callers pass real strings: nothing is decoded on that path.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchgen.data.layout import RESERVED_COLUMNS
from batchgen.engine.config import EngineConfig, logprobs_error, parse_bytes
from batchgen.errors import ConfigError
from batchgen.sampling_params import SamplingParams

DTYPES = ("auto", "float32", "bfloat16", "float16")
PROGRESS_MODES = ("auto", "bar", "log", "off")
EXECUTORS = ("local", "ray")
JOB_SEED = 0
"""Default of ``sampling.seed`` in a job: every row samples with a seed derived from it and the row id."""


def default_sampling() -> SamplingParams:
    """The job's default ``sampling.*``: SamplingParams' defaults with the job seed."""
    return SamplingParams(seed=JOB_SEED)


IMPLEMENTATIONS = ("auto", "native", "transformers")  # batchgen.models.loader.IMPLEMENTATIONS, without torch


@dataclass
class ModelOptions:
    """``model.*``: which checkpoint to run."""

    path: str | None = None
    """Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files); null = the embedded tiny Llama shipped in the package (2.4M parameters trained on CPython's documentation, batchgen/models/tiny_lm/)."""
    gguf_file: str | None = None
    """A GGUF file inside model.path to run (model.path may also name a .gguf file itself): its model, config and tokenizer all come from the file; projections in Q4_0, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_1, Q5_0 or Q5_1 stay packed and are multiplied by batchgen's weight-only GEMM (C on the CPU, Triton on a GPU). Needs the gguf extra (pip install 'batchgen[gguf]')."""
    dtype: str = "auto"
    """Weights dtype: auto (the checkpoint's), float32, bfloat16 or float16; on the CPU a bfloat16/float16 model is
    held narrow and computed in float32 (widened in registers), on a GPU computed in its dtype."""
    implementation: str = "auto"
    """Model code: auto (batchgen's native code when it has the architecture, else transformers' modeling code over batchgen's paged attention), native, or transformers. Also picks the decoder backbone of task=embed / task=classify (encoders always run transformers' code)."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """LoRA adapters the rows may name in data.lora_column: {name: PEFT adapter directory}, e.g. model.lora_modules='{sql: /adapters/sql, chat: /adapters/chat}'. Turns on engine.enable_lora. An adapter that cannot be read fails its rows (error rows), not the job."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ConfigError(
                f"model.implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {self.implementation!r}"
            )


@dataclass
class ShardOptions:
    """``data.shard.*``: which contiguous slice of the input rows this task processes."""

    index: int = 0
    """This task's shard, 0 <= index < count (default: $SLURM_ARRAY_TASK_ID, else a Kubernetes Indexed Job's $JOB_COMPLETION_INDEX, else 0; use a 0-based array such as --array=0-15)."""
    count: int = 1
    """Number of shards the input is split into (default: $SLURM_ARRAY_TASK_COUNT, else $JOB_COMPLETIONS beside $JOB_COMPLETION_INDEX, else 1). Shard i gets global rows [i*N//count, (i+1)*N//count)."""


@dataclass
class DataOptions:
    """``data.*``: input, output and how rows become prompts."""

    input: str | None = None
    """Parquet input: a file, a directory (every *.parquet below it, recursively) or a glob such as 'data/*.parquet', as a local path or a URL (s3://, gs://, az://, hf://datasets/..., any fsspec URL); or an OpenAI Batch API request file (*.jsonl, with data.output=results.jsonl: chat / completions requests with task=generate, /v1/embeddings requests with task=embed); null = the small sample shipped with batchgen. Files are read in sorted path order; the global row index is the position in that order."""
    output: str = "batchgen_output"
    """Output directory, a local path or a URL (s3://bucket/prefix, ...). With data.shard.count > 1 each shard writes into <output>/shard-IIIII-of-NNNNN/."""
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
    """Rows per window: the unit of tokenization, prefix grouping, commit and resume. Must stay the same across reruns into the same output."""
    part_size: str = "256MB"
    """Target size of an output part file (bytes, or with a unit: 64MB, 1GiB): consecutive committed windows are rolled into one part once their rows reach it (the last part is smaller). Independent of data.window_rows; may change between runs."""
    part_rows: int | None = None
    """Output rows per part file instead of data.part_size (null = size by data.part_size)."""
    group_by_prefix: bool = True
    """Order each window's prompts by token ids (prefix-trie order) so shared prefixes hit the prefix cache; false = input order (output order is input order either way)."""
    overwrite: bool = False
    """Discard batchgen's files (parts, manifest, report) already in the output directory instead of resuming or refusing."""
    retry_errors: bool = False
    """On resume, recompute the error rows caused by the run's resources or settings (KV pool too small, engine.max_model_len, a chat template or tokenizer that failed, unreadable input) and rewrite their parts atomically; engine.max_model_len and the chat template may change for it. Errors in the data itself (null, empty, wrong type, invalid UTF-8) stay."""
    image_column: str | None = None
    """Image-text models: column of each row's image or list of images: Hugging Face datasets' Image struct {bytes, path}, a binary column of encoded images, or strings (paths or URLs: file://, s3://, gs://, az://, hf://, data:). The prompt text holds the model's image placeholder (e.g. <image>) once per image; chat rows (data.messages_column) may instead carry OpenAI image parts. A row whose image is missing, corrupt, of an unknown format, beyond engine.limit_mm_per_prompt or too long for engine.max_model_len becomes an error row."""
    lora_column: str | None = None
    """String column naming each row's LoRA adapter (a key of model.lora_modules); null values run on the base model; an unknown name makes the row an error row."""
    parse_json: bool = False
    """With sampling.json_schema: also write each output parsed into a typed 'generated_json' column (a struct
    with Arrow types from the schema: integer→int64, number→float64, string→string, boolean→bool,
    object→struct, array→list; other shapes as JSON text); null where the output is not a complete instance
    (constraint_satisfied false, e.g. cut by max_tokens)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Options of the filesystem of URL inputs and outputs (fsspec's storage_options), e.g. {endpoint_url: 'http://minio:9000', region: eu-west-1}; credentials come from each store's standard places (AWS_* variables, profiles, instance roles; GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_*; HF_TOKEN) unless given here. Values of secret keys (key, secret, token, ...) never appear in logs, manifests, reports or Hydra's saved config."""
    lease_ttl_s: float = 120.0
    """Object-store outputs: seconds a job's lease on its output stays valid without renewal (renewed every third of it). A second job on the same output is refused while it is valid; the lease of a killed job is taken over once it has expired."""
    shard: ShardOptions = field(default_factory=ShardOptions)


@dataclass
class RunOptions:
    """``run.*``: progress reporting, signal handling and where engine replicas run."""

    progress: str = "auto"
    """auto (a tqdm bar on a terminal, periodic log lines otherwise, e.g. in Slurm logs), bar, log or off."""
    progress_interval_s: float = 30.0
    """Seconds between progress log lines when the progress bar is not used (rows done and errors, tokens/s, prefix hit rate, KV use, ETA)."""
    stop_grace_s: float = 0.0
    """After SIGINT/SIGTERM/SIGUSR1: at most this many seconds to finish the windows already started (their remaining rows are still run; no new window starts), exiting as soon as they are done; what is unfinished then is abandoned. 0 = abandon the rows in flight at once. Either way every finished row is saved and the job exits with 75."""
    checkpoint_interval_s: float = 60.0
    """Seconds between checkpoints of the rows finished in windows not yet complete (a stop signal checkpoints at once): a kill -9 loses at most this much finished work plus the rows in flight; 0 = only on a stop signal."""
    max_error_fraction: float = 0.1
    """The job fails (exit status 3, 'failed' in the summary) when more than this fraction of its rows are error rows; before that, a job whose first rows all fail stops early with exit status 2 (a configuration that makes every row fail). 1 = never."""
    executor: str = "local"
    """Where engine replicas run: local (processes on this machine; one replica with engine.data_parallel_size=1 runs in the job's own process) or ray (Ray actors on the cluster at run.ray_address / $RAY_ADDRESS, a local Ray when neither is set)."""
    ray_address: str | None = None
    """run.executor=ray: the Ray cluster to join (e.g. 'ray://head:10001' or 'auto'); null = $RAY_ADDRESS, else start a local Ray."""
    metrics_port: int | None = None
    """Serve Prometheus metrics (text format, /metrics) on this port while the job runs: vLLM's metric names under a batchgen: prefix (prompt/generation tokens, KV use, running/waiting requests, time-to-first-token and per-token histograms, prefix cache hits/queries) and job gauges (rows done, error rows, windows committed, ETA); 0 = a free port (logged); null = off."""
    metrics_file: str | None = None
    """Write the same metrics as a node-exporter textfile at this path (rewritten atomically every few seconds and at the end), e.g. for Slurm nodes; null = off."""
    dry_run: bool = False
    """Plan the job without running it: read and tokenize the input as the job would (plan.sample_rows), simulate the prefix cache over the job's grouping, calibrate the engine on a small stratified sample, print the plan (rows, would-be error rows, tokens, prefix hit rate and where sharing is lost, memory and batch recommendations, predicted wall time with a range, device-hours, cost) and write _plan.json in the output directory; the output's rows and manifest are not touched."""
    max_replica_restarts: int = 3
    """Replicas (engine.data_parallel_size / run.executor=ray): how many lost replicas (a killed process, a lost Ray actor) are replaced in one run, their unfinished windows handed to the others; one more loss stops the job with exit status 75 (rerun to resume)."""

    def __post_init__(self) -> None:
        if self.progress not in PROGRESS_MODES:
            raise ConfigError(
                f"run.progress must be one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}"
            )
        if self.progress_interval_s <= 0:
            raise ConfigError(f"run.progress_interval_s must be > 0, got {self.progress_interval_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"run.metrics_port must be a port in [0, 65535] or null, got {self.metrics_port}"
            )
        if self.stop_grace_s < 0:
            raise ConfigError(f"run.stop_grace_s must be >= 0, got {self.stop_grace_s}")
        if self.checkpoint_interval_s < 0:
            raise ConfigError(f"run.checkpoint_interval_s must be >= 0, got {self.checkpoint_interval_s}")
        if not 0.0 <= self.max_error_fraction <= 1.0:
            raise ConfigError(f"run.max_error_fraction must be in [0, 1], got {self.max_error_fraction}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"run.executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.max_replica_restarts < 0:
            raise ConfigError(f"run.max_replica_restarts must be >= 0, got {self.max_replica_restarts}")


POOLING_METHODS = ("last", "mean", "cls")  # batchgen.pooling.params.POOLING_METHODS, without torch


@dataclass
class PoolingOptions:
    """``pooling.*``: how task=embed pools each row's hidden states (task=classify uses the head's own pooling)."""

    method: str | None = None
    """last, mean or cls; null = the checkpoint's sentence-transformers pooling, else cls for encoders (BERT-like) and last for decoders."""
    normalize: bool | None = None
    """L2-normalise each embedding; null = the checkpoint's choice (a sentence-transformers Normalize module), true when it has none."""
    dimensions: int | None = None
    """Keep the first N values of each embedding (Matryoshka models), normalised after truncation; null = all."""

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise ConfigError(
                f"pooling.method must be one of {', '.join(POOLING_METHODS)} or null, got {self.method!r}"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise ConfigError(f"pooling.dimensions must be >= 1 or null, got {self.dimensions}")


@dataclass
class PlanOptions:
    """``plan.*``: the dry run's plan (run.dry_run=true)."""

    sample_rows: int | None = None
    """Tokenize at most this many rows of the shard (an even sample over its windows; the plan states it and scales its totals); null = every row."""
    cost_per_hour: float | None = None
    """Price of one device-hour (any currency): the plan adds the predicted cost; null = no cost."""
    calibrate: bool = True
    """Run the real engine (a pooling job: its model) over a small stratified sample of rows to predict the wall time and the output tokens (capped at plan.calibration_fraction of the predicted time); false = tokens and memory only."""
    calibration_fraction: float = 0.05
    """Most of the job's predicted wall time the calibration may spend (warm-up included; a few engine steps at least, a small sample widening the range); it stops, aborting the rows it runs, when that is spent."""
    calibration_rows: int = 512
    """Most rows the calibration runs, fed as the job feeds them (engine.max_num_seqs at once); fewer when plan.calibration_fraction caps it."""
    reuse_step_model: bool = True
    """Keep the calibration's timed engine steps in $BATCHGEN_CACHE/step-model/ per model, dtype, engine configuration and machine, and start a later dry run's step model from them (its budget then goes to output lengths); false = time every step model afresh."""

    def __post_init__(self) -> None:
        if self.sample_rows is not None and self.sample_rows < 1:
            raise ConfigError(f"plan.sample_rows must be >= 1 or null, got {self.sample_rows}")
        if self.cost_per_hour is not None and self.cost_per_hour < 0:
            raise ConfigError(f"plan.cost_per_hour must be >= 0 or null, got {self.cost_per_hour}")
        if not 0.0 < self.calibration_fraction <= 1.0:
            raise ConfigError(f"plan.calibration_fraction must be in (0, 1], got {self.calibration_fraction}")
        if self.calibration_rows < 1:
            raise ConfigError(f"plan.calibration_rows must be >= 1, got {self.calibration_rows}")


TASKS = ("generate", "score", "embed", "classify")
POOLING_TASKS = ("embed", "classify")


@dataclass
class JobConfig:
    """The whole job: ``batchgen key=value ...``."""

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=default_sampling)
    run: RunOptions = field(default_factory=RunOptions)
    pooling: PoolingOptions = field(default_factory=PoolingOptions)
    plan: PlanOptions = field(default_factory=PlanOptions)
    task: str = "generate"
    """'generate' (completions); 'score': log-likelihoods of data.continuation_column given data.prompt_column,
    or, without a continuation column, the rolling log-likelihood / perplexity of data.prompt_column; 'embed': an
    'embedding' column (fixed-size list of float32, see pooling.*); 'classify': 'probs' (one score per label) and
    'label' columns from a *ForSequenceClassification checkpoint (a one-label reward head: probs=[score]).
    embed/classify run decoders on the paged engine (native code or transformers', see model.implementation;
    engine.tensor_parallel_size shards native decoders) and encoders through transformers' code (BERT, RoBERTa,
    XLM-RoBERTa, CamemBERT, DistilBERT, ELECTRA, ModernBERT in unpadded batches; MPNet, DeBERTa, ALBERT in
    length-sorted padded ones)."""


GROUPS: dict[str, type] = {
    "model": ModelOptions,
    "data": DataOptions,
    "engine": EngineConfig,
    "sampling": SamplingParams,
    "run": RunOptions,
    "pooling": PoolingOptions,
    "plan": PlanOptions,
}
"""The config groups, in the order of ``batchgen --help``."""


def validate(cfg: JobConfig) -> None:
    """Each group's own checks (again: fields may have been assigned since construction), then the
    cross-field checks the dataclasses cannot express; raises ConfigError naming the key."""
    for name in GROUPS:
        _group_checked(name, dataclasses.replace, getattr(cfg, name))
    _validate_data(cfg.data)
    if cfg.task not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {cfg.task!r}")
    if cfg.task != "generate" and (cfg.engine.data_parallel_size > 1 or cfg.run.executor != "local"):
        raise ConfigError(
            f"task={cfg.task} runs on one engine: set engine.data_parallel_size=1 and run.executor=local "
            "(or split the input with data.shard.index / data.shard.count)"
        )
    if cfg.task != "generate" and cfg.data.messages_column:
        raise ConfigError(
            f"task={cfg.task} reads data.prompt_column text; data.messages_column is not supported"
        )
    if cfg.data.image_column and cfg.engine.tensor_parallel_size > 1:
        raise ConfigError(
            f"data.image_column={cfg.data.image_column!r} with engine.tensor_parallel_size="
            f"{cfg.engine.tensor_parallel_size}: an image-text model runs its images on one device; set "
            "engine.tensor_parallel_size=1 (and engine.data_parallel_size for more replicas)"
        )
    if cfg.task == "score":
        _validate_score_sampling(cfg.sampling)
    too_many = logprobs_error(cfg.sampling.logprobs, cfg.sampling.prompt_logprobs, cfg.engine.max_logprobs)
    if too_many is not None:
        raise ConfigError(f"sampling.{too_many}")
    _validate_lora(cfg)


def _validate_score_sampling(s: SamplingParams) -> None:
    """task=score computes one log-likelihood per row: sampling options that make several outputs per row
    (or none of its meaning) are refused rather than silently ignored."""
    for key, value, default in (("n", s.n, 1), ("beam_width", s.beam_width, 1)):
        if value != default:
            raise ConfigError(
                f"sampling.{key}={value} does not apply to task=score (one log-likelihood per row, computed "
                f"exactly): remove it"
            )
    if s.constrained:
        raise ConfigError(
            "structured outputs (sampling.json_schema/regex/choice/grammar) do not apply to task=score"
        )


def _validate_lora(cfg: JobConfig) -> None:
    modules, column = cfg.model.lora_modules, cfg.data.lora_column
    if column and not modules:
        raise ConfigError(
            f"data.lora_column={column!r} names adapters but model.lora_modules is empty; set "
            "model.lora_modules='{name: /path/to/adapter, ...}'"
        )
    for name, path in (modules or {}).items():
        if not str(name).strip() or not str(path).strip():
            raise ConfigError(
                f"model.lora_modules: {name!r}: {path!r}: give every adapter a name and a directory"
            )
    if column and column in RESERVED_COLUMNS:
        raise ConfigError(f"data.lora_column: {column!r} is an output column name of batchgen; rename it")


def _validate_data(d: DataOptions) -> None:
    if d.window_rows < 1:
        raise ConfigError(f"data.window_rows must be >= 1, got {d.window_rows}")
    if d.part_rows is not None and d.part_rows < 1:
        raise ConfigError(f"data.part_rows must be >= 1 (or null), got {d.part_rows}")
    try:
        parse_bytes(d.part_size)
    except ValueError as e:
        raise ConfigError(f"data.part_size: {e}") from None
    if d.lease_ttl_s <= 0:
        raise ConfigError(f"data.lease_ttl_s must be > 0, got {d.lease_ttl_s}")
    if d.shard.count < 1:
        raise ConfigError(f"data.shard.count must be >= 1, got {d.shard.count}")
    if not 0 <= d.shard.index < d.shard.count:
        raise ConfigError(
            f"data.shard.index={d.shard.index} is outside [0, data.shard.count={d.shard.count}) "
            "(the defaults come from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT, or JOB_COMPLETION_INDEX / "
            "JOB_COMPLETIONS: use a 0-based array such as --array=0-15, completions equal to JOB_COMPLETIONS, "
            "or set data.shard.index / data.shard.count)"
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


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "0": "\0", "'": "'", '"': '"'}
_ESCAPE_RE = re.compile(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)", re.DOTALL)


def decode_escapes(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r``, ``\\0``, ``\\xHH``, ``\\uHHHH``, ``\\\\`` and escaped quotes decoded;
    any other backslash is kept as it is (so Windows-like paths and regex-like text survive)."""

    def sub(m: re.Match[str]) -> str:
        e = m.group(1)
        if e[0] in "ux" and len(e) > 1:
            return chr(int(e[1:], 16))
        return _ESCAPES.get(e, m.group(0))

    return _ESCAPE_RE.sub(sub, text)


def _schema_keys(cls: type) -> dict[str, type | None]:
    """Field name → nested dataclass type (None for a leaf) of a config dataclass."""
    out: dict[str, type | None] = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        out[f.name] = type(default) if dataclasses.is_dataclass(default) else None
    return out


def unknown_keys(cfg: Any, schema: dict[str, type | None] | None = None, prefix: str = "") -> list[str]:
    """Dotted keys of a composed config (a DictConfig or a dict) that the job schema does not have, each with
    the closest valid key when there is one: ``data.windw_rows (did you mean data.window_rows?)``."""
    from omegaconf import DictConfig

    if schema is None:  # the groups, and the top-level plain keys (task)
        schema = {**{f.name: None for f in dataclasses.fields(JobConfig)}, **GROUPS}
    out: list[str] = []
    keys = list(cfg.keys()) if isinstance(cfg, (dict, DictConfig)) else []
    for k in keys:
        key = f"{prefix}{k}"
        if not prefix and k == "hydra":  # Hydra's own node, when a caller composed with return_hydra_config
            continue
        if k not in schema:
            close = difflib.get_close_matches(str(k), [str(x) for x in schema], n=1)
            out.append(key + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
            continue
        sub = schema[k]
        if sub is not None:
            node = cfg._get_node(k) if isinstance(cfg, DictConfig) else cfg[k]
            if isinstance(node, (dict, DictConfig)):
                out += unknown_keys(node, _schema_keys(sub), f"{key}.")
    return out


def to_job_config(cfg: Any) -> JobConfig:
    """Convert a composed DictConfig (or a plain dict of groups, or a JobConfig) into a validated JobConfig.

    Each group's dataclass is built here, so its ``__post_init__`` checks run; their ValueErrors become
    ConfigError so the CLI reports them as configuration errors. Keys the schema does not know are rejected
    (ConfigError naming them); ``sampling.stop`` escapes are decoded (see the module docstring).
    """
    if isinstance(cfg, JobConfig):
        job = cfg
    else:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        bad = unknown_keys(cfg)
        if bad:
            raise ConfigError(
                f"unknown configuration key{'s' if len(bad) > 1 else ''}: {', '.join(bad)} "
                "(batchgen --help lists every key)"
            )
        try:
            if OmegaConf.get_type(cfg) is not JobConfig:  # composed without the schema: type it now
                cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), cfg)
        except OmegaConfBaseException as e:
            raise ConfigError(str(e)) from e
        job = JobConfig(**{name: _group_checked(name, OmegaConf.to_object, cfg[name]) for name in GROUPS})
        if job.sampling.stop:
            stop = [job.sampling.stop] if isinstance(job.sampling.stop, str) else job.sampling.stop
            job.sampling.stop = [decode_escapes(s) for s in stop]
        job.task = str(cfg.get("task", "generate"))
    validate(job)
    if job.model.lora_modules and not job.engine.enable_lora:  # adapters named: the engine serves them
        job.engine = dataclasses.replace(job.engine, enable_lora=True)
    return job
