"""Checkpoint tooling and loading: tiny checkpoints, tokenizer, safetensors streaming, error messages."""

from __future__ import annotations

import gc
import json
import pickle
import shutil
import threading
import time
import weakref
from pathlib import Path

import model_zoo
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import batchgen.models
from batchgen.kernels import cpu_linear
from batchgen.models import NATIVE_ARCHITECTURES, load_model, load_tokenizer, loader, packed_linear
from batchgen.models.packed_linear import PackedLinear, dense_state_dict
from batchgen.models.tiny import CHAT_TEMPLATE, EOS_TOKEN, IM_END, build_tokenizer, tiny_default_checkpoint

TEXTS = [
    "Hello world! The quick brown fox's   jumps\n\n over 12345 dogs.",
    "  leading spaces\ttabs\r\nCRLF é ü 你好 🤗 e\u0301",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_auto_tokenizer_matches_built_tokenizer(arch, request):
    path = request.getfixturevalue(f"{arch}_ckpt")
    built = PreTrainedTokenizerFast.from_pretrained(path)
    auto = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert auto.encode(text) == built.encode(text), (arch, text)
    assert auto.eos_token == EOS_TOKEN
    assert auto.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>assistant\n"
    )
    gen = json.loads((Path(path) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [auto.convert_tokens_to_ids(EOS_TOKEN), auto.convert_tokens_to_ids(IM_END)]


def test_tokenizer_deterministic_and_cached(tmp_path):
    a = build_tokenizer(tmp_path / "a", vocab_size=1024)
    b = build_tokenizer(tmp_path / "b", vocab_size=1024)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert len(a) == len(b) == 1024
    mtime = (tmp_path / "a" / "tokenizer.json").stat().st_mtime_ns
    build_tokenizer(tmp_path / "a", vocab_size=1024)
    assert (tmp_path / "a" / "tokenizer.json").stat().st_mtime_ns == mtime


def test_tiny_default_checkpoint_is_the_shipped_model():
    # The embedded default ships with the package: nothing is built, copied or cached at run time.
    p1 = tiny_default_checkpoint()
    assert Path(p1).parent == Path(batchgen.models.__file__).parent
    model = load_model(p1)
    assert model.config.tie_word_embeddings and model.config.architecture == "LlamaForCausalLM"
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 5_000_000


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in dense_state_dict(model).items()}


def test_sharded_checkpoint_with_index(ckpt_factory, llama_ckpt):
    sharded = Path(ckpt_factory("llama", max_shard_size="100KB"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = _state(load_model(sharded)), _state(load_model(llama_ckpt))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_missing_shard_named(ckpt_factory, tmp_path):
    ckpt = _copy(ckpt_factory("llama", max_shard_size="100KB"), tmp_path / "c")
    victim = sorted(ckpt.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(ckpt)


def test_dtype_auto_and_override(ckpt_factory, qwen2_ckpt):
    assert load_model(qwen2_ckpt).config.dtype == torch.float32
    m16 = load_model(qwen2_ckpt, dtype="float16")  # held in float16, computed in float32 on the CPU
    assert m16.config.weight_dtype == torch.float16 and m16.config.dtype == torch.float32
    attn = m16.model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == m16.model.embed_tokens.weight.dtype == torch.float16
    assert attn.qkv_proj.bias.dtype == m16.model.norm.weight.dtype == torch.float32
    ref = load_model(qwen2_ckpt, dtype=torch.float32)
    w = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(dense_state_dict(m16)[w], dense_state_dict(ref)[w].half())
    bf = ckpt_factory("qwen2", seed=2, dtype=torch.bfloat16)
    assert json.loads((Path(bf) / "config.json").read_text())["dtype"] == "bfloat16"
    auto = load_model(bf)
    assert (auto.config.weight_dtype, auto.config.dtype) == (torch.bfloat16, torch.float32)
    assert {p.dtype for p in auto.parameters()} == {torch.bfloat16, torch.float32}
    assert {p.dtype for p in load_model(bf, dtype="float32").parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(qwen2_ckpt, dtype="int8")


def test_fused_projections_and_tied_embeddings(ckpt_factory):
    path = ckpt_factory("qwen2", tie_word_embeddings=True, seed=11)
    model = load_model(path)
    assert torch.equal(_dense(model.lm_head, "weight"), model.model.embed_tokens.weight)
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        qkv = model.model.layers[1].self_attn.qkv_proj
        names = ["q_proj", "k_proj", "v_proj"]
        for kind in ("weight", "bias"):
            want = torch.cat([f.get_tensor(f"model.layers.1.self_attn.{n}.{kind}") for n in names])
            assert torch.equal(_dense(qkv, kind), want)
        gate_up = torch.cat([f.get_tensor(f"model.layers.0.mlp.{n}_proj.weight") for n in ("gate", "up")])
        assert torch.equal(_dense(model.model.layers[0].mlp.gate_up_proj, "weight"), gate_up)


def _dense(module: torch.nn.Module, kind: str) -> torch.Tensor:
    """A (packed or plain) linear's weight or bias as loaded."""
    if isinstance(module, PackedLinear):
        return module.dense_weight() if kind == "weight" else module.dense_bias()
    return getattr(module, kind)


@pytest.mark.parametrize("layout", ["panels", "onednn"])
def test_float32_cpu_projections_packed(ckpt_factory, qwen2_ckpt, monkeypatch, layout):
    """Float32 CPU projections are packed, in batchgen's panels where its C kernels build, else for oneDNN
    (same values, same outputs as F.linear); experts are stored transposed in memory; the embedding, norms and
    other dtypes keep their layout; a small tied head is packed as a copy while the embedding keeps the
    table."""
    if layout == "onednn":
        monkeypatch.setenv("BATCHGEN_CPU_KERNEL", "0")
        if not packed_linear.onednn_available():
            pytest.skip("this torch build has no oneDNN")
    elif not cpu_linear.available():
        pytest.skip("batchgen's C kernels do not build here (no C compiler)")
    model = load_model(qwen2_ckpt)
    attn = model.model.layers[0].self_attn
    for lin in (attn.qkv_proj, attn.o_proj, model.model.layers[0].mlp.down_proj, model.lm_head):
        assert isinstance(lin, PackedLinear) and lin.layout == layout
        assert lin.weight.is_mkldnn == (layout == "onednn")
    with safe_open(str(Path(qwen2_ckpt) / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
        assert torch.equal(attn.o_proj.dense_weight(), w)
        qkv = torch.cat([f.get_tensor(f"model.layers.0.self_attn.{n}_proj.weight") for n in "qkv"])
        bias = torch.cat([f.get_tensor(f"model.layers.0.self_attn.{n}_proj.bias") for n in "qkv"])
    x = torch.randn(2, 3, attn.qkv_proj.in_features)
    torch.testing.assert_close(
        attn.qkv_proj(x), torch.nn.functional.linear(x, qkv, bias), rtol=1e-5, atol=1e-5
    )
    assert model.model.embed_tokens.weight.is_contiguous()
    assert model.model.layers[0].input_layernorm.weight.is_contiguous()
    bf16 = load_model(qwen2_ckpt, dtype="bfloat16")
    assert all(p.is_contiguous() for p in bf16.parameters())
    assert bf16.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    experts = load_model(model_zoo.checkpoint("qwen3_moe")).model.layers[0].mlp.experts
    assert experts.gate_up_proj.transpose(-2, -1).is_contiguous()
    tied = load_model(ckpt_factory("qwen2", tie_word_embeddings=True, seed=11))
    assert isinstance(tied.lm_head, PackedLinear) and tied.model.embed_tokens.weight.is_contiguous()
    assert torch.equal(tied.lm_head.dense_weight(), tied.model.embed_tokens.weight)


def test_large_tied_head_stays_shared(ckpt_factory, monkeypatch):
    """Above the copy budget a tied head keeps the embedding's table (no second copy) and its layout."""
    monkeypatch.setattr(packed_linear, "TIED_HEAD_COPY_MAX_BYTES", 0)
    tied = load_model(ckpt_factory("qwen2", tie_word_embeddings=True, seed=11))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight and tied.lm_head.weight.is_contiguous()
    assert isinstance(tied.model.layers[0].self_attn.o_proj, PackedLinear)


@pytest.mark.parametrize("how", ["torch without oneDNN", "BATCHGEN_ONEDNN=0"])
def test_without_packing_projections_are_column_major(qwen2_ckpt, monkeypatch, how):
    """Neither batchgen's C kernels nor oneDNN: projections stay `nn.Linear`, stored column-major."""
    monkeypatch.setenv("BATCHGEN_CPU_KERNEL", "0")
    if how == "BATCHGEN_ONEDNN=0":
        monkeypatch.setenv("BATCHGEN_ONEDNN", "0")
    else:
        monkeypatch.setattr(packed_linear, "onednn_available", lambda: False)
    model = load_model(qwen2_ckpt)
    attn = model.model.layers[0].self_attn
    for w in (attn.qkv_proj.weight, attn.o_proj.weight, model.model.layers[0].mlp.down_proj.weight):
        assert w.t().is_contiguous() and not w.is_contiguous()


def test_streaming_holds_one_checkpoint_tensor_at_a_time(llama_ckpt, monkeypatch):
    """The loader never materialises a second state dict: at most one read tensor is alive at any time."""
    live: set[int] = set()
    peak = {"live": 0, "reads": 0}
    real_safe_open = loader.safe_open

    class Tracking:
        def __init__(self, handle):
            self._h = handle

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, name):
            t = self._h.get_tensor(name)
            live.add(id(t))
            weakref.finalize(t, live.discard, id(t))
            peak["reads"] += 1
            peak["live"] = max(peak["live"], len(live))
            return t

    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: Tracking(real_safe_open(*a, **k)))
    model = load_model(llama_ckpt)
    n_hf_tensors = (
        2 + model.config.num_layers * 9
    )  # embed, norm, lm_head + per layer q,k,v,o,gate,up,down, 2 norms
    assert peak["reads"] == n_hf_tensors + 1
    assert peak["live"] == 1


def test_streaming_rss_growth_about_one_model(ckpt_factory):
    """Loading a ~24 MB checkpoint grows RSS by about one model, not two."""
    path = ckpt_factory(
        "llama", hidden_size=256, num_layers=4, intermediate_size=1024, vocab_size=4096, seed=12
    )
    size = (Path(path) / "model.safetensors").stat().st_size
    psutil = pytest.importorskip("psutil", reason="RSS sampling needs psutil (the bench extra)")
    gc.collect()
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak = before
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        model = load_model(path)
    finally:
        stop.set()
        sampler.join()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes > 0.9 * size
    print(f"RSS growth {(peak - before) / 2**20:.1f} MiB for a {model_bytes / 2**20:.1f} MiB model")
    assert peak - before < 1.6 * model_bytes, (peak - before, model_bytes)


def test_unsupported_architecture_lists_supported(llama_ckpt, tmp_path):
    ckpt = _copy(llama_ckpt, tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel") as e:
        load_model(ckpt, implementation="native")
    assert all(a in str(e.value) for a in NATIVE_ARCHITECTURES)
    assert "model.implementation=transformers" in str(e.value)
    # auto: the transformers backend takes it, and refuses Llama weights under a GPT-2 config
    with pytest.raises(ValueError, match="does not match GPT2LMHeadModel: missing or misshapen"):
        load_model(ckpt)


def test_moe_experts_stacked_from_either_checkpoint_layout(tmp_path):
    """Per-expert tensors (Mixtral's block_sparse_moe.experts.N.w1/w3/w2, Qwen's experts.N.*_proj) and
    already-stacked ones (transformers 5.x in-memory layout) load into the same stacked parameters."""
    import model_zoo

    for arch, names in [
        ("mixtral", ("w1", "w3", "w2")),
        ("qwen3_moe", ("gate_proj", "up_proj", "down_proj")),
    ]:
        src = Path(model_zoo.checkpoint(arch))
        model = load_model(src)
        tensors = load_file(src / "model.safetensors")
        prefix = "model.layers.0." + ("block_sparse_moe" if arch == "mixtral" else "mlp")
        experts = model.model.layers[0].mlp.experts
        gate, up, down = (tensors[f"{prefix}.experts.1.{n}.weight"] for n in names)
        assert torch.equal(experts.gate_up_proj[1], torch.cat([gate, up]))
        assert torch.equal(experts.down_proj[1], down)
        # rewrite layer 0's experts as two stacked tensors
        stacked = dict(tensors)
        num = experts.gate_up_proj.shape[0]
        ups = [
            torch.cat([stacked.pop(f"{prefix}.experts.{e}.{n}.weight") for n in names[:2]])
            for e in range(num)
        ]
        downs = [stacked.pop(f"{prefix}.experts.{e}.{names[2]}.weight") for e in range(num)]
        stacked[f"{prefix}.experts.gate_up_proj"] = torch.stack(ups)
        stacked[f"{prefix}.experts.down_proj"] = torch.stack(downs)
        ckpt = _copy(str(src), tmp_path / arch)
        save_file(stacked, ckpt / "model.safetensors", metadata={"format": "pt"})
        again = load_model(ckpt)
        for (name, a), (_, b) in zip(dense_state_dict(model).items(), dense_state_dict(again).items()):
            assert torch.equal(a, b), name
        # both layouts at once write the experts twice
        both = dict(tensors)
        both[f"{prefix}.experts.down_proj"] = torch.stack(downs)
        save_file(both, ckpt / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match="twice"):
            load_model(ckpt)


def test_missing_tensor_named(llama_ckpt, tmp_path):
    ckpt = _copy(llama_ckpt, tmp_path / "c")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"
    ):
        load_model(ckpt)


def test_unexpected_and_misshapen_tensors_named(llama_ckpt, tmp_path):
    ckpt = _copy(llama_ckpt, tmp_path / "c")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:8]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in model\.safetensors has shape"
    ):
        load_model(ckpt)
    tensors = load_file(Path(llama_ckpt) / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight' in model\.safetensors"
    ):
        load_model(ckpt)


def test_never_reads_pickle(llama_ckpt, tmp_path, monkeypatch):
    ckpt = _copy(llama_ckpt, tmp_path / "c")
    torch.save({"boom": torch.zeros(1)}, ckpt / "pytorch_model.bin")

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle loading attempted")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    load_model(ckpt)  # safetensors preferred, the .bin is ignored
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin: pickle checkpoints are never loaded"):
        load_model(ckpt)


def test_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer("some-org/some-hub-model")


def test_load_tokenizer(qwen2_ckpt):
    tok = load_tokenizer(qwen2_ckpt)
    ref = PreTrainedTokenizerFast.from_pretrained(qwen2_ckpt)
    assert tok.encode(TEXTS[0]) == ref.encode(TEXTS[0])
    assert tok.eos_token == EOS_TOKEN
