"""Input-change detection from the store's own versions: when every input object still has the size and the
version (ETag, GCS generation) the manifest recorded, the input is unchanged and a resume need not re-read the
rows of the windows it keeps to hash them (:func:`batchgen.job.resume.verify_skipped_input`)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("batchgen.job")


def input_versions_unchanged(previous: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether `previous` and `current` (``InputSet.describe()``) record the same files with the same sizes and
    versions, every file having a version (local files have none: their rows are hashed instead)."""
    old, new = previous.get("versions"), current.get("versions")
    same = bool(new) and old == new and all(v[1] for v in new.values())
    digest = current.get("versions_sha256")
    same = same or (digest is not None and previous.get("versions_sha256") == digest)
    if same:
        logger.info(
            "input unchanged since the last run: the %d object(s) have the same versions (ETags)",
            current.get("num_files", 0),
        )
    return same
