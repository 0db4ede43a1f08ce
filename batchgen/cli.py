"""``batchgen``: the command line (Hydra app over :func:`batchgen.job.run.run_job`).

    batchgen data.input=prompts.parquet data.output=out/ model.path=/ckpt sampling.max_tokens=256
    batchgen --help        # every option with its documentation
    batchgen --cfg job     # the resolved configuration

Exit status (README's table): 0 done (or nothing left to do); 3 done, but more error rows than
``run.max_error_fraction``; 75 incomplete — interrupted by SIGINT/SIGTERM/SIGUSR1 (start-up included), the
disk is full or a tensor-parallel rank was lost — rerun to resume; 2 invalid configuration, input or output
directory (one line, before any work where it can be detected), a misspelt key or a value of the wrong type
included; 1 anything else, including Hydra's own errors.
No Python traceback unless ``HYDRA_FULL_ERROR=1`` (or ``BATCHGEN_DEBUG=1``). The job never changes the working
directory; Hydra's run files go to ``<output>/_logs/<timestamp>/`` (per shard; for a results file
``results.jsonl``, into its bookkeeping directory ``_results.jsonl.batchgen/_logs/``).

In a multirun (``-m``, e.g. the submitit launchers) each job writes its status into its Hydra job directory
(:data:`~batchgen.data.layout.STATUS_NAME`); when the sweep is over,
:class:`~batchgen.job.hydra_setup.MultirunStatus` (a Hydra callback)
collects them, the command prints one line per job that did not complete and exits with the status of the
first of them.
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    sys.stderr.write(
        f"batchgen: stopped by {name} during start-up; nothing was written: rerun the same command\n"
    )
    os._exit(75)


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

_ARGV0 = sys.argv[0] if sys.argv else ""
if os.path.basename(_ARGV0) in ("batchgen", "cli.py") or _ARGV0.endswith(
    os.path.join("batchgen", "__main__.py")
):  # the console script, ``python -m batchgen.cli`` or ``python -m batchgen``
    # Run as the command (not imported): a signal while the imports below load is one line and exit 75, not a
    # traceback; main() hands SIGINT back to Python (KeyboardInterrupt, handled there) and the job's handlers.
    for _name in STOP_SIGNALS:
        if hasattr(signal, _name):
            signal.signal(getattr(signal, _name), _interrupted_while_starting)

import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from batchgen.data.layout import STATUS_NAME  # noqa: E402
from batchgen.job.cli_args import override_problem, single_strings_as_lists, wants_version  # noqa: E402
from batchgen.job.hydra_setup import MULTIRUN_FAILURES, register_configs, register_resolvers  # noqa: E402
from batchgen.job.result import EXIT_CONFIG  # noqa: E402
from batchgen.job.shard_env import missing_count_message  # noqa: E402
from batchgen.runtime import startup_trace  # noqa: E402

register_configs()
register_resolvers()

EXIT_INTERRUPTED = 75


class JobFailed(RuntimeError):
    """A job of a multirun ended without completing (``exit_code`` says how). Kept for callers that catch it;
    batchgen itself reports multirun failures through :class:`~batchgen.job.hydra_setup.MultirunStatus`."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@hydra.main(config_path="pkg://batchgen.conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> int:
    """Run one job; exits the process with the job's status (in a multirun: records it, see the module doc).
    Any error escaping the job is one line without secrets, never Hydra's echo of the overrides."""
    try:
        return _job_main(cfg)
    except Exception as e:  # noqa: BLE001 - Hydra would print every override, secrets included
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("BATCHGEN_DEBUG") == "1":
            raise
        from batchgen.job.redact import job_secrets, scrub_text

        line = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        print(f"batchgen: failed: {scrub_text(line, job_secrets(cfg))}", file=sys.stderr)
        sys.exit(1)


def _job_main(cfg: DictConfig) -> int:
    startup_trace.mark("config")
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from batchgen.job.redact import scrub_hydra_record, scrub_text, secret_values
    from batchgen.job.run import EXIT_CONFIG, run_job

    scrub_hydra_record(cfg)
    result = run_job(cfg)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if not multirun:  # the job is over: a signal during Hydra's teardown cannot change its status to 143/138
        ignore_stop_signals()
    startup_trace.mark("done")
    if multirun:
        hc = HydraConfig.get()
        status = {
            "num": hc.job.num,
            "overrides": scrub_text(" ".join(hc.overrides.task), secret_values(cfg))
            .replace("\\{", "{")
            .replace("\\}", "}")
            .replace("\\:", ":"),
            "exit_code": result.exit_code,
            "status": result.status,
            "message": result.message.splitlines()[0] if result.message else "",
            "output_dir": result.output_dir,
        }
        try:
            (Path(hc.runtime.output_dir) / STATUS_NAME).write_text(json.dumps(status) + "\n")
        except OSError:
            pass
        return result.exit_code
    if result.exit_code != 0:
        if result.exit_code == EXIT_CONFIG and HydraConfig.initialized():
            _remove_run_dir(HydraConfig.get().runtime.output_dir)
        sys.exit(result.exit_code)
    return result.exit_code


def ignore_stop_signals() -> None:
    """Ignore SIGINT, SIGTERM and SIGUSR1 from now on: the job has ended, and the process exits with its status
    (0 for a complete output) whatever signal arrives while it shuts down."""
    for name in STOP_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def _remove_run_dir(run_dir: str) -> None:
    """After a configuration error, remove the log directory Hydra just created (and parents left empty).

    Only Hydra's own files are expected there (``.hydra/``, ``batchgen.log``); anything else keeps it.
    """
    import shutil

    p = Path(run_dir).resolve()
    cwd = Path.cwd().resolve()
    if not p.is_dir() or p == cwd or p in cwd.parents:
        return
    if any(c.name not in (".hydra", "batchgen.log") for c in p.iterdir()):
        return
    logging.shutdown()  # close the log file handler before deleting its file
    shutil.rmtree(p, ignore_errors=True)
    # <output>[/shard-...]/logs/<time>: remove the parents this run created, if now empty.
    for parent in list(p.parents)[:3]:
        if parent == cwd or parent in cwd.parents:
            break
        try:
            parent.rmdir()  # only succeeds when empty
        except OSError:
            break


def assign_lora_modules(args: list[str]) -> list[str]:
    """``model.lora_modules={name: path, ...}`` (or ``model.lora_modules.name=path``) as ``+model.lora_modules...``:
    Hydra would merge the mapping key by key into the empty default, which its struct mode refuses for new keys;
    ``+`` assigns it, as the user means."""
    lora = ("model.lora_modules=", "model.lora_modules.")
    return ["+" + a if a.startswith(lora) else a for a in args]


def _schema() -> DictConfig:
    """The typed root config (the ConfigStore's ``batchgen_schema``) that overrides are checked against."""
    from hydra.core.config_store import ConfigStore

    return ConfigStore.instance().load("batchgen_schema.yaml").node


def main() -> None:
    """Console entry point (``batchgen``). ``--cfg job`` prints the config with interpolations resolved."""
    startup_trace.mark("imports")
    argv = sys.argv[1:]
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and os.environ.get("RANK", "0") != "0":
        # torchrun / srun: a tensor-parallel worker rank
        from batchgen.engine.worker.tp_launch import serve_from_env

        sys.exit(serve_from_env())
    if wants_version(argv):
        import batchgen

        print(f"batchgen {batchgen.__version__}")
        sys.exit(0)
    sys.argv[1:] = argv = single_strings_as_lists(argv)
    if argv[:1] == ["show"]:
        from batchgen.job.show import main as show_main

        sys.exit(show_main(argv[1:]))
    if ("--cfg" in argv or "-c" in argv or "--cfg=job" in argv) and "--resolve" not in argv:
        i = argv.index("--cfg") if "--cfg" in argv else argv.index("-c") if "-c" in argv else -1
        if argv[i + 1 : i + 2] == ["job"] or "--cfg=job" in argv:
            sys.argv.append("--resolve")
    problem = missing_count_message()
    if problem and not any(a.lstrip("+").startswith("data.shard.count=") for a in argv):
        print(f"batchgen: {problem}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    problem = override_problem(argv, _schema())
    if problem:
        print(f"batchgen: {problem}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    sys.argv[1:] = assign_lora_modules(sys.argv[1:])
    MULTIRUN_FAILURES.clear()
    # A log file on a full or vanished disk must not print a traceback per log record: the job reports the
    # problem itself, in one line.
    logging.raiseExceptions = False
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        hydra_main()
    except KeyboardInterrupt:
        print(
            "batchgen: interrupted during start-up; nothing was written: rerun the same command",
            file=sys.stderr,
        )
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit:
        ignore_stop_signals()  # the job is over: a signal now cannot change its status to 130/143
        raise
    if MULTIRUN_FAILURES:
        for num, overrides, code, message in MULTIRUN_FAILURES:
            print(f"batchgen: job {num} ({overrides}) exited with status {code}: {message}", file=sys.stderr)
        sys.exit(MULTIRUN_FAILURES[0][2])


if __name__ == "__main__":
    main()
