"""`batchgen.bench.quant`'s timed run: with ``--drain`` the prompts' KV blocks come from the prefix cache, so
the timed run decodes; without it the prompts are computed in the timed run."""

from __future__ import annotations

import argparse

import pytest

from batchgen.bench.quant import add_model_args, bench_model, generate_run


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    args = argparse.Namespace(hidden=64, layers=1)
    return bench_model(tmp_path_factory.mktemp("quant-bench"), args)


@pytest.mark.parametrize("drain", [False, True])
def test_drain_times_decoding_over_cached_prompts(model, drain):
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--prompt", "40", "--new", "3"] + (["--drain"] if drain else []))
    run = generate_run(model, 3, args, kv_cache_memory="16MiB")
    assert [len(t) for t in run.tokens] == [3, 3, 3]
    # 40-token prompts in 16-token blocks: two full blocks each are reusable
    assert run.cached_prompt_tokens == (3 * 32 if drain else 0)
    assert run.row("x", 3)["cached_prompt_tokens"] == run.cached_prompt_tokens


def test_the_cpu_gemm_benchmark_times_every_kind_against_another_build(tmp_path):
    """``bench.quant_gemm_cpu`` on a small projection, timing the current build against itself: every kind and
    float32 get a time, and the two builds' results are compared."""
    import json

    pytest.importorskip("gguf", reason="the gguf package writes the benchmark's Q4_0 / Q8_0 weights")
    from batchgen.bench import quant_gemm_cpu
    from batchgen.kernels import cpu_kernel

    lib = cpu_kernel.library()
    if lib is None:
        pytest.skip("the C kernels are unavailable here")
    out = tmp_path / "gemm.json"
    argv = [
        "--rows",
        "1,4",
        "--n",
        "48",
        "--k",
        "256",
        "--repeats",
        "1",
        "--against",
        lib._name,
        "--json",
        str(out),
    ]
    assert quant_gemm_cpu.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 4]
    for r in results:
        kinds = {"float32", *quant_gemm_cpu.KINDS, *(f"{k} (--against)" for k in quant_gemm_cpu.KINDS)}
        assert set(r["ms"]) == kinds and all(ms > 0 for ms in r["ms"].values())


def test_the_cpu_gemm_benchmark_times_the_formats_asked_for(tmp_path):
    import json

    pytest.importorskip("gguf", reason="the gguf package names the benchmark's formats")
    from batchgen.bench import quant_gemm_cpu
    from batchgen.kernels import cpu_kernel

    if cpu_kernel.library() is None:
        pytest.skip("the C kernels are unavailable here")
    out = tmp_path / "gemm.json"
    argv = [
        "--rows",
        "2",
        "--n",
        "40",
        "--k",
        "256",
        "--repeats",
        "1",
        "--kinds",
        "IQ4_XS,IQ4_NL",
        "--json",
        str(out),
    ]
    assert quant_gemm_cpu.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert set(r["ms"]) == {"float32", "IQ4_XS", "IQ4_NL"} and all(ms > 0 for ms in r["ms"].values())
    with pytest.raises(SystemExit):
        quant_gemm_cpu.main(["--kinds", "IQ2_XXS"])
