"""The error that ends a job before any work: an invalid configuration, input or output directory.

Every layer raises :class:`ConfigError` (or a subclass) for a problem the user must fix; the job returns it as
exit status 2 with the message, which names the offending key, file or directory.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration or input, detected before any work; the CLI exits with status 2."""
