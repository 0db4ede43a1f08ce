"""GGUF checkpoints (model path ending in .gguf): greedy output equal token for token to transformers'
`from_pretrained(..., gguf_file=)` (which dequantizes to float32) on a tiny llama written with the gguf package's
writer, per block format and with llama.cpp-style mixes; projections stay packed; the tokenizer comes from the
file; a tensor format batchgen does not run is refused by name."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import model_zoo
import pytest
import torch
from quant_helpers import write_gguf

from batchgen import LLM, SamplingParams
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint
from batchgen.models.quant.quant_linear import QuantLinear

gguf = pytest.importorskip("gguf", reason="the gguf extra (pip install batchgen[gguf]) is not installed")

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = (
    2,
    3,
    6,
    7,
    8,
    10,
    11,
    12,
    13,
    14,
    20,
    23,
)
MIXES = {
    "Q8_0": Q8_0,
    "Q4_0": Q4_0,
    "Q4_K": Q4_K,
    "Q6_K": Q6_K,
    # llama.cpp's Q4_K_M-like mix: a fused q/k/v and gate/up hold parts in different formats
    "mixed": {
        "attn_q": Q4_K,
        "attn_k": Q4_0,
        "attn_v": Q6_K,
        "attn_output": Q8_0,
        "ffn_gate": Q4_K,
        "ffn_up": Q4_0,
    },
    # the other K-quants: llama.cpp's Q2_K, Q3_K_M and Q5_K_M files
    "k-quants": {
        "attn_q": Q3_K,
        "attn_k": Q2_K,
        "attn_v": Q5_K,
        "attn_output": Q3_K,
        "ffn_gate": Q5_K,
        "ffn_up": Q2_K,
        "ffn_down": Q5_K,
    },
    # llama.cpp's IQ4_XS and IQ4_NL files: 16 non-linear levels per 4-bit index
    "iq4": {
        "attn_q": IQ4_XS,
        "attn_k": IQ4_NL,
        "attn_v": IQ4_XS,
        "attn_output": IQ4_NL,
        "ffn_gate": IQ4_XS,
        "ffn_up": IQ4_NL,
        "ffn_down": IQ4_XS,
    },
    # the types llama.cpp's quantizer falls back to for rows a K-quant cannot split
    "legacy": {
        "attn_q": Q5_0,
        "attn_k": Q4_1,
        "attn_v": Q5_1,
        "attn_output": Q5_0,
        "ffn_gate": Q4_1,
        "ffn_up": Q5_1,
    },
}
PROMPTS = [[1, 17, 33, 90], [1, 200, 5, 9, 77, 31, 8, 12, 400], [1, 64]]
LONG_PROMPTS = [
    [1, 17, 33, 90, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    *PROMPTS[1:],
]  # past a sliding window of 8
NEW = 12


@pytest.fixture(scope="module")
def llama_256(ckpt_factory) -> str:
    """K-quants need rows of whole 256-value blocks."""
    return ckpt_factory("llama", seed=31, hidden_size=256, intermediate_size=512)


@cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _assert_prompt_logprobs_equal(path: str, prompts: list[list[int]], outs) -> None:
    """Each prompt token's logprob in batchgen's outputs (``prompt_logprobs=0``) equals transformers' loading
    of the file's (every position: greedy tokens alone miss a model that repeats one token)."""
    hf = _hf_model(path)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1], -1)
        want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor(
            [float(getattr(d[t], "logprob", d[t])) for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        )
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _hf_greedy(path: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    model = _hf_model(path)
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([q]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[
                0, len(q) :
            ].tolist()
            for q in prompts
        ]


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_gguf_greedy_equals_transformers(llama_256, tmp_path, mix) -> None:
    path = write_gguf(llama_256, tmp_path / f"{mix}.gguf", MIXES[mix], seed=len(mix))
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    model = llm.engine.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 2 * 4  # qkv, o, gate_up, down per layer: kept packed
    assert all(p.dtype == torch.uint8 for m in quantized for p in m.weights)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == _hf_greedy(path)
    assert len({t for row in got for t in row}) > 6  # not a degenerate repetition


@pytest.mark.parametrize("head", [Q6_K, Q8_0])
def test_gguf_quantized_lm_head_stays_packed(llama_256, tmp_path, head) -> None:
    """A head stored quantized (llama.cpp's files: Q6_K, or Q8_0 in a Q8_0 file) is multiplied packed, greedy
    output still equal to transformers' (which dequantizes it)."""
    path = write_gguf(llama_256, tmp_path / "head.gguf", Q4_0, output_type=head)
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    lm_head = llm.engine.model.lm_head
    assert isinstance(lm_head, QuantLinear) and lm_head.type_ids == [head]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == _hf_greedy(path)
    assert len({t for row in got for t in row}) > 6


def test_q6_k_writer_round_trips_through_ggml_dequantization() -> None:
    """The fixture quantizer's Q6_K blocks read back (gguf-py's dequantization) within one step of their 16
    values (absmax / 32, rounded up to a multiple of the block's d = block absmax / 32 / 127)."""
    import numpy as np

    from batchgen.models.quant.gguf_writer import quantize_q6_k

    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    w[1, :16] = 0  # an all-zero sub-block
    back = gguf.quants.dequantize(quantize_q6_k(w), gguf.GGMLQuantizationType.Q6_K)
    absmax = np.abs(w).reshape(4, 2, 16, 16).max(-1, keepdims=True)
    step = absmax / 32 + absmax.max(-2, keepdims=True) / 32 / 127
    assert (np.abs(back - w).reshape(4, 2, 16, 16) <= step * 1.01).all() and (back[1, :16] == 0).all()


def test_gguf_tokenizer_from_the_file_and_packed_bytes(llama_256, tmp_path) -> None:
    from transformers import AutoTokenizer

    path = Path(write_gguf(llama_256, tmp_path / "q4.gguf", Q4_0))
    llm = LLM(str(path), num_blocks=64, block_size=8, max_num_seqs=4)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Return the sum of a list of numbers."
    assert llm.tokenizer.encode(text) == ref.encode(text)
    out = llm.generate([text], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.prompt_token_ids == ref.encode(text)
    # Q4_0: 18 bytes per 32 weights, 14% of float32's bytes
    quantized = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    packed = sum(p.numel() for m in quantized for p in m.weights)
    dense = sum(m.in_features * m.out_features * 4 for m in quantized)
    assert packed / dense == pytest.approx(18 / 128)


def _with_iq2_xxs_tensor(src: Path, out: Path) -> Path:
    """A copy of the GGUF file `src` whose blk.1.ffn_down.weight is IQ2_XXS (a valid format batchgen does not
    run)."""
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name == "blk.1.ffn_down.weight":
            iq2 = np.zeros((t.data.shape[0], int(t.shape[0]) // 256 * 66), np.uint8)
            writer.add_tensor(t.name, iq2, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unsupported_tensor_format_refused_by_name(llama_256, tmp_path) -> None:
    bad = _with_iq2_xxs_tensor(
        Path(write_gguf(llama_256, tmp_path / "base.gguf", Q8_0)), tmp_path / "iq2.gguf"
    )
    with pytest.raises(
        UnsupportedCheckpoint, match="blk.1.ffn_down.weight in iq2.gguf is IQ2_XXS: batchgen runs"
    ):
        LLM(str(bad), num_blocks=64, block_size=8)


def test_job_runs_a_gguf_file_and_refuses_an_unsupported_one(llama_256, tmp_path) -> None:
    """model.path=file.gguf and model.gguf_file= run the file (greedy output equal to transformers'); a file with
    a tensor format batchgen does not run ends the job with exit status 2 and one line naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config

    from batchgen.job.run import EXIT_CONFIG, EXIT_OK, run_job

    path = Path(write_gguf(llama_256, tmp_path / "q8.gguf", Q8_0))
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["def main():", "Once upon a time"]}), inp)
    for i, (model_path, gguf_file) in enumerate([(str(path), None), (str(tmp_path), "q8.gguf")]):
        cfg = job_config(
            model_path, inp, tmp_path / f"out{i}", sampling={"temperature": 0.0, "max_tokens": 5}
        )
        cfg.model.gguf_file = gguf_file
        cfg.sampling.ignore_eos = True
        res = run_job(cfg, handle_signals=False, print_summary=False)
        assert res.exit_code == EXIT_OK, res.message
        out = pa.concat_tables(
            pq.read_table(p) for p in sorted((tmp_path / f"out{i}").glob("part-*.parquet"))
        )
        got = out.sort_by("id").to_pydict()["token_ids"]
        llm = LLM(str(path), num_blocks=64, block_size=8)
        want = llm.generate(
            ["def main():", "Once upon a time"],
            SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        )
        assert got == [o.outputs[0].token_ids for o in want]
    bad = _with_iq2_xxs_tensor(path, tmp_path / "iq2.gguf")
    cfg = job_config(str(bad), inp, tmp_path / "bad")
    res = run_job(cfg, handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_CONFIG and "\n" not in res.message
    assert "blk.1.ffn_down.weight in iq2.gguf is IQ2_XXS" in res.message


@pytest.mark.parametrize(
    "arch, tie, types",
    [("qwen2", True, MIXES["mixed"]), ("llama", False, 30)],  # qwen2 without output.weight; a BF16 file
)
def test_other_architectures_and_float_files_equal_transformers(
    ckpt_factory, tmp_path, arch, tie, types
) -> None:
    """A qwen2 file (q/k/v biases, its own Qwen2 tokenizer, tied embeddings: no output tensor) and a BF16 file
    (projections widened at load): greedy output equals transformers', the qwen2 tokenizer read from the
    file the checkpoint's."""
    from transformers import AutoTokenizer

    base = ckpt_factory(arch, seed=31, hidden_size=256, intermediate_size=512, tie_word_embeddings=tie)
    path = Path(write_gguf(base, tmp_path / f"{arch}.gguf", types))
    llm = LLM(str(path), num_blocks=64, block_size=8, max_num_seqs=4)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == _hf_greedy(str(path)) and len({t for row in got for t in row}) > 6
    if arch == "qwen2":  # the file's tokenizer (pre-tokenizer "qwen2") is the checkpoint's own
        text = "Return  the sum of 12345 numbers.\n\tdef f(x):"
        assert llm.tokenizer.encode(text) == AutoTokenizer.from_pretrained(base).encode(text)


def test_embed_a_gguf_file(llama_256, tmp_path) -> None:
    """task=embed on a GGUF file pools the last hidden state transformers' own ``gguf_file=`` loading computes,
    from the API and from a job naming the file with model.gguf_file."""
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config
    from transformers import AutoModel

    from batchgen.job.run import EXIT_OK, run_job

    path = Path(write_gguf(llama_256, tmp_path / "m.gguf", MIXES["mixed"]))
    llm = LLM(str(path), task="embed", num_blocks=64, block_size=8)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, normalize=False, use_tqdm=False)])
    hf = AutoModel.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.stack([hf(input_ids=torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    pq.write_table(pa.table({"prompt": ["def main():", "Once upon a time"]}), tmp_path / "in.parquet")
    job = job_config(str(tmp_path), tmp_path / "in.parquet", tmp_path / "out")
    job.model.gguf_file = path.name
    res = run_job(dataclasses.replace(job, task="embed"), handle_signals=False, print_summary=False)
    assert res.exit_code == EXIT_OK, res.message
    out = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "out").glob("*.parquet"))).sort_by(
        "id"
    )
    want = llm.embed(["def main():", "Once upon a time"], use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor(out.column("embedding").to_pylist()),
        torch.tensor([w.outputs.embedding for w in want]),
        atol=1e-5,
        rtol=1e-5,
    )


def test_head_size_from_the_file_where_transformers_keeps_a_default(ckpt_factory, tmp_path) -> None:
    """A qwen3 file whose heads are not the config class's default 128 wide (``attention.key_length`` 64):
    transformers' reading of the file keeps 128 and cannot load it; batchgen reads the head size from the file,
    and a float32 file's greedy output equals transformers' run of the checkpoint it was written from."""
    from quant_helpers import transformers_greedy

    base = ckpt_factory("qwen3", seed=32, hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    path = write_gguf(base, tmp_path / "f32.gguf", 0)  # F32 tensors: the checkpoint's own weights
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    assert llm.engine.model.config.head_dim == 64
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == transformers_greedy(base, PROMPTS, NEW) and len({t for row in got for t in row}) > 6


@pytest.mark.parametrize(
    "arch, overrides, types",
    [
        # llama.cpp's phi3 files: fused attn_qkv and gate/up ffn_up; transformers' reading keeps Phi3Config's
        # pad token 32000, so the vocabulary is Phi-3's 32064
        ("phi3", dict(vocab_size=32064, head_dim=64, rope_parameters=model_zoo._ROPE), Q4_K),
        # Gemma's norm weights stored as 1 + w; a sliding window (8) shorter than the sequences
        ("gemma2", dict(head_dim=64), Q8_0),
        ("gemma3_text", dict(head_dim=64), MIXES["mixed"]),
    ],
)
def test_phi3_and_gemma_files_equal_transformers(tmp_path, arch, overrides, types) -> None:
    """phi3, gemma2 and gemma3 files: greedy output and prompt logprobs equal transformers' ``gguf_file=``
    loading (the logprobs hold every position: gemma2's random weights repeat one token greedily)."""
    path = Path(write_gguf(model_zoo.checkpoint(arch, seed=31, hidden_size=256, intermediate_size=512, **overrides),
                           tmp_path / f"{arch}.gguf", types))  # fmt: skip
    llm = LLM(str(path), num_blocks=64, block_size=8, max_num_seqs=4)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in LONG_PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(str(path), LONG_PROMPTS)
    _assert_prompt_logprobs_equal(str(path), LONG_PROMPTS, outs)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip


@pytest.mark.parametrize(
    "arch, overrides, write",
    [
        # a Llama-2 / Mistral-like Q4_K_M release: SentencePiece vocabulary (1003 tokens), the embedding Q6_K and
        # tied to the head, F16 norms, Llama 3.1's rope_freqs tensor, general.* and tokenizer metadata
        ("llama", dict(vocab_size=1003, head_dim=64, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
         dict(types={"attn_v": Q6_K, "ffn_down": Q6_K}, embed_type=Q6_K, norm_type=1, name="Mistral 7B Instruct")),
        # Phi-3: SentencePiece in a phi3 file, embedding Q4_K, head Q8_0
        ("phi3", dict(vocab_size=1003, head_dim=64, rope_parameters=model_zoo._ROPE),
         dict(types=Q8_0, embed_type=Q4_K, output_type=Q8_0)),
    ],
)  # fmt: skip
def test_llama_cpp_release_files_equal_transformers(tmp_path, arch, overrides, write) -> None:
    """Files laid out as llama.cpp's converter and quantizer write them (``write_gguf(release=True)``,
    ``tokenizer="llama"``): prompts encode, chats render (the template's BOS, none added) and greedy output
    and prompt logprobs equal transformers' ``gguf_file=`` loading of the same file."""
    from transformers import AutoTokenizer

    base = model_zoo.checkpoint(arch, seed=31, hidden_size=256, intermediate_size=512, **overrides)
    path = Path(write_gguf(base, tmp_path / f"{arch}.gguf", tokenizer="llama", release=True, **write))
    llm = LLM(str(path), num_blocks=64, block_size=8, max_num_seqs=4)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = ["Return the sum of a list of numbers.", "  The class\n\tdef f(x): ünïcode"]
    prompts = [ref.encode(t) for t in texts]
    assert all(p[0] == 1 for p in prompts)  # add_bos_token: <s>
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(texts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(str(path), prompts)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 6
    assert [o.outputs[0].text for o in outs] == [ref.decode(o.outputs[0].token_ids) for o in outs]
    _assert_prompt_logprobs_equal(str(path), prompts, outs)
    chat = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat([chat], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    want_ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    assert out.prompt_token_ids == want_ids and want_ids.count(1) == 1


def _rewrite_gguf(src: str, out: Path, fields: dict | None = None, tensors=None) -> Path:
    """A copy of the GGUF file `src` at `out` with the key-values `fields` added (name: (value, type)) and each
    tensor replaced by ``tensors(t)``'s ``(name, data, type)`` triples (unchanged when None)."""
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for name, (value, vtype) in (fields or {}).items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        for name, data, ttype in tensors(t) if tensors else [(t.name, np.asarray(t.data), t.tensor_type)]:
            writer.add_tensor(name, data, raw_dtype=ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_mixtral_files_run(tmp_path) -> None:
    """A Mixtral GGUF file (architecture llama with ``expert_count`` and stacked ``*_exps`` experts, which
    transformers' reading takes for a dense llama whose MLPs are missing) runs as Mixtral: a float32 file gives
    transformers' greedy output on the checkpoint it was written from, a Q8_0 file (experts packed) the output on
    that checkpoint with its projections quantized and dequantized as the file holds them. The experts llama.cpp
    wrote one tensor each before 2024 are refused in one line (a job ends with exit status 2)."""
    import shutil

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config
    from quant_helpers import transformers_greedy
    from safetensors.torch import load_file, save_file

    from batchgen.job.run import EXIT_CONFIG, run_job
    from batchgen.models.moe import PackedExperts

    base = model_zoo.checkpoint("mixtral", **MOE)
    f32 = LLM(write_gguf(base, tmp_path / "f32.gguf", 0, tokenizer="llama"), num_blocks=64, block_size=8)
    assert f32.engine.model.config.architecture == "MixtralForCausalLM"
    got = [o.outputs[0].token_ids for o in f32.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))]  # fmt: skip
    assert got == transformers_greedy(base, PROMPTS, NEW) and len({t for row in got for t in row}) > 6
    q8 = write_gguf(base, tmp_path / "q8.gguf", Q8_0, tokenizer="llama", release=True)
    llm = LLM(q8, num_blocks=64, block_size=8, max_num_seqs=4)
    assert isinstance(llm.engine.model.model.layers[0].mlp.experts, PackedExperts)
    dq = tmp_path / "dq"  # the checkpoint with what the file holds: Q8_0 projections, float router
    shutil.copytree(base, dq)
    state, fmt = load_file(str(dq / "model.safetensors")), gguf.GGMLQuantizationType.Q8_0
    for k, w in state.items():
        if w.dim() == 2 and "embed" not in k and "lm_head" not in k and not k.endswith(".gate.weight"):
            state[k] = torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), fmt), fmt).copy()
            )
    save_file(state, str(dq / "model.safetensors"))
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))]  # fmt: skip
    assert got == transformers_greedy(str(dq), PROMPTS, NEW)

    def one_per_expert(t):  # blk.N.ffn_gate.E.weight, as llama.cpp's converter wrote Mixtral until 2024
        if "_exps." not in t.name:
            return [(t.name, np.asarray(t.data), t.tensor_type)]
        return [(t.name.replace("_exps.", f".{e}."), np.asarray(t.data[e]), t.tensor_type) for e in range(4)]

    old = _rewrite_gguf(q8, tmp_path / "old.gguf", tensors=one_per_expert)
    with pytest.raises(UnsupportedCheckpoint, match="old.gguf is a mixture-of-experts model .*4 experts.* "
                                                     "whose expert tensors batchgen does not read"):  # fmt: skip
        LLM(str(old), num_blocks=64, block_size=8)
    pq.write_table(pa.table({"prompt": ["def main():"]}), tmp_path / "in.parquet")
    res = run_job(job_config(str(old), tmp_path / "in.parquet", tmp_path / "out"), handle_signals=False,
                  print_summary=False)  # fmt: skip
    assert (
        res.exit_code == EXIT_CONFIG and "\n" not in res.message and "Hugging Face checkpoint" in res.message
    )


MOE = dict(seed=5, hidden_size=256, intermediate_size=512, head_dim=64)


@pytest.mark.parametrize(
    "arch, overrides, types",
    [
        # transformers' reading keeps Qwen3MoeConfig's expert width (768): the file's own here
        ("qwen3_moe", dict(moe_intermediate_size=768),
         {"ffn_gate_exps": Q4_K, "ffn_up_exps": Q4_0, "ffn_down_exps": Q6_K, "attn_q": Q4_K}),
        # a shared expert (sigmoid-gated, its gate stored 1-D), Qwen2MoeConfig's default widths
        ("qwen2_moe", dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632, mlp_only_layers=[]),
         {"ffn_gate_exps": Q8_0, "ffn_up_exps": Q4_0, "ffn_down_exps": Q4_1, "ffn_gate_shexp": Q4_0}),
    ],
)  # fmt: skip
def test_moe_files_equal_transformers(tmp_path, arch, overrides, types) -> None:
    """qwen3moe and qwen2moe files: the experts stay packed per expert (each expert's gate and up rows one
    projection, each part its format) and greedy output and prompt logprobs equal transformers' ``gguf_file=``
    loading (which dequantizes them)."""
    from batchgen.models.moe import PackedExperts

    path = Path(write_gguf(model_zoo.checkpoint(arch, **MOE, **overrides), tmp_path / "moe.gguf", types))
    llm = LLM(str(path), num_blocks=64, block_size=8, max_num_seqs=4)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert isinstance(experts, PackedExperts) and all(isinstance(m, QuantLinear) for m in experts.gate_up)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in LONG_PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(str(path), LONG_PROMPTS)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 6
    _assert_prompt_logprobs_equal(str(path), LONG_PROMPTS, outs)


def test_moe_expert_width_from_the_file(tmp_path) -> None:
    """A qwen3moe file whose experts are not Qwen3MoeConfig's default 768 wide (``expert_feed_forward_length``
    48): transformers' reading keeps 768 and cannot load it; batchgen reads the width from the file, and a
    float32 file's experts (stacked, not packed) give the greedy output of transformers' run of the checkpoint
    it was written from."""
    from quant_helpers import transformers_greedy

    base = model_zoo.checkpoint("qwen3_moe", **MOE, moe_intermediate_size=48)
    llm = LLM(write_gguf(base, tmp_path / "f32.gguf", 0), num_blocks=64, block_size=8, max_num_seqs=4)
    assert llm.engine.model.model.layers[0].mlp.experts.intermediate_size == 48
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == transformers_greedy(base, PROMPTS, NEW) and len({t for row in got for t in row}) > 6


def test_one_part_of_a_split_file_refused_in_one_line(llama_256, tmp_path) -> None:
    """The first part of a model llama.cpp's gguf-split cut in two (``split.count`` 2; the last layer's tensors
    in the second file) is refused in one line saying how to merge the parts (it failed on a missing tensor)."""
    import numpy as np

    U16, I32 = gguf.GGUFValueType.UINT16, gguf.GGUFValueType.INT32
    out = _rewrite_gguf(
        write_gguf(llama_256, tmp_path / "whole.gguf", Q8_0),
        tmp_path / "m-00001-of-00002.gguf",
        {"split.no": (0, U16), "split.count": (2, U16), "split.tensors.count": (20, I32)},
        lambda t: [] if t.name.startswith("blk.1.") else [(t.name, np.asarray(t.data), t.tensor_type)],
    )
    with pytest.raises(
        UnsupportedCheckpoint, match="is part 1 of 2 of a split model: .* llama-gguf-split --merge"
    ):
        LLM(str(out), num_blocks=64, block_size=8)


def test_k_quant_rows_that_are_not_whole_blocks_are_refused_at_load(ckpt_factory, tmp_path) -> None:
    """A K-quant row of 64 values cannot be whole 256-value blocks (llama.cpp stores such rows in another type):
    refused when the file is read, not at the job's first step."""
    small = ckpt_factory("llama", seed=3, hidden_size=64, intermediate_size=256)
    bad = write_gguf(small, tmp_path / "k.gguf", 12)  # Q4_K everywhere: rows of 64 written as no whole block
    with pytest.raises(
        UnsupportedCheckpoint, match=r"k.gguf is Q4_K with rows of \d+ values, not whole 256-value"
    ):
        LLM(str(bad), num_blocks=16, block_size=8)
