"""kill -9 at each step of a commit on a local disk: after the window (or the rolled part) is written, before,
during and after its commit record, during the compaction of the manifest, and before the report. The rerun ends
with the uninterrupted run's output, each row exactly once, a report counting every row and no temporary file
left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import env_without_slurm, job_config, part_contents

from batchgen.job.run import EXIT_OK, run_job

OVER = {"data": {"window_rows": 3}, "sampling": {"max_tokens": 3}}

SCRIPT = textwrap.dedent(
    """
    import os, re, signal, sys
    sys.path.insert(0, {tests!r})
    from conftest import job_config
    from batchgen.data.local_storage import LocalLocation
    from batchgen.job.run import run_job

    real, seen = LocalLocation.put_stream, [0]  # every write (put writes through it)

    def put(self, name, write, **kw):
        hit = re.search({pattern!r}, str(self.dir / name)) is not None
        seen[0] += hit
        if hit and seen[0] == {nth} and {when!r} == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and seen[0] == {nth} and {when!r} == "during":  # the temporary file written, not yet its name
            inner = write
            write = lambda f: (inner(f), os.kill(os.getpid(), signal.SIGKILL))
        out = real(self, name, write, **kw)
        if hit and seen[0] == {nth} and {when!r} == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    LocalLocation.put_stream = put
    run_job(job_config({ckpt!r}, {inp!r}, {out!r}, **{over!r}), handle_signals=False, print_summary=False)
    """
)


@pytest.fixture(scope="module")
def reference(llama_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("killref")
    pq.write_table(
        pa.table({"prompt": [f"Row {i}: a {'b ' * (i % 3)}c" for i in range(9)]}), root / "in.parquet"
    )
    cfg = job_config(llama_ckpt, root / "in.parquet", root / "out", **OVER)
    assert run_job(cfg, handle_signals=False, print_summary=False).exit_code == EXIT_OK
    return root, part_contents(root / "out")


@pytest.mark.slow
@pytest.mark.parametrize(
    "pattern,nth,when",
    [
        (r"_windows/part-000001\.arrow$", 1, "after"),  # the window is written, no record names it
        (r"/part-000000\.parquet$", 1, "after"),  # the part is rolled, no record names it
        (r"_commits/\d+\.json$", 3, "before"),  # the 2nd window's record never written
        (r"_commits/\d+\.json$", 3, "during"),  # the record's temporary file written, never named
        (r"_commits/\d+\.json$", 3, "after"),  # the record written, the job never knew
        (r"_manifest\.json$", 2, "before"),  # the compaction when the job closes
        (r"_report\.json$", 1, "before"),  # every row committed, no report yet: the rerun has nothing to do
    ],
)
def test_kill_9_at_a_commit_step(
    llama_ckpt: str, reference, tmp_path: Path, pattern: str, nth: int, when: str
) -> None:
    root, expected = reference
    out = tmp_path / "out"
    script = SCRIPT.format(
        tests=str(Path(__file__).parent), pattern=pattern, nth=nth, when=when, ckpt=llama_ckpt,
        inp=str(root / "in.parquet"), out=str(out), over=OVER,
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env_without_slurm(), capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    res = run_job(
        job_config(llama_ckpt, root / "in.parquet", out, **OVER), handle_signals=False, print_summary=False
    )
    assert res.exit_code == EXIT_OK, res.message
    assert part_contents(out) == expected  # rows lost 0, rows duplicated 0
    report = json.loads((out / "_report.json").read_text())
    assert report["status"] == "complete" and report["rows"]["done"] == report["rows"]["ok"] == 9, report
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_relative_to(out / "_logs"))
    assert left == [".batchgen.lock", "_layout.json", "_manifest.json", "_report.json", *expected], left
    res = run_job(
        job_config(llama_ckpt, root / "in.parquet", out, **OVER), handle_signals=False, print_summary=False
    )
    assert res.exit_code == EXIT_OK and "nothing to do" in res.message, res.message
