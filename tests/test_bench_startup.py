"""The start-up benchmark runs (one repetition, not timed): every phase marker comes out, in order, and the
import offenders are listed."""

from __future__ import annotations

from batchgen.bench import startup


def test_startup_bench_runs_once(capsys):
    assert (
        startup.main(
            ["--runs", "1", "--warmup", "0", "--top", "3", "sampling.max_tokens=2", "data.window_rows=8"]
        )
        == 0
    )
    out = capsys.readouterr().out
    seconds = []
    for phase in startup.ALL_PHASES:
        line = next(line for line in out.splitlines() if line.startswith(phase + " "))
        assert "no marker" not in line, out
        seconds.append(float(line.split()[1]))  # the median
    assert seconds == sorted(seconds) and seconds[0] > 0, out
    assert "imports costing most" in out
    assert out.split("module\n", 1)[1].strip(), out  # some import listed
