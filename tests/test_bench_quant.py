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
