"""The batch job: a Parquet input through the engine into a resumable Parquet output.

Modules, in the order a run goes through them:

- :mod:`~batchgen.job.config`: the configuration schema (``model``, ``data``, ``engine``, ``sampling``,
  ``run``) and its validation; :mod:`~batchgen.job.help` renders it as ``batchgen --help``;
  :mod:`~batchgen.job.hydra_setup` registers it with Hydra.
- :mod:`~batchgen.job.plan`: everything decided before the model loads (input, columns, shard, windows,
  fingerprint).
- :mod:`~batchgen.job.run`: :func:`run_job`, the straight line from plan to report; its parts:
  :mod:`~batchgen.job.resume` (what a resumed run still has to do), :mod:`~batchgen.job.windows` (windows read
  into prompts), :mod:`~batchgen.job.early_failure` (stopping a job that cannot succeed before it writes),
  :mod:`~batchgen.job.tally` (counting finished rows), :mod:`~batchgen.job.writer` (parts and checkpoints),
  :mod:`~batchgen.job.finish` (report, exit status, summary) and :mod:`~batchgen.job.result` (``JobResult``,
  the exit statuses).
- :mod:`~batchgen.job.feeder`: prefix grouping and the loop that keeps the engine fed across windows.
- :mod:`~batchgen.job.signals`, :mod:`~batchgen.job.progress`, :mod:`~batchgen.job.report`: stopping on a
  signal, the progress bar or log lines, the end-of-job report.
- :mod:`~batchgen.job.shards`, :mod:`~batchgen.job.merge`, :mod:`~batchgen.job.merge_cli`: after the job,
  ``batchgen-merge`` checks that the shards cover every input row once and merges them.

The Parquet side (reader, prompts, parts, output directory, manifest, file names) is :mod:`batchgen.data`.
"""

from __future__ import annotations

_EXPORTS = {
    "DEFAULT_SAMPLING_COLUMN": "batchgen.data.columns",
    "JobPlan": "batchgen.job.plan",
    "plan_job": "batchgen.job.plan",
    "sample_input_path": "batchgen.job.plan",
    "EXIT_CONFIG": "batchgen.job.run",
    "EXIT_FAILED": "batchgen.job.run",
    "EXIT_INTERRUPTED": "batchgen.job.run",
    "EXIT_OK": "batchgen.job.run",
    "EXIT_TOO_MANY_ERRORS": "batchgen.job.run",
    "JobResult": "batchgen.job.run",
    "run_job": "batchgen.job.run",
    "StopSignal": "batchgen.job.signals",
}
"""Where each name this package exports lives: loaded on first use, so that importing one module of the
package (the command line's argument checks, its ``--help``) does not load the job (pyarrow, the planner)."""


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_SAMPLING_COLUMN",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TOO_MANY_ERRORS",
    "JobPlan",
    "JobResult",
    "StopSignal",
    "plan_job",
    "run_job",
    "sample_input_path",
]
