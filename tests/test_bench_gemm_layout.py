"""The GEMM layout table of `batchgen.bench.model_impls --gemm-layout` (not timed: figures live in
BENCHMARKS.md)."""

from __future__ import annotations

from batchgen.bench import model_impls
from batchgen.kernels import cpu_linear
from batchgen.models.packed_linear import onednn_available


def test_table_has_a_cell_per_shape_and_row_count_for_each_layout() -> None:
    table = model_impls.bench_gemm_layout(reps=1, rows=(1, 8), shapes=((16, 8), (32, 16)))
    lines = table.splitlines()
    assert lines[0] == "| weight [out, in] | 1 rows | 8 rows |" and len(lines) == 4
    for line, shape in zip(lines[2:], ("[16, 8]", "[32, 16]")):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == shape
        for cell in cells[1:]:
            ratios = cell.split(" / ")
            assert len(ratios) == 1 + onednn_available() + cpu_linear.available()
            assert all(r.endswith("×") and float(r[:-1]) > 0 for r in ratios)
