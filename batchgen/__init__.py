"""batchgen: offline batch inference for LLMs over a paged-attention engine.

``batchgen.LLM(model).generate(prompts, batchgen.SamplingParams(...))`` for the Python API;
the ``batchgen`` command for Parquet-to-Parquet jobs.
"""

from __future__ import annotations

__version__ = "0.1.0"


def _stop_while_starting() -> None:
    """Run as the ``batchgen`` command: SIGINT, SIGTERM and SIGUSR1 from the first instant are one line and exit
    75 (retry), never a traceback or 130/143/138; the job's own handlers replace these once it runs."""
    import os
    import signal
    import sys

    argv = list(getattr(sys, "orig_argv", sys.argv))
    if not (os.path.basename(sys.argv[0] if sys.argv else "") == "batchgen" or "batchgen.cli" in argv):
        return

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        sys.stderr.write(
            f"batchgen: stopped by {name} during start-up; nothing was written: rerun the same command\n"
        )
        os._exit(75)

    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), stop)


_stop_while_starting()

from batchgen.runtime import threads as _threads  # noqa: E402  (no torch: imports only os and sys)

_threads.prepare()  # before torch loads OpenMP: its wait policy can only be chosen now (batchgen/runtime/threads.py)

__all__ = [
    "LLM",
    "SamplingParams",
    "EngineConfig",
    "LoRARequest",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]


def __getattr__(name: str):
    # Lazy: `import batchgen` stays cheap (no torch import) for the CLI's --help and config errors.
    if name == "LLM":
        from batchgen.llm import LLM

        return LLM
    if name == "SamplingParams":
        from batchgen.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from batchgen.lora_request import LoRARequest

        return LoRARequest
    if name in ("TextPrompt", "TokensPrompt"):
        from batchgen import prompt_inputs

        return getattr(prompt_inputs, name)
    if name == "EngineConfig":
        from batchgen.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
