"""What Hydra is told about the job: the ConfigStore entries behind ``conf/config.yaml`` and two resolvers.

ConfigStore: ``batchgen_schema`` (:class:`~batchgen.job.config.JobConfig`, the typed root), one option per
group (``model=tiny``, ``data=default``, ``engine=default``, ``sampling=default`` / ``greedy``,
``run=default``) and ``hydra/help=batchgen`` (the ``--help`` text of :mod:`batchgen.job.help`).

Resolvers: ``${batchgen.shard_dir:output,index,count}`` (a shard's output directory, used by
``hydra.run.dir``; beside a results file, never at its name, see :func:`log_parent`; a directory under the
system's temp dir when the output cannot hold Hydra's log files, see
:func:`usable_log_root`), ``${batchgen.sweep_root:}`` (where a multirun's logs go, used by ``hydra.sweep.dir``) and
``${batchgen.shard_env:index|count}`` (the shard defaults from a Slurm job array or a Kubernetes Indexed Job,
:mod:`batchgen.job.shard_env`). The registrations are
idempotent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from batchgen.data.layout import STATUS_NAME, shard_dir_name
from batchgen.engine.config import EngineConfig
from batchgen.job.config import DataOptions, JobConfig, ModelOptions, RunOptions, default_sampling
from batchgen.job.help import HELP_FOOTER, HELP_HEADER, help_template
from batchgen.job.shard_env import shard_from_env


def _open_storage_options(node: Any, group: str | None) -> Any:
    """`node` with ``data.storage_options`` out of struct mode, so that its (store-specific) keys are set like
    any other key (``data.storage_options.endpoint_url=...``, ``data.storage_options={key: ..}``), not only
    with Hydra's ``+``."""
    from omegaconf import OmegaConf

    OmegaConf.set_struct((node[group] if group else node).storage_options, False)
    return node


def _open_mm_limits(node: Any, group: str | None) -> Any:
    """`node` with ``engine.limit_mm_per_prompt`` and ``engine.mm_processor_kwargs`` out of struct mode (their
    keys are modalities and the processor's options: ``engine.limit_mm_per_prompt={image: 4}``)."""
    from omegaconf import OmegaConf

    engine = node[group] if group else node
    OmegaConf.set_struct(engine.limit_mm_per_prompt, False)
    OmegaConf.set_struct(engine.mm_processor_kwargs, False)
    return node


def register_configs() -> None:
    """Register the schema, group options and the help text in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    schema = _open_storage_options(OmegaConf.structured(JobConfig), "data")
    cs.store(name="batchgen_schema", node=_open_mm_limits(schema, "engine"))
    cs.store(group="model", name="tiny", node=ModelOptions())
    cs.store(
        group="data", name="default", node=_open_storage_options(OmegaConf.structured(DataOptions), None)
    )
    cs.store(group="engine", name="default", node=_open_mm_limits(OmegaConf.structured(EngineConfig), None))
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


LOG_FALLBACK_FREE_BYTES = 1 << 20
"""Hydra's log directory moves to the temp directory when the output's file system has less room than this."""


def usable_log_root(directory: str) -> str:
    """`directory` if Hydra can create its log directory below it; otherwise (under a regular file, not
    writable, read-only, nearly full) a directory under the system's temp dir, so that batchgen itself gets to
    report the problem with the output in one line (exit 2, or 75 for a full disk) instead of Hydra failing
    with a traceback. Never creates anything. An object-store URL (``s3://...``) cannot hold them either: they
    go under the temp dir too."""
    from batchgen.data.storage import is_url

    if is_url(directory):
        return str(fallback_log_root(directory))
    p = Path(directory).absolute()
    existing = next((q for q in [p, *p.parents] if q.exists()), None)
    try:
        ok = (
            existing is not None
            and existing.is_dir()
            and os.access(existing, os.W_OK | os.X_OK)
            and shutil.disk_usage(existing).free >= LOG_FALLBACK_FREE_BYTES
        )
    except OSError:
        ok = False
    return directory if ok else str(fallback_log_root(directory))


def fallback_log_root(directory: str) -> Path:
    """Where :func:`usable_log_root` puts Hydra's logs when `directory` cannot hold them."""
    from batchgen.data.storage import is_url, redact_url

    shown = redact_url(directory) if is_url(directory) else str(Path(directory).absolute())
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", shown.strip("/")) or "root"
    return Path(tempfile.gettempdir()) / "batchgen-logs" / name


def log_parent(output: str) -> str:
    """The directory Hydra's run files go under for the output `output`: the output directory itself, or,
    when the output is one file (an OpenAI batch results file, ``results.jsonl``), the bookkeeping directory
    beside it (``_results.jsonl.batchgen``), so that the file's name is never taken by a directory."""
    from batchgen.job.openai_batch import bookkeeping_dir, is_batch_file

    out = str(output).rstrip("/") or "/"
    return bookkeeping_dir(out) if is_batch_file(out) else out


def _shard_dir_resolver(output: Any, index: Any, count: Any) -> str:
    sub = shard_dir_name(int(index), int(count))
    out = log_parent(str(output))
    return usable_log_root(f"{out}/{sub}" if sub else out)


def _sweep_root_resolver(*, _root_: Any) -> str:
    """``data.output`` — or, when it names a per-job directory with ``${hydra:...}`` (``out/${hydra:job.num}``,
    which the sweep's parent process cannot resolve), the directory above the job part (``out``). The same
    in the parent and in every job, so the jobs' log directories are where the parent looks for them."""
    node = _root_.data._get_node("output") if "data" in _root_ else None
    raw = node._value() if node is not None else None
    if isinstance(raw, str) and "${hydra:" in raw:
        prefix = raw.split("${hydra:", 1)[0]
        root = prefix if prefix.endswith("/") else os.path.dirname(prefix)
        return usable_log_root(root.rstrip("/") or ".")
    return usable_log_root(log_parent(str(_root_.data.output).rstrip("/") or "."))


def register_resolvers() -> None:
    """``${batchgen.shard_dir:${data.output},${data.shard.index},${data.shard.count}}`` (used by hydra.run.dir)
    and ``${batchgen.shard_env:index}`` (the shard defaults)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("batchgen.shard_dir"):
        OmegaConf.register_new_resolver("batchgen.shard_dir", _shard_dir_resolver)
    if not OmegaConf.has_resolver("batchgen.sweep_root"):
        OmegaConf.register_new_resolver("batchgen.sweep_root", _sweep_root_resolver)
    if not OmegaConf.has_resolver("batchgen.shard_env"):
        OmegaConf.register_new_resolver("batchgen.shard_env", shard_from_env)


MULTIRUN_FAILURES: list[tuple[int, str, int, str]] = []
"""(job number, overrides, exit status, first line of the message) of each job of the last multirun (in this
process) that did not complete; filled by :class:`MultirunStatus`, read by :func:`batchgen.cli.main`."""


class MultirunStatus(Callback):
    """Hydra callback (``hydra.callbacks.batchgen_status`` in conf/config.yaml): after a multirun, read the
    status each job wrote into its job directory (:data:`~batchgen.data.layout.STATUS_NAME`, written by
    :func:`batchgen.cli.hydra_main`, also by jobs that ran elsewhere, e.g. on Slurm) and remember the jobs
    that did not complete."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        MULTIRUN_FAILURES.clear()

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        MULTIRUN_FAILURES.clear()
        sweep = Path(str(config.hydra.sweep.dir))
        for f in sorted(sweep.glob(f"*/{STATUS_NAME}"), key=lambda p: (len(p.parent.name), p.parent.name)):
            try:
                st = json.loads(f.read_text())
                code = int(st.get("exit_code", 0))
            except (OSError, ValueError, TypeError):
                continue
            if code != 0:
                MULTIRUN_FAILURES.append((int(st.get("num", -1)), str(st.get("overrides", "")), code,
                                          str(st.get("message", ""))))  # fmt: skip
