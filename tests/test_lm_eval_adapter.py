"""batchgen's lm-evaluation-harness adapter against lm-eval's own ``hf`` backend on a tiny checkpoint, with
local tasks (YAML + JSONL written here; no network): same metrics, per-request log-likelihoods within 1e-4,
identical greedy generations; batchgen's time vs hf's is printed (run with ``-s`` to see the ratio)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'batchgen[eval]')")
pytest.importorskip(
    "accelerate", reason="lm-eval's hf backend needs accelerate (pip install 'batchgen[eval]')"
)

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

WORDS = "the cat dog sat ran on a mat log red blue big small house tree river over under".split()


def write_tasks(root: Path) -> list[str]:
    import random

    rng = random.Random(0)
    mc, gen, ppl = [], [], []
    for i in range(24):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
        # Many continuations of one shared context: what prefix caching makes cheap.
        mc.append(
            {
                "question": f"Question {i % 3}: the long shared preamble of the test. {q}",
                "choices": [
                    " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(4)
                ],
                "answer": rng.randint(0, 3),
            }
        )
        gen.append({"question": q, "target": rng.choice(WORDS)})
        ppl.append({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 90)))})
    common = "test_split: test\n"
    for name, rows, body in [
        (
            "bg_mc",
            mc,
            "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        ),
        (
            "bg_gen",
            gen,
            "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{target}}'\n"
            "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n",
        ),
        (
            "bg_ppl",
            ppl,
            "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        ),
    ]:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n{common}{body}"
        )
    return ["bg_mc", "bg_gen", "bg_ppl"]


def timed(model) -> dict[str, float]:
    """Time the model's own request methods (not lm-eval's task building and metrics around them)."""
    times: dict[str, float] = {}
    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        method = getattr(model, name)

        def wrapper(requests, *a, _m=method, _n=name, **kw):
            t0 = time.perf_counter()
            try:
                return _m(requests, *a, **kw)
            finally:
                times[_n] = times.get(_n, 0.0) + time.perf_counter() - t0

        setattr(model, name, wrapper)
    return times


def run(model, tasks, tm):
    times = timed(model)
    res = simple_evaluate(model=model, tasks=tasks, task_manager=tm, log_samples=True, bootstrap_iters=0)
    return res, times


def test_adapter_matches_hf_backend(ckpt_factory, tmp_path) -> None:
    from lm_eval.models.huggingface import HFLM

    from batchgen.lm_eval_adapter import BatchgenLM

    ckpt = ckpt_factory("llama", max_position_embeddings=256)
    tasks = write_tasks(tmp_path)
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    # The same max_length for both (batchgen's default is the engine's max_model_len - 2).
    hf = HFLM(pretrained=ckpt, device="cpu", dtype="float32", batch_size=8, max_length=254)
    bg = BatchgenLM(pretrained=ckpt, device="cpu", dtype="float32", num_blocks=512, max_num_seqs=32)
    assert bg.max_length == 254
    res_bg, times_bg = run(bg, tasks, tm)
    res_hf, times_hf = run(hf, tasks, tm)
    for name in times_hf:
        a, b = times_bg[name], times_hf[name]
        print(f"\n{name}: hf {b:.2f}s, batchgen {a:.2f}s, speed-up {b / a:.2f}x", end="")
    t_bg, t_hf = sum(times_bg.values()), sum(times_hf.values())
    print(f"\nlm-eval requests on {tasks}: hf {t_hf:.2f}s, batchgen {t_bg:.2f}s, speed-up {t_hf / t_bg:.2f}x")
    for task in tasks:
        a, b = res_bg["results"][task], res_hf["results"][task]
        for key, v in b.items():
            if isinstance(v, float) and "stderr" not in key:
                assert a[key] == pytest.approx(v, rel=1e-4, abs=1e-6), (task, key)
        sa = sorted(res_bg["samples"][task], key=lambda s: s["doc_id"])
        sb = sorted(res_hf["samples"][task], key=lambda s: s["doc_id"])
        assert len(sa) == len(sb) > 0
        for x, y in zip(sa, sb):
            for ra, rb in zip(x["resps"], y["resps"]):
                ra, rb = ra[0], rb[0]
                if task == "bg_gen":
                    assert ra == rb  # identical greedy generations
                elif task == "bg_mc":
                    assert ra[0] == pytest.approx(rb[0], abs=1e-4) and ra[1] == rb[1]
                else:  # a document's sum over hundreds of tokens: hf sums in float32, batchgen in float64
                    assert ra == pytest.approx(rb, rel=1e-6, abs=1e-4)
    if os.environ.get("BATCHGEN_ASSERT_SPEEDUP"):  # timings on a shared, loaded CPU are noise: opt in
        assert t_bg < t_hf, f"batchgen {t_bg:.2f}s is not faster than hf {t_hf:.2f}s"
