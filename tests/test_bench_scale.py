"""The scale benchmark runs (tiny sizes, not timed): planning over many files reports its figures, commits
report their cost."""

from __future__ import annotations

from batchgen.bench import scale


def test_scale_bench_runs_small(capsys):
    assert (
        scale.main(["--skip", "first-token", "--files", "3", "--rows-per-file", "1000", "--commits", "5",
                    "--roll-windows", "3", "--roll-window-mib", "0.1"])
        == 0
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "planning 3,000 rows in 3 files (3 windows, 3 to do)" in out, out
    assert "commit cost: first 5 commits" in out, out
    assert "part roll: 3 windows of 0.1 MiB of text into one part" in out, out
