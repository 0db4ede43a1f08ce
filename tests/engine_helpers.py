"""Helpers for model tests that run the engine: transformers references and an engine with tiny settings.

- `hf_model(path)`: the transformers model (eager attention, float32), memoised.
- `hf_greedy(path, prompts, n)`: transformers `generate` greedy continuations (one left-padded batch, eos
  disabled: exactly `n` new tokens each; compare with the engine's `ignore_eos=True`), memoised.
- `make_llm(path, impl, **engine)`: `LLM` with tiny KV settings.
"""

from __future__ import annotations

from functools import cache

import torch

from batchgen import LLM


@cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    # generate() fills a GenerationConfig's unset fields from the model's: eos must be removed here to be off
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [list(x) for x in _hf_greedy(path, tuple(map(tuple, prompts)), n)]


@cache
def _hf_greedy(path: str, prompts: tuple[tuple[int, ...], ...], n: int) -> tuple[tuple[int, ...], ...]:
    from transformers import GenerationConfig

    model = hf_model(path)
    width = max(map(len, prompts))
    pad = [width - len(p) for p in prompts]
    ids = torch.tensor([[0] * k + list(p) for k, p in zip(pad, prompts)])
    mask = (torch.arange(width)[None] >= torch.tensor(pad)[:, None]).long()
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=gen)
    rows = tuple(tuple(row) for row in out[:, width:].tolist())
    assert out.shape[1] == width + n and all(r[-1] != 0 or 0 not in r[:-1] for r in rows), "stopped early?"
    return rows


def make_llm(path: str, impl: str = "auto", **engine) -> LLM:
    options = dict(block_size=8, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=24)
    options.update(engine)
    return LLM(path, model_impl=impl, **options)


def pad_decodes_on_cpu(monkeypatch, padded: bool = True) -> None:
    """Engines built after this call run the CUDA-graph input layout on the CPU (decode batches padded to
    buckets, a scratch block past the pool): the engine builds a runner subclass that pads, a test fake."""
    if not padded:
        return
    from batchgen.engine.core import llm_engine
    from batchgen.engine.worker.model_runner import ModelRunner

    class PaddingRunner(ModelRunner):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.pad_decodes = True

    monkeypatch.setattr(llm_engine, "ModelRunner", PaddingRunner)
