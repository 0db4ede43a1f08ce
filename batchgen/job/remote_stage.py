"""``batchgen-merge`` and ``batchgen show`` on an object-store output (``s3://...``): the shards' manifests and
the parts they list are copied into a local temporary directory of the same layout, which the local code then
reads; a merged file meant for a URL is written locally and put as one object (atomic)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from batchgen.data.commit_log import read_state
from batchgen.data.layout import MANIFEST_NAME, SHARD_RE
from batchgen.data.storage import Location


@contextlib.contextmanager
def staged_output(url: str) -> Iterator[Path]:
    """A local copy of the job output at `url` (manifests and the parts they list; leftovers are not copied)."""
    root = Location(url, key="output")
    with tempfile.TemporaryDirectory(prefix="batchgen-stage-") as tmp:
        local = Path(tmp) / "output"
        local.mkdir()
        subs = [""] + [d for d in root.list_dirs() if SHARD_RE.match(d)]
        for sub in subs:
            loc = root.child(sub)
            m = read_state(loc)[0]  # the manifest with any commit record after it applied
            if m is None:
                continue
            d = local / sub if sub else local
            d.mkdir(exist_ok=True)
            (d / MANIFEST_NAME).write_text(m.to_json())
            for part in m.parts:  # the rolled parts (windows not rolled yet are no dataset's rows)
                data = loc.read_bytes(part.name)
                if data is not None:
                    (d / part.name).write_bytes(data)
        yield local


def put_file(path: str | Path, url: str) -> None:
    """Upload local file `path` as the object `url` in one PUT."""
    parent, name = url.rstrip("/").rsplit("/", 1)
    Location(parent, key="--write").put(name, Path(path).read_bytes())
