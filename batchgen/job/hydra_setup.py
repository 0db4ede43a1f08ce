"""What Hydra is told about the job: the ConfigStore entries behind ``conf/config.yaml`` and two resolvers.

ConfigStore: ``batchgen_schema`` (:class:`~batchgen.job.config.JobConfig`, the typed root), one option per
group (``model=tiny``, ``data=default``, ``engine=default``, ``sampling=default`` / ``greedy``,
``run=default``) and ``hydra/help=batchgen`` (the ``--help`` text of :mod:`batchgen.job.help`).

Resolvers: ``${batchgen.shard_dir:output,index,count}`` (a shard's output directory, used by
``hydra.run.dir``) and ``${batchgen.array_env:NAME,default}`` (the shard defaults from a Slurm job array).
Both registrations are idempotent.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from batchgen.data.layout import shard_dir_name
from batchgen.engine.config import EngineConfig
from batchgen.job.config import DataOptions, JobConfig, ModelOptions, RunOptions, default_sampling
from batchgen.job.help import HELP_FOOTER, HELP_HEADER, help_template


def register_configs() -> None:
    """Register the schema, group options and the help text in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="batchgen_schema", node=JobConfig)
    cs.store(group="model", name="tiny", node=ModelOptions())
    cs.store(group="data", name="default", node=DataOptions())
    cs.store(group="engine", name="default", node=EngineConfig())
    cs.store(group="sampling", name="default", node=default_sampling())
    cs.store(group="sampling", name="greedy", node=dataclasses.replace(default_sampling(), temperature=0.0))
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


def _shard_dir_resolver(output: Any, index: Any, count: Any) -> str:
    sub = shard_dir_name(int(index), int(count))
    out = str(output).rstrip("/") or "/"
    return f"{out}/{sub}" if sub else out


def _array_env_resolver(name: str, default: Any = None) -> Any:
    """``$name`` from a Slurm job array, except inside a submitit job: submitit runs every job of a Hydra sweep
    as an array task, so there the array index says which sweep job this is, not which shard to process."""
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
