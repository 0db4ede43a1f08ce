"""The llama.cpp peer of the quantization benchmark: skipped with the reason without a binding; with one
(``$BATCHGEN_LLAMACPP_PYTHON`` or this interpreter), it decodes batchgen's GGUF file greedily in one batch."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.bench import llamacpp_peer, quant

PEER = Path(llamacpp_peer.__file__)


def _spec(tmp_path: Path, **spec) -> tuple[Path, Path]:
    path = tmp_path / "spec.json"
    path.write_text(
        json.dumps({"path": "x.gguf", "prompts": [[5, 6]], "max_tokens": 2, "threads": 1, **spec})
    )
    return path, tmp_path / "result.json"


def test_peer_without_a_binding_is_skipped_with_the_reason(tmp_path) -> None:
    spec, out = _spec(tmp_path)
    # -S: no site-packages, so no llama.cpp binding can be imported
    proc = subprocess.run(
        [sys.executable, "-S", str(PEER), str(spec), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["status"] == "skipped"
    assert "no llama.cpp binding" in res["reason"] and sys.executable in res["reason"]
    args = argparse.Namespace(prompt=4, new=2)
    res = quant.llama_cpp_peer(str(tmp_path / "no-python"), "x.gguf", 2, args, 1)
    assert res == {
        "status": "skipped",
        "reason": f"no interpreter {tmp_path / 'no-python'} (--llamacpp-python)",
    }


def _llamacpp_python() -> str | None:
    """An interpreter with a llama.cpp binding: $BATCHGEN_LLAMACPP_PYTHON, else this one if it has one."""
    python = os.environ.get("BATCHGEN_LLAMACPP_PYTHON")
    if python:
        return python
    return sys.executable if llamacpp_peer.binding()[0] is not None else None


def test_llama_cpp_decodes_batchgens_gguf_file_in_one_batch(llama_ckpt, tmp_path) -> None:
    python = _llamacpp_python()
    if python is None:
        pytest.skip(
            "no llama.cpp binding (pip install batchgen[bench-llamacpp] or set BATCHGEN_LLAMACPP_PYTHON)"
        )
    from batchgen import LLM, SamplingParams
    from batchgen.models.quant.gguf_writer import write_gguf

    path = write_gguf(llama_ckpt, tmp_path / "q8.gguf", 8, output_type=8)  # Q8_0
    prompts = [[1, 17, 33, 90], [1, 200, 5, 9, 77, 31, 8], [1, 64], [3, 3, 3]]
    spec, out = _spec(tmp_path, path=path, prompts=prompts, max_tokens=6)
    proc = subprocess.run(
        [python, str(PEER), str(spec), str(out)], capture_output=True, text=True, timeout=300
    )
    res = json.loads(out.read_text())
    assert res["status"] == "ok", (res, proc.stderr[-2000:])
    assert res["llama_cpp"].startswith("llama.cpp") and res["tok_s"] > 0 and res["tok_per_cpu_s"] > 0
    tokens = res["token_ids"]
    assert [len(t) for t in tokens] == [6] * 4 and all(0 <= t < 4096 for row in tokens for t in row)
    llm = LLM(path, num_blocks=32, block_size=8, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    # llama.cpp multiplies Q8_0 weights by int8-quantized activations: not batchgen's arithmetic, so only the
    # first tokens are held equal (a prompt read wrongly, e.g. a position or sequence mix-up, changes them); on
    # this model all tokens agree with llama.cpp b9190 (cyllama) and llama-cpp-python 0.3.36's llama.cpp
    assert [t[0] for t in tokens] == [t[0] for t in ours], (tokens, ours)
