"""A stand-in for vLLM's CPU build in the benchmarks' tests: an interpreter whose ``vllm`` package "generates"
greedily the prompt's last token + 1, + 2, ... (mod 100), refuses to start on a model path containing
``refused`` and hangs on one containing ``hangs-forever``."""

import stat
import sys
from pathlib import Path

FAKE_VLLM = '''
"""A stand-in for vllm: greedy "generation" = the prompt's last token + 1, + 2, ... (mod 100)."""
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids, cached):
        self.outputs = [_Completion(token_ids)]
        self.num_cached_tokens = cached


class LLM:
    kwargs = None

    def __init__(self, **kwargs):
        if "refused" in kwargs["model"]:  # vLLM refusing a checkpoint: the root cause in a worker's log line
            import sys

            print("(Worker pid=7) ERROR 01-01 00:00:00 [x.py:1] ValueError: no kernel for this format:", file=sys.stderr)
            raise RuntimeError("Engine core initialization failed. See root cause above.")
        if "hangs-forever" in kwargs["model"]:
            import time

            time.sleep(600)
        LLM.kwargs = kwargs
        self.seen = set()

    def reset_prefix_cache(self):
        self.seen = set()

    def generate(self, prompts, params, use_tqdm=True):
        if not isinstance(params, list):
            params = [params] * len(prompts)
        outs = []
        for p, sp in zip(prompts, params):
            ids = p["prompt_token_ids"]
            cached = 16 if tuple(ids[:16]) in self.seen and len(ids) > 16 else 0
            self.seen.add(tuple(ids[:16]))
            outs.append(_Output([(ids[-1] + i + 1) % 100 for i in range(sp.max_tokens)], cached))
        return outs
'''


def fake_vllm_interpreter(tmp_path: Path) -> Path:
    """An executable that runs this Python with a fake ``vllm`` package (and nothing of batchgen's) on its path."""
    pkg = tmp_path / "fakepkgs" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    exe = tmp_path / "venv" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{pkg.parent}" exec "{sys.executable}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe
