"""What a job run ends with: :class:`JobResult` and the exit statuses (README's table; see :mod:`.run`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_TOO_MANY_ERRORS = 3
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: incomplete (a signal, a full disk), rerun to resume


@dataclass
class JobResult:
    """What a job run ended with; ``exit_code`` is the CLI's exit status."""

    exit_code: int
    status: str  # "complete" | "incomplete" | "failed" | "error"
    output_dir: str
    report_path: str | None = None
    report: dict[str, Any] | None = None
    message: str = ""


def one_line(e: BaseException) -> str:
    """``e``'s message on one line, at most 300 characters (its type's name when it has none)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
