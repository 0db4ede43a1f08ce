"""Smoke test of an installed (non-editable) batchgen: run from a directory outside the repository.

Checks that ``batchgen`` imports from site-packages (not a source checkout), that ``LLM.generate`` runs on the
embedded default model and ``LLM.embed`` on a tiny BERT encoder built here (random weights, our own tokenizer:
no network). The demo (``batchgen data.output=...``) is run by the CI script beside this one."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def main() -> None:
    import transformers

    import batchgen
    from batchgen import LLM, SamplingParams
    from batchgen.models.tiny import build_random_checkpoint, special_token_kwargs, tiny_default_checkpoint

    where = Path(batchgen.__file__).resolve()
    assert where.is_relative_to(Path(sys.prefix).resolve()) and "site-packages" in where.parts, (
        f"batchgen imported from {where}, not from this environment's site-packages ({sys.prefix})"
    )
    print(f"batchgen from {where.parent}")

    llm = LLM(tiny_default_checkpoint(), num_blocks=64)
    (out,) = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out.outputs[0].token_ids) > 0, out
    print(f"generate: {out.outputs[0].text!r}")

    with tempfile.TemporaryDirectory() as tmp:
        encoder = build_random_checkpoint(
            Path(tmp) / "bert",
            lambda ids: transformers.BertConfig(
                vocab_size=512,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=128,
                **special_token_kwargs(ids),
            ),
            "BertModel",
            vocab_size=512,
        )
        (emb,) = LLM(encoder, task="embed").embed(["a tiny sentence"], use_tqdm=False)
    assert len(emb.outputs.embedding) == 32, len(emb.outputs.embedding)
    print(f"embed: {len(emb.outputs.embedding)} dimensions")


if __name__ == "__main__":
    sys.exit(main())
