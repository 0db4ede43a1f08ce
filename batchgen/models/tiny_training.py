"""Train the embedded default model (`model=tiny`, shipped in `batchgen/models/tiny_lm/`).

    python -m batchgen.models.tiny_training     # rewrites batchgen/models/tiny_lm/ and tests/data/tiny_lm_heldout.json

Corpus: English text that ships with CPython (the running interpreter's standard library), 10,185 documents
(3.17M characters on CPython 3.11.7) in a fixed order:

- the language reference (`pydoc_data.topics`), one document per section (split at the RST underlines);
- every stdlib docstring (modules, classes, functions; tests and `encodings` excluded; exact duplicates
  dropped), phrased as a question and its answer: ``Q: What does json.dumps() do?\nA: <docstring>``;
- stdlib comment blocks of two or more lines that read as prose (>= 120 characters, >= 85% letters/spaces);
- the IDLE user guide (`idlelib/help.html`), one document per section.

Every 50th document is held out (203 documents, 17.9k tokens): never trained on, not seen by the tokenizer.
They are written to `tests/data/tiny_lm_heldout.json` for the tests (CPython's own text may differ on
another version).

Tokenizer: the byte-level BPE pipeline of `batchgen.models.tiny` (Qwen2 pre-tokenization, our special
tokens, ChatML template) trained on the training documents, vocabulary 4096 (0.88M training tokens), shipped
with the weights: a tokenizer retrained on another CPython's text would differ.

Model (`MODEL_SPEC`): Llama (transformers' `LlamaForCausalLM`), hidden 192, 4 layers, 6 query heads and 2 KV
heads of 32 dims, SwiGLU MLP of 512, RoPE (theta 1e4), tied embeddings, max_position_embeddings 1024:
2.36M parameters. Trained in float32; the weights are stored in bfloat16 (4.7 MB) while config.json says
float32, so engines load them exactly into float32 by default.

Training (`TrainConfig`): each epoch shuffles the documents with a fixed seed, joins them with
`<|endoftext|>`, cuts windows of 512 tokens and shuffles those; 1200 steps of 4 windows (2.46M tokens,
2.8 epochs); AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), lr 4e-3 with 60 warmup steps and cosine
decay to 4e-4, gradient clipping at 1.0; one thread, `torch.use_deterministic_algorithms(True)`.
Deterministic: the same CPython, torch build and thread count give byte-identical weights (the thread count
changes float rounding, hence `--threads`, default 1, which is also the fastest on a shared machine).

Measured here (2 shared CPU cores, load ~4-6, torch 2.13.0 CPU, transformers 5.24): 13.5 minutes wall
(13.0 of them training, ~3000 tokens/s); final loss on the shipped (bfloat16-rounded) weights: train 3.56,
held-out 3.84 nats/token (held-out 5.12 / 4.57 / 4.25 / 4.05 / 3.92 / 3.84 at steps 200 ... 1200).
`tiny_lm/training.json` records the figures of the run that wrote the shipped files.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import html.parser
import io
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from batchgen.models import tiny

SHIPPED_DIR = tiny.TINY_LM_DIR
# In a source checkout, the held-out sample goes beside the tests that read it.
_TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"
HELDOUT_SAMPLE = _TESTS_DIR / "data" / "tiny_lm_heldout.json" if _TESTS_DIR.is_dir() else None

MODEL_SPEC: dict = dict(
    hidden_size=192,
    num_layers=4,
    num_heads=6,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=512,
    vocab_size=4096,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    initializer_range=0.02,
)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1200
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 4e-3
    min_lr: float = 4e-4
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    heldout_every: int = 50
    eval_every: int = 200
    threads: int = 1
    save_dtype: str = "bfloat16"


# ------------------------------------------------------------------------------------------------ corpus
_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}
_UNDERLINE = re.compile(r"^([*=\-~^\"'`#+])\1{2,}$")


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(dotted module name, path) of every stdlib module outside tests, encodings and site-packages, sorted."""
    root = _stdlib()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts) & _EXCLUDED_DIRS or not all(p.isidentifier() for p in rel.parts[:-1]):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            out.append((".".join(parts), path))
    return out


def reference_manual_documents() -> list[str]:
    """The language reference shipped as `pydoc_data.topics`, one document per section."""
    from pydoc_data.topics import topics

    docs: list[str] = []
    seen: set[str] = set()
    for key in sorted(topics):
        text = topics[key]
        if text in seen:
            continue
        seen.add(text)
        lines = text.strip("\n").split("\n")
        starts = [0] + [
            i
            for i in range(1, len(lines) - 1)
            if lines[i].strip()
            and _UNDERLINE.match(lines[i + 1])
            and len(lines[i + 1]) == len(lines[i])
            and not lines[i - 1].strip()
        ]
        for a, b in zip(starts, starts[1:] + [len(lines)]):
            section = "\n".join(lines[a:b]).strip()
            if section:
                docs.append(section)
    return docs


def _docstrings(tree: ast.Module, module: str) -> list[tuple[str, str, str]]:
    """(kind, qualified name, docstring) for the module and every class and function in it."""
    out: list[tuple[str, str, str]] = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(("module", module, doc))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    out.append(("class" if isinstance(child, ast.ClassDef) else "function", name, doc))
                visit(child, name)
            else:
                visit(child, prefix)

    visit(tree, module)
    return out


def _question(kind: str, name: str) -> str:
    if kind == "module":
        return f"What is the {name} module?"
    if kind == "class":
        return f"What is {name}?"
    return f"What does {name}() do?"


def docstring_documents() -> list[str]:
    """Every stdlib docstring (>= 20 characters, first occurrence of each text) as `Q: ...\\nA: <docstring>`."""
    docs: list[str] = []
    seen: set[str] = set()
    for module, path in _stdlib_sources():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for kind, name, doc in _docstrings(tree, module):
            doc = doc.strip()
            if len(doc) < 20 or doc in seen:
                continue
            seen.add(doc)
            docs.append(f"Q: {_question(kind, name)}\nA: {doc}")
    return docs


def _is_prose(text: str) -> bool:
    return len(text) >= 120 and sum(c.isalpha() or c == " " for c in text) >= 0.85 * len(text)


def comment_documents() -> list[str]:
    """Stdlib comment blocks (consecutive whole-line comments, >= 2 lines) that read as prose, joined into one line."""
    docs: list[str] = []
    seen: set[str] = set()
    for _, path in _stdlib_sources():
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline))
        except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        blocks: list[list[str]] = []
        last_line = -2
        for tok in tokens:
            if tok.type != tokenize.COMMENT or not tok.line.strip().startswith("#"):
                continue
            text = tok.string.lstrip("#").strip()
            if tok.start[0] == last_line + 1 and blocks:
                blocks[-1].append(text)
            else:
                blocks.append([text])
            last_line = tok.start[0]
        for block in blocks:
            text = " ".join(t for t in block if t)
            if len(block) >= 2 and _is_prose(text) and text not in seen:
                seen.add(text)
                docs.append(text)
    return docs


class _HelpHTML(html.parser.HTMLParser):
    """Text of a Sphinx page's body, one section per h1-h3 heading."""

    _BLOCKS = {"p", "dt", "dd", "li", "pre", "h1", "h2", "h3", "div", "tr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[list[str]] = []
        self.inside = False
        self.skip = 0
        self.buf: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and not self.inside:
            self.inside = True
        if not self.inside:
            return
        if tag == "a" and "headerlink" in (a.get("class") or ""):
            self.skip += 1
        if tag in ("h1", "h2", "h3"):
            self._flush()
            self.sections.append([])
        elif tag in self._BLOCKS:
            self._flush()

    def handle_endtag(self, tag):
        if not self.inside:
            return
        if tag == "a" and self.skip:
            self.skip -= 1
        if tag in self._BLOCKS:
            self._flush()
        if tag == "body":
            self.inside = False

    def handle_data(self, data):
        if self.inside and not self.skip:
            self.buf.append(data)

    def _flush(self) -> None:
        text = " ".join("".join(self.buf).split())
        self.buf = []
        if text and self.sections:
            self.sections[-1].append(text)


def idle_help_documents() -> list[str]:
    """The IDLE user guide (`idlelib/help.html`), one document per section (heading + paragraphs)."""
    path = _stdlib() / "idlelib" / "help.html"
    if not path.is_file():
        return []
    parser = _HelpHTML()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    docs = []
    for section in parser.sections:
        if "footer" in section[0].lower() or len(section) < 2:
            continue
        docs.append(section[0] + "\n\n" + "\n\n".join(section[1:]))
    return docs


def corpus_documents() -> list[str]:
    """All documents in their fixed order: reference manual, docstrings, comments, IDLE guide."""
    return reference_manual_documents() + docstring_documents() + comment_documents() + idle_help_documents()


def split_documents(docs: list[str], every: int = 50) -> tuple[list[str], list[str]]:
    """(train, held-out): every `every`-th document (indices every-1, 2*every-1, ...) is held out."""
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    heldout = [d for i, d in enumerate(docs) if i % every == every - 1]
    return train, heldout


# ------------------------------------------------------------------------------------------------- data
def encode_documents(tokenizer, docs: list[str]) -> list[list[int]]:
    """Token ids of each document followed by `<|endoftext|>`."""
    eos = tokenizer.convert_tokens_to_ids(tiny.EOS_TOKEN)
    return [ids + [eos] for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]]


def windows(stream: list[int], seq_len: int) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len + 1] (window i starts at i * seq_len; the tail is dropped)."""
    n = (len(stream) - 1) // seq_len
    t = torch.tensor(stream[: n * seq_len + 1], dtype=torch.long)
    return torch.stack([t[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


def epoch_windows(encoded: list[list[int]], seq_len: int, seed: int, epoch: int) -> torch.Tensor:
    """The training windows of one epoch: documents and then windows shuffled by (seed, epoch)."""
    rng = random.Random(f"{seed}-{epoch}")
    order = list(range(len(encoded)))
    rng.shuffle(order)
    stream = [t for i in order for t in encoded[i]]
    w = windows(stream, seq_len)
    perm = list(range(len(w)))
    rng.shuffle(perm)
    return w[perm]


@torch.no_grad()
def heldout_loss(model, tokenizer, docs: list[str], seq_len: int = 512) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) of a transformers causal LM over `docs` in their given order
    (joined with `<|endoftext|>`, windows of `seq_len`, no shuffling). Returns (loss, tokens scored)."""
    stream = [t for ids in encode_documents(tokenizer, docs) for t in ids]
    w = windows(stream, seq_len)
    total, count = 0.0, 0
    for i in range(0, len(w), 8):
        batch = w[i : i + 8]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        count += batch[:, 1:].numel()
    return float(total) / count, count


# --------------------------------------------------------------------------------------------- training
def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def train(out_dir: Path, cfg: TrainConfig, heldout_sample: Path | None, log=print) -> dict:
    """Build the corpus and tokenizer, train, and write the checkpoint into `out_dir`. Returns the metadata."""
    t_start = time.monotonic()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)

    docs = corpus_documents()
    train_docs, heldout_docs = split_documents(docs, cfg.heldout_every)
    log(
        f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f}M characters; held out {len(heldout_docs)}"
    )

    tokenizer = tiny.wrap_tokenizer(tiny.train_tokenizer_json(MODEL_SPEC["vocab_size"], train_docs))
    ids = tiny.special_token_ids(tokenizer)
    encoded = encode_documents(tokenizer, train_docs)
    n_train_tokens = sum(map(len, encoded))
    log(f"tokenizer: {len(tokenizer)} tokens; training text {n_train_tokens / 1e6:.3f}M tokens")

    model = _new_model(ids)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters ({json.dumps(MODEL_SPEC)})")
    history, train_seconds = _train_steps(model, tokenizer, encoded, heldout_docs, cfg, log)

    # Final figures on the weights as shipped (rounded to save_dtype, evaluated in float32).
    model = model.to(getattr(torch, cfg.save_dtype)).to(torch.float32).eval()
    final_heldout, heldout_tokens = heldout_loss(model, tokenizer, heldout_docs, cfg.seq_len)
    final_train = _train_probe_loss(model, encoded, cfg)
    log(f"final ({cfg.save_dtype} weights): train loss {final_train:.3f}, held-out loss {final_heldout:.3f}")

    meta = _metadata(cfg, n_params, history)
    meta["corpus"] = {
        "documents": len(docs),
        "train_documents": len(train_docs),
        "heldout_documents": len(heldout_docs),
        "characters": sum(map(len, docs)),
        "train_tokens": n_train_tokens,
        "heldout_tokens_scored": heldout_tokens,
        "epochs_seen": round(cfg.steps * cfg.batch_size * cfg.seq_len / n_train_tokens, 2),
    }
    meta.update(final_train_loss=round(final_train, 4), final_heldout_loss=round(final_heldout, 4))
    meta.update(train_seconds=round(train_seconds, 1), total_seconds=round(time.monotonic() - t_start, 1))
    meta = {k: meta[k] for k in _META_ORDER}
    out_dir = Path(out_dir)
    digest = _write_checkpoint(out_dir, tokenizer, model.to(getattr(torch, cfg.save_dtype)), ids, meta, cfg)
    if heldout_sample is not None:
        heldout_sample.parent.mkdir(parents=True, exist_ok=True)
        heldout_sample.write_text(json.dumps(heldout_docs, indent=0, ensure_ascii=False) + "\n")
    log(
        f"wrote {out_dir} (model.safetensors sha256 {digest[:16]}...) in {meta['total_seconds'] / 60:.1f} min"
    )
    return meta


# Keys of training.json, in the order they are written.
_META_ORDER = (
    "command", "train_config", "model_spec", "parameters", "corpus", "final_train_loss", "final_heldout_loss",
    "history", "train_seconds", "total_seconds", "environment",
)  # fmt: skip


def _new_model(ids: dict[str, int]):
    """The untrained :data:`MODEL_SPEC` Llama (tied embeddings, SDPA attention), drawn from the global RNG."""
    import transformers

    spec = MODEL_SPEC
    config = tiny.make_config(
        "llama",
        hidden_size=spec["hidden_size"],
        num_layers=spec["num_layers"],
        num_heads=spec["num_heads"],
        num_kv_heads=spec["num_kv_heads"],
        head_dim=spec["head_dim"],
        intermediate_size=spec["intermediate_size"],
        vocab_size=spec["vocab_size"],
        tie_word_embeddings=True,
        rope_theta=spec["rope_theta"],
        rope_scaling=None,
        dtype=torch.float32,
        initializer_range=spec["initializer_range"],
        max_position_embeddings=spec["max_position_embeddings"],
        bos_id=ids[tiny.BOS_TOKEN],
        eos_id=ids[tiny.EOS_TOKEN],
        pad_id=ids[tiny.PAD_TOKEN],
        extra={},
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def _train_steps(
    model, tokenizer, encoded: list[list[int]], heldout_docs: list[str], cfg: TrainConfig, log
) -> tuple[list, float]:
    """``cfg.steps`` AdamW steps over shuffled epochs of ``encoded`` (cosine schedule, gradient clipping), the
    held-out loss every ``cfg.eval_every`` steps. Returns that history and the seconds the steps took."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    history = []
    epoch, cursor, data = 0, 0, epoch_windows(encoded, cfg.seq_len, cfg.seed, 0)
    smooth = None
    t_train = time.monotonic()
    model.train()
    for step in range(cfg.steps):
        if cursor + cfg.batch_size > len(data):
            epoch, cursor = epoch + 1, 0
            data = epoch_windows(encoded, cfg.seq_len, cfg.seed, epoch)
        batch = data[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss_value = loss.item()
        smooth = loss_value if smooth is None else 0.95 * smooth + 0.05 * loss_value
        done = step + 1
        if done % 10 == 0 or done == cfg.steps:
            elapsed = time.monotonic() - t_train
            log(
                f"step {done}/{cfg.steps} epoch {epoch} loss {loss_value:.3f} (smoothed {smooth:.3f}) "
                f"lr {_lr(step, cfg):.2e} {done * cfg.batch_size * cfg.seq_len / elapsed:.0f} tok/s "
                f"{elapsed / 60:.1f} min"
            )
        if done % cfg.eval_every == 0 or done == cfg.steps:
            model.eval()
            h, _ = heldout_loss(model, tokenizer, heldout_docs, cfg.seq_len)
            model.train()
            history.append(
                {"step": done, "train_loss_smoothed": round(smooth, 4), "heldout_loss": round(h, 4)}
            )
            log(f"eval step {done}: held-out loss {h:.3f}")
    return history, time.monotonic() - t_train


def _train_probe_loss(model, encoded: list[list[int]], cfg: TrainConfig) -> float:
    """Cross-entropy of ``model`` on 32 windows of the training text (a fixed draw)."""
    train_probe = epoch_windows(encoded, cfg.seq_len, cfg.seed, 10_000)[:32]
    with torch.no_grad():
        logits = model(input_ids=train_probe[:, :-1]).logits
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), train_probe[:, 1:].reshape(-1)))


def _metadata(cfg: TrainConfig, n_params: int, history: list) -> dict:
    """training.json's fields known before the corpus figures and timings: the command, the settings, the
    environment."""
    import transformers

    return {
        "command": "python -m batchgen.models.tiny_training " + " ".join(sys.argv[1:]),
        "train_config": asdict(cfg),
        "model_spec": MODEL_SPEC,
        "parameters": n_params,
        "history": history,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": cfg.threads,
            "machine": platform.machine(),
        },
    }


def _write_checkpoint(
    out_dir: Path, tokenizer, model, ids: dict[str, int], meta: dict, cfg: TrainConfig
) -> str:
    """Write tokenizer, ``model`` (in its dtype), ``training.json`` (``meta`` plus the stored dtype and the
    weights' sha256) into ``out_dir``, replacing it atomically. Returns the sha256 of model.safetensors."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        tiny.save_model(model, tmp, ids)
        # The weights are stored in save_dtype (half the size in bfloat16) but config.json says float32:
        # `dtype="auto"` (our engine's and transformers' default) then computes in float32, which is exact
        # (bfloat16 -> float32 is lossless), fast on every CPU, and what the tests compare.
        config_path = tmp / "config.json"
        config_json = json.loads(config_path.read_text())
        config_json["dtype"] = "float32"
        config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        meta["stored_dtype"] = cfg.save_dtype
        digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
        meta["model_safetensors_sha256"] = digest
        (tmp / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the shipped files are ordinary package data
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return digest


def main(argv: list[str] | None = None) -> None:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m batchgen.models.tiny_training", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--out", type=Path, default=SHIPPED_DIR, help="checkpoint directory (default: the shipped one)"
    )
    p.add_argument(
        "--heldout-sample",
        type=Path,
        default=HELDOUT_SAMPLE,
        help="where to write the held-out documents for the tests ('none' to skip; default: tests/data in a checkout)",
    )
    for field in ("steps", "batch_size", "seq_len", "threads", "eval_every", "seed"):  # integer options
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default=defaults.save_dtype)
    args = p.parse_args(argv)
    given = ("steps", "batch_size", "seq_len", "threads", "eval_every", "seed", "lr", "save_dtype")
    cfg = TrainConfig(**{name: getattr(args, name) for name in given}, min_lr=args.lr / 10)
    sample = None if str(args.heldout_sample).lower() in ("none", "") else args.heldout_sample
    train(args.out, cfg, sample, log=lambda m: print(m, flush=True))


if __name__ == "__main__":
    main()
