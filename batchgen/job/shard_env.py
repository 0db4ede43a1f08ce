"""The shard defaults from the scheduler's environment: a Slurm job array or a Kubernetes Indexed Job.

``data.shard.index`` / ``data.shard.count`` default (``conf/config.yaml``: ``${batchgen.shard_env:index}``)
to, in order:

- a Slurm job array: ``$SLURM_ARRAY_TASK_ID`` / ``$SLURM_ARRAY_TASK_COUNT`` (0-based arrays: ``--array=0-N``);
- a Kubernetes Indexed Job: ``$JOB_COMPLETION_INDEX`` (set by Kubernetes in every pod) / ``$JOB_COMPLETIONS``
  (set in the pod template to the Job's ``completions``: Kubernetes does not export it), so pod i of N
  processes shard i of N exactly like array task i of N;
- otherwise 0 / 1.

Inside a submitit job the Slurm variables describe the Hydra sweep, not the shards: they are ignored there.
A pod with ``$JOB_COMPLETION_INDEX`` but no ``$JOB_COMPLETIONS`` is refused (every pod would otherwise take
the whole input).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SLURM = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
KUBERNETES = ("JOB_COMPLETION_INDEX", "JOB_COMPLETIONS")


def shard_from_env(which: str, environ: Mapping[str, str] | None = None) -> int:
    """``which`` ('index' or 'count') of this task's shard from the environment (module docstring)."""
    env = os.environ if environ is None else environ
    if which not in ("index", "count"):
        raise ValueError(f"batchgen.shard_env: expected 'index' or 'count', got {which!r}")
    i = 0 if which == "index" else 1
    if SLURM[0] in env and not env.get("SUBMITIT_EXECUTOR"):
        return int(env.get(SLURM[i], (0, 1)[i]))
    if KUBERNETES[0] in env:
        if which == "count" and KUBERNETES[1] not in env:
            raise ValueError(missing_count_message(env))
        return int(env[KUBERNETES[i]])
    return (0, 1)[i]


def missing_count_message(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this environment cannot give the shard count (a pod of an Indexed Job without ``$JOB_COMPLETIONS``),
    or None."""
    env = os.environ if environ is None else environ
    if (
        KUBERNETES[0] not in env
        or KUBERNETES[1] in env
        or (SLURM[0] in env and not env.get("SUBMITIT_EXECUTOR"))
    ):
        return None
    return (
        f"${KUBERNETES[0]} is set (a Kubernetes Indexed Job) but ${KUBERNETES[1]} is not: set it in the pod "
        "template to the Job's completions (or pass data.shard.count=N)"
    )
