"""Deprecated import path of the job configuration: use :mod:`batchgen.job.config` (the schema),
:mod:`batchgen.job.help` (``--help``) and :mod:`batchgen.job.hydra_setup` (Hydra registration).

Kept so that callers written against ``batchgen.config`` (e.g. the benchmarks) keep working.
"""

from batchgen.data.layout import RESERVED_COLUMNS, shard_dir_name
from batchgen.errors import ConfigError
from batchgen.job.config import (
    DTYPES,
    GROUPS,
    PROGRESS_MODES,
    DataOptions,
    JobConfig,
    ModelOptions,
    RunOptions,
    SamplingOptions,
    ShardOptions,
    to_job_config,
    validate,
)
from batchgen.job.help import field_docs, help_template, option_docs, render_options
from batchgen.job.hydra_setup import register_configs, register_resolvers

__all__ = [
    "DTYPES",
    "GROUPS",
    "PROGRESS_MODES",
    "RESERVED_COLUMNS",
    "ConfigError",
    "DataOptions",
    "JobConfig",
    "ModelOptions",
    "RunOptions",
    "SamplingOptions",
    "ShardOptions",
    "field_docs",
    "help_template",
    "option_docs",
    "register_configs",
    "register_resolvers",
    "render_options",
    "shard_dir_name",
    "to_job_config",
    "validate",
]
