"""The image-text benchmark's bookkeeping (batchgen.bench.vision), without running a model."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL", reason="the image-text benchmark needs the vision extra (Pillow)")

from batchgen.bench.vision import VllmPeer, _summary, workload  # noqa: E402


def test_figures_are_medians_over_the_repeats_with_every_run_beside():
    runs = [
        {"wall_s": w, "cpu_s": c, "loadavg": [load, load]}
        for w, c, load in [(2.0, 1.0, 3), (1.0, 4.0, 2), (4.0, 2.0, 1)]
    ]
    s = _summary(runs, gen=64, images=4)
    assert (s["wall_s"], s["cpu_s"], s["wall_s_runs"], s["loadavg_runs"]) == (
        2.0,
        2.0,
        [2.0, 1.0, 4.0],
        [3, 2, 1],
    )
    assert (s["gen_tok_s"], s["gen_tok_per_cpu_s"], s["images_s"]) == (32.0, 32.0, 2.0)


def test_vqa_rows_ask_each_image_k_questions_and_a_missing_vllm_is_left_out(tmp_path):
    rows = workload("vqa", [b"a", b"b"], 3, seed=0)
    assert len(rows) == 6 and sorted(img for _, img in rows) == [b"a"] * 3 + [b"b"] * 3
    assert len(workload("caption", [b"a", b"b"], 3, seed=0)) == 2
    peer = VllmPeer(str(tmp_path / "no-python"), "unused", {}, 4, tmp_path)
    assert not peer.ok and peer.start["status"] == "skipped" and "no interpreter" in peer.start["reason"]
    peer.close()
