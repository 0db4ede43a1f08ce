"""Pooling benchmark: embed a mixed-length corpus with batchgen, sentence-transformers and transformers, side by
side in one run, on the same checkpoint; then a decoder embedder with a shared instruction prefix, batchgen's
prefix cache on vs off.

    python -m batchgen.bench.embed [--rows 2000] [--json out.json]

Encoder: a random-weight BERT of bert-small's shape (4 layers, hidden 256, 4 heads, intermediate 1024; vocab
8192 from batchgen's small BPE tokenizer) in a sentence-transformers layout (mean pooling, Normalize).
Workload: ``--rows`` texts, 60% short queries (5-20 words) and 40% passages (50-200 words). Systems:
- ``batchgen``: ``LLM(path).embed(texts)`` (length-sorted, unpadded token-budget batches; linear layers on
  batchgen's GEMM where its C kernels build), and once more with the encoder's linear layers back on MKL's
  GEMM (weights as loaded) for comparison;
- ``sentence-transformers``: ``SentenceTransformer(path).encode(texts, batch_size=b)`` at each of
  ``--st-batch-sizes``, the best reported (it sorts by length itself);
- ``transformers``: ``AutoModel`` over padded batches of 32 rows in input order, mean pooling + normalise.
Every system embeds the same texts; the cosine between batchgen's and each other system's embeddings is
reported (>= 0.9999 expected). Decoder: a random Qwen3 embedder (4 layers, hidden 256), ``--decoder-rows``
queries behind one ~80-token instruction, last-token pooling; prefix cache on vs off.
Figures are rows/s and input tokens/s; each system is warmed up on 32 rows first. Beside them, the float32
compute floor: the corpus's FLOPs at the best GEMM rate measured at the encoder's shapes (no system can embed it
faster in float32 on that machine). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.bench.common import machine_info
from batchgen.runtime.disk_cache import cache_root

_VERSION = 1
_BERT = dict(
    vocab_size=8192,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=1024,
    max_position_embeddings=512,
)
_QWEN3 = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
INSTRUCTION = (
    "Instruct: Given a web search query about programming languages, their standard libraries and their "
    "documentation, retrieve the passages of the reference manual that answer the query best, preferring "
    "complete and precise explanations over short mentions.\nQuery: "
)


def _checkpoint(name: str, config_name: str, model_class: str, sizes: dict[str, Any], st: bool) -> str:
    import transformers

    from batchgen.models.tiny import build_random_checkpoint, special_token_kwargs
    from batchgen.runtime.atomic import build_dir_once

    def build(tmp: str) -> str:
        def config(ids: dict[str, int]):
            return getattr(transformers, config_name)(**sizes, **special_token_kwargs(ids))

        path = build_random_checkpoint(tmp, config, model_class, vocab_size=sizes["vocab_size"])
        p = Path(path)
        (p / "chat_template.jinja").unlink(missing_ok=True)
        tc = json.loads((p / "tokenizer_config.json").read_text())
        tc.pop("chat_template", None)
        (p / "tokenizer_config.json").write_text(json.dumps(tc))
        if st:
            _sentence_transformers_files(p, sizes["hidden_size"])
        return path

    return build_dir_once(cache_root() / "bench" / f"{name}-{_VERSION}", "config.json", build)


def _sentence_transformers_files(p: Path, hidden: int) -> None:
    types = ("Transformer", "Pooling", "Normalize")
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{t}"}
        for i, (t, path) in enumerate(zip(types, ("", "1_Pooling", "2_Normalize")))
    ]
    (p / "modules.json").write_text(json.dumps(modules))
    (p / "1_Pooling").mkdir(exist_ok=True)
    (p / "2_Normalize").mkdir(exist_ok=True)
    pool = {
        "word_embedding_dimension": hidden,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_cls_token": False,
    }
    (p / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (p / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def corpus(tokenizer: Any, rows: int, seed: int = 0) -> list[str]:
    """60% queries of 5-20 words, 40% passages of 50-200 words, shuffled."""
    from batchgen.bench.workloads import word_pieces

    words = word_pieces(tokenizer)
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(rows):
        n = rng.integers(5, 21) if rng.random() < 0.6 else rng.integers(50, 201)
        texts.append("".join(words[i] for i in rng.integers(0, len(words), size=n)).strip())
    return texts


def _timed(fn, texts: list[str]) -> tuple[float, np.ndarray]:
    fn(texts[:32])  # warm-up
    t0 = time.perf_counter()
    out = fn(texts)
    return time.perf_counter() - t0, np.asarray(out, dtype=np.float32)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


def run_encoder(path: str, texts: list[str], st_batch_sizes: list[int]) -> list[dict[str, Any]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    n_tokens = sum(len(t) for t in tok(texts)["input_ids"])
    ours, results = _batchgen_rows(path, texts)
    results += _sentence_transformers_rows(path, texts, st_batch_sizes, ours)
    wall, emb = _timed(_padded_automodel(path, tok), texts)
    results.append(
        {
            "system": "transformers",
            "setting": "AutoModel padded batch 32",
            "wall_s": wall,
            "cos": _cos(ours, emb),
        }
    )
    for r in results:
        r["rows_per_s"] = len(texts) / r["wall_s"]
        r["tok_per_s"] = n_tokens / r["wall_s"]
    return results


def _batchgen_rows(path: str, texts: list[str]) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """batchgen's embeddings and its rows: ``LLM.embed`` as it loads (linear layers on batchgen's GEMM where
    its C kernels build), then with the encoder's linear layers back on MKL's GEMM as loaded, for comparison."""
    from batchgen import LLM

    llm = LLM(path, device="cpu")
    wall, ours = _timed(lambda xs: [o.outputs.embedding for o in llm.embed(xs, use_tqdm=False)], texts)
    rows = [{"system": "batchgen", "setting": "LLM.embed", "wall_s": wall, "cos": 1.0}]
    plain = LLM(path, device="cpu")
    if _unpack_linears(plain.pooler.encoder.model):
        wall, emb = _timed(lambda xs: [o.outputs.embedding for o in plain.embed(xs, use_tqdm=False)], texts)
        setting = "LLM.embed, linear layers on MKL's GEMM (weights as loaded)"
        rows.append({"system": "batchgen", "setting": setting, "wall_s": wall, "cos": _cos(ours, emb)})
    return ours, rows


def _unpack_linears(model: Any) -> int:
    """Turn every ``PackedLinear`` under ``model`` back into an ``nn.Linear`` (weights as loaded); how many."""
    import torch

    from batchgen.models.packed_linear import PackedLinear

    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight = torch.nn.Parameter(module.dense_weight(), requires_grad=False)
            if module.bias is not None:
                linear.bias = torch.nn.Parameter(module.dense_bias().clone(), requires_grad=False)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, linear)
            count += 1
    return count


def _sentence_transformers_rows(
    path: str, texts: list[str], batch_sizes: list[int], ours: np.ndarray
) -> list[dict[str, Any]]:
    """``SentenceTransformer.encode`` at each batch size, its best marked (none where it is not installed)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return []
    st = SentenceTransformer(path, device="cpu")
    rows: list[dict[str, Any]] = []
    for b in batch_sizes:
        wall, emb = _timed(lambda xs, b=b: st.encode(xs, batch_size=b, show_progress_bar=False), texts)
        setting = f"encode batch_size={b}"
        rows.append(
            {"system": "sentence-transformers", "setting": setting, "wall_s": wall, "cos": _cos(ours, emb)}
        )
    if rows:
        min(rows, key=lambda r: r["wall_s"])["best"] = True
    return rows


def _padded_automodel(path: str, tok: Any) -> Any:
    """transformers' ``AutoModel`` over padded batches of 32 rows in input order, mean pooling, normalised."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(path).eval()

    def hf(xs: list[str]) -> list[np.ndarray]:
        out = []
        with torch.inference_mode():
            for i in range(0, len(xs), 32):
                enc = tok(xs[i : i + 32], padding=True, return_tensors="pt")
                h = model(**enc).last_hidden_state
                m = enc["attention_mask"][..., None].float()
                v = (h * m).sum(1) / m.sum(1)
                out += list(torch.nn.functional.normalize(v, dim=-1).numpy())
        return out

    return hf


def encoder_flops(sizes: dict[str, Any], lengths: list[int]) -> float:
    """FLOPs of one BERT-style encoder forward over unpadded sequences of ``lengths``: every token through the
    Q/K/V/O and the two feed-forward projections (2 FLOPs per weight), plus attention's two ``n x n x hidden``
    products per layer per sequence. Embeddings, norms, activations and the pooler are left out."""
    h, i, layers = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]
    per_token = 2 * (4 * h * h + 2 * h * i)
    return float(layers * sum(per_token * n + 4 * n * n * h for n in lengths))


def gemm_rates(
    sizes: dict[str, Any], rows: tuple[int, ...] = (512, 2048, 4096), seconds: float = 0.3
) -> dict[str, float]:
    """The best FLOP/s measured for the encoder's projection shapes at ``rows`` rows per kernel (``matmul``:
    MKL's, ``onednn``: oneDNN's packed linear where torch has it, ``batchgen``: batchgen's GEMM where its C
    kernels build; float32, this process's threads)."""
    from batchgen.bench.systems import run_matmul

    h, i = sizes["hidden_size"], sizes["intermediate_size"]
    shapes = [["qkvo", h, h], ["up", h, i], ["down", i, h]]
    spec = {"device": "cpu", "dtype": "float32", "matmul_shapes": shapes, "matmul_rows": list(rows)}
    spec["matmul_seconds"] = seconds
    best: dict[str, float] = {}
    for r in run_matmul(spec)["shapes"]:
        best[r["kernel"]] = max(best.get(r["kernel"], 0.0), r["flops_per_s"])
    return best


def compute_floor(results: list[dict[str, Any]], lengths: list[int]) -> dict[str, float]:
    """The least time any float32 system could embed the corpus in on this machine: its FLOPs
    (`encoder_flops`) at the best GEMM rate measured (`gemm_rates`), beside the time 1.5x sentence-transformers'
    best would take."""
    flops = encoder_flops(_BERT, lengths)
    rates = gemm_rates(_BERT)
    peak = max(rates.values())
    st = [r["wall_s"] for r in results if r["system"] == "sentence-transformers"]
    return {
        "flops": flops,
        "peak_flops_per_s": peak,
        **{f"{k}_flops_per_s": v for k, v in rates.items()},
        "floor_s": flops / peak,
        "st_best_s": min(st) if st else float("nan"),
        "st_best_div_1_5_s": min(st) / 1.5 if st else float("nan"),
    }


def run_decoder(path: str, queries: list[str]) -> list[dict[str, Any]]:
    from batchgen import LLM

    texts = [INSTRUCTION + q for q in queries]
    results = []
    for cache in (True, False):
        llm = LLM(path, device="cpu", enable_prefix_caching=cache, kv_cache_memory="512MiB")
        wall, _ = _timed(
            lambda xs, llm=llm: [o.outputs.embedding for o in llm.embed(xs, use_tqdm=False)], texts
        )
        stats = llm.engine.stats
        n_tokens = sum(len(llm.tokenizer.encode(t)) for t in texts)
        results.append(
            {
                "system": "batchgen",
                "setting": f"prefix cache {'on' if cache else 'off'}",
                "wall_s": wall,
                "rows_per_s": len(texts) / wall,
                "tok_per_s": n_tokens / wall,
                "cached_fraction": stats.prompt_tokens_cached / max(1, stats.prompt_tokens),
            }
        )
    return results


def _table(rows: list[dict[str, Any]], extra: str | None = None) -> str:
    head = "| system | setting | wall s | rows/s | tokens/s |" + (f" {extra} |" if extra else "")
    lines = [head, "|" + "---|" * (5 + bool(extra))]
    for r in rows:
        mark = " (best)" if r.get("best") else ""
        cell = f" {r[extra]:.4f} |" if extra == "cos" else (f" {r[extra]:.0%} |" if extra else "")
        lines.append(
            f"| {r['system']} | {r['setting']}{mark} | {r['wall_s']:.1f} | {r['rows_per_s']:.0f} | "
            f"{r['tok_per_s']:.0f} |{cell}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--decoder-rows", type=int, default=500)
    ap.add_argument("--st-batch-sizes", default="32,64")
    ap.add_argument("--parts", default="encoder,decoder", help="which comparisons to run (comma-separated)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import transformers

    info = machine_info()
    enc_path = _checkpoint("embed-bert-small", "BertConfig", "BertModel", _BERT, st=True)
    dec_path = _checkpoint("embed-qwen3", "Qwen3Config", "Qwen3Model", _QWEN3, st=False)
    tok = transformers.AutoTokenizer.from_pretrained(enc_path)
    parts = args.parts.split(",")
    enc: list[dict[str, Any]] = []
    dec: list[dict[str, Any]] = []
    floor: dict[str, float] = {}
    if "encoder" in parts:
        texts = corpus(tok, args.rows)
        enc = run_encoder(enc_path, texts, [int(b) for b in args.st_batch_sizes.split(",")])
        floor = compute_floor(enc, [len(t) for t in tok(texts)["input_ids"]])
    if "decoder" in parts:
        queries = [" ".join(q.split()[:12]) for q in corpus(tok, args.decoder_rows, seed=1)]
        dec = run_decoder(dec_path, queries)
    info["loadavg_end"] = list(os.getloadavg())
    print(
        f"machine: {info['nproc']} CPUs, {info['cpu']}; load average at start {info['loadavg']}, "
        f"at end {info['loadavg_end']}"
    )
    if enc:
        print(f"\nencoder (bert-small shape), {args.rows} mixed-length rows\n" + _table(enc, "cos"))
        print(_floor_line(floor))
    if dec:
        print(
            f"\ndecoder embedder (Qwen3, 4 layers), {args.decoder_rows} rows behind one instruction\n"
            + _table(dec, "cached_fraction")
        )
    if args.json:
        out = {"machine": info, "encoder": enc, "encoder_floor": floor, "decoder": dec}
        Path(args.json).write_text(json.dumps(out, indent=1))


def _floor_line(f: dict[str, float]) -> str:
    return (
        f"float32 compute floor: {f['flops'] / 1e9:.0f} GFLOP (projections + attention, unpadded) at the best "
        f"GEMM rate measured here, {f['peak_flops_per_s'] / 1e9:.0f} GFLOP/s = {f['floor_s']:.2f} s (best per "
        f"kernel: MKL {f.get('matmul_flops_per_s', 0) / 1e9:.0f}, oneDNN packed "
        f"{f.get('onednn_flops_per_s', 0) / 1e9:.0f}, batchgen {f.get('batchgen_flops_per_s', 0) / 1e9:.0f} "
        "GFLOP/s); "
        f"1.5x sentence-transformers' best ({f['st_best_s']:.2f} s) would be {f['st_best_div_1_5_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
