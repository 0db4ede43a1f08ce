"""Errors the job maps to exit statuses: an invalid configuration, input or output directory (`ConfigError`,
exit 2, before any work); a lost tensor-parallel rank (`WorkerLost`, exit 75).

Every layer raises :class:`ConfigError` (or a subclass) for a problem the user must fix; the job returns it as
exit status 2 with the message, which names the offending key, file or directory.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration or input, detected before any work; the CLI exits with status 2."""


class WorkerLost(RuntimeError):
    """A tensor-parallel rank died or stopped answering (a killed process, a failed collective). The engine
    cannot continue; the job saves what is finished and exits 75 (retry: Slurm requeues, a rerun resumes)."""
