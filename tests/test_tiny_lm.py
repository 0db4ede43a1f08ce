"""The embedded default model (`model=tiny`): the trained checkpoint shipped in `batchgen/models/tiny_lm/`.

Other tests keep using random-weight checkpoints (`conftest.py`); these check the shipped one: its files and
shape, its held-out loss, greedy equality of our engine with transformers on it, and that `batchgen` with no
arguments writes mostly dictionary words with it.

"Dictionary": `/usr/share/dict/words` where it exists. Where it does not (as on the machines this was
written on), the alphabetic words of CPython's `LICENSE.txt` plus those of the held-out documents
(`tests/data/tiny_lm_heldout.json`, written by `python -m batchgen.models.tiny_training`): English text the
model never trained on, so the word list is not built from the training corpus. It is a small list (a few
thousand words), so real English words outside it count as misses: the fraction is a lower bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from batchgen import LLM, SamplingParams
from batchgen.models import load_model
from batchgen.models.tiny import CHAT_TEMPLATE, EOS_TOKEN, IM_END, TINY_LM_DIR, tiny_default_checkpoint
from batchgen.models.tiny_training import MODEL_SPEC, heldout_loss

HELDOUT = Path(__file__).parent / "data" / "tiny_lm_heldout.json"

# Measured on the shipped weights: held-out loss 3.840 nats/token (tiny_lm/training.json); asserted with a margin
# for other torch/transformers builds and for a retrained model.
MAX_HELDOUT_LOSS = 4.1
# Measured: 75.8% of the 1098 alphabetic words that `batchgen` (no arguments, 24 tokens, temperature 1) wrote for
# the 120 sample prompts were in the fallback dictionary (2257 words); most misses are English words the small
# list lacks ("breaks", "content", "attempts"), the rest made-up words.
MIN_DICTIONARY_FRACTION = 0.65

PROMPTS = [
    "Q: What does os.path.join() do?\nA:",
    'The "with" statement is used to',
    "Q: What is the json module?\nA:",
    "A list comprehension",
]


@pytest.fixture(scope="module")
def heldout_docs() -> list[str]:
    return json.loads(HELDOUT.read_text())


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def dictionary(heldout_docs: list[str]) -> set[str]:
    system = Path("/usr/share/dict/words")
    if system.is_file():
        return {w.lower() for w in system.read_text(errors="replace").split()}
    license_txt = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    text = license_txt.read_text(errors="replace") if license_txt.is_file() else ""
    return set(words(text + "\n".join(heldout_docs)))


def test_default_checkpoint_is_the_shipped_one() -> None:
    path = tiny_default_checkpoint()
    assert Path(path) == TINY_LM_DIR  # nothing built or copied
    names = {p.name for p in TINY_LM_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert sum(p.stat().st_size for p in TINY_LM_DIR.iterdir()) < 12_000_000  # a few MB in the package
    meta = json.loads((TINY_LM_DIR / "training.json").read_text())
    assert (
        meta["model_safetensors_sha256"]
        == hashlib.sha256((TINY_LM_DIR / "model.safetensors").read_bytes()).hexdigest()
    )

    model = load_model(path)  # our loader, the checkpoint's own dtype
    cfg = model.config
    assert cfg.architecture == "LlamaForCausalLM" and cfg.tie_word_embeddings
    assert cfg.vocab_size == MODEL_SPEC["vocab_size"] and cfg.max_model_len >= 512
    # the checkpoint's parameters: a float32 CPU tied head also holds a packed copy of the embedding for speed
    n_params = sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight")
    assert n_params == meta["parameters"] and 2_000_000 < n_params < 10_000_000

    built = PreTrainedTokenizerFast.from_pretrained(path)
    auto = AutoTokenizer.from_pretrained(path)
    for text in [*PROMPTS, "Hello world! é ü 你好 🤗", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
        assert auto.encode(text) == built.encode(text)
    assert len(auto) == MODEL_SPEC["vocab_size"] and auto.chat_template == CHAT_TEMPLATE
    gen = json.loads((TINY_LM_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [auto.convert_tokens_to_ids(EOS_TOKEN), auto.convert_tokens_to_ids(IM_END)]


def test_heldout_loss_below_stated_value(heldout_docs: list[str]) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(TINY_LM_DIR), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_LM_DIR))
    loss, tokens = heldout_loss(model, tokenizer, heldout_docs)
    assert tokens > 10_000
    meta = json.loads((TINY_LM_DIR / "training.json").read_text())
    assert loss == pytest.approx(meta["final_heldout_loss"], abs=2e-3)  # what the training run reported
    assert loss < MAX_HELDOUT_LOSS


def test_engine_greedy_matches_transformers() -> None:
    path = str(TINY_LM_DIR)
    llm = LLM(path, dtype="float32", num_blocks=256)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.engine.tokenizer.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref[: len(out.outputs[0].token_ids)], prompt
        assert len(out.outputs[0].token_ids) == len(ref)  # both stop at the same EOS, or both run to 32


@pytest.mark.slow
def test_default_job_writes_mostly_dictionary_words(tmp_path: Path, heldout_docs: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_ARRAY_TASK_")}
    p = subprocess.run(
        [sys.executable, "-m", "batchgen.cli", f"data.output={tmp_path / 'out'}", "sampling.max_tokens=24"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    texts = [t for part in parts for t in pq.read_table(part).column("generated_text").to_pylist()]
    generated = [w for t in texts for w in words(t or "")]
    assert len(generated) > 500
    known = dictionary(heldout_docs)
    fraction = sum(w in known for w in generated) / len(generated)
    print(f"{fraction:.3f} of {len(generated)} generated words are in a dictionary of {len(known)} words")
    assert fraction >= MIN_DICTIONARY_FRACTION
