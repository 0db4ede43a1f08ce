"""Quantized checkpoints and GGUF files under tensor parallelism: each rank reads only its slice of the packed
weights, scales and zero points (in each format's own layout), and its projections' dequantized weights are
exactly its slice of the whole model's; greedy output over two ranks equals one process's; what cannot split is
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.models.loader import load_model
from batchgen.models.quant import writers
from batchgen.models.quant.gguf_checkpoint import UnsupportedCheckpoint


def _ct(**kwargs):
    def write(base, out):
        pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
        from quant_helpers import write_compressed_tensors

        return write_compressed_tensors(base, out, **kwargs)

    return write


FORMATS = {
    "ct-int4-g64": _ct(bits=4, group_size=64),  # streamed as stored
    "ct-int8-channel-asym": _ct(bits=8, group_size=None, symmetric=False),  # zero points packed along outputs
    "gptq4-asym-g32": lambda b, o: writers.write_gptq(b, o, bits=4, group_size=32, sym=False),
    "awq4-g32": lambda b, o: writers.write_awq(b, o, group_size=32),  # outputs packed 8 per word
    "fp8-block": lambda b, o: writers.write_block_fp8(b, o, block=(32, 64)),
    "fp8-ct-tensor": lambda b, o: writers.write_compressed_fp8(b, o, strategy="tensor"),
    "w8a8-static": lambda b, o: writers.write_compressed_w8a8(b, o, weights="int8", inputs="static"),
}


@pytest.fixture(scope="module")
def llama_256(ckpt_factory) -> str:
    return ckpt_factory("llama", seed=35, hidden_size=256, intermediate_size=512)  # 4 heads, 2 K/V heads


def _rows(whole: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([whole[a : a + n] for a, n in ranges])


def _assert_layers_are_rank_slices(shard, whole, rank: int) -> None:
    """Every layer's dequantized projections on `rank` of two are exactly its slice of the whole model's: q/k/v
    and gate/up by output rows (K/V by their heads), o and down by inputs."""
    cfg = whole.config
    q_rows, kv_rows, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    for i in range(cfg.num_layers):
        ours, full = shard.model.layers[i], whole.model.layers[i]
        want_qkv = _rows(full.self_attn.qkv_proj.dense_weight(),
                         [(rank * q_rows // 2, q_rows // 2), (q_rows + rank * kv_rows // 2, kv_rows // 2),
                          (q_rows + kv_rows + rank * kv_rows // 2, kv_rows // 2)])  # fmt: skip
        assert torch.equal(ours.self_attn.qkv_proj.dense_weight(), want_qkv)
        want = _rows(full.mlp.gate_up_proj.dense_weight(),
                     [(rank * inter // 2, inter // 2), (inter + rank * inter // 2, inter // 2)])  # fmt: skip
        assert torch.equal(ours.mlp.gate_up_proj.dense_weight(), want)
        for name in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: the rank's inputs
            w = full.get_submodule(name).dense_weight()
            k = w.shape[1] // 2
            assert torch.equal(ours.get_submodule(name).dense_weight(), w[:, rank * k : (rank + 1) * k])


def _greedy_one_and_two_ranks(path, prompts: list[list[int]]) -> tuple[list, list]:
    """The greedy token ids of `prompts` from one process and over two tensor-parallel ranks."""
    greedy = SamplingParams(temperature=0, max_tokens=10)
    engine = {"device": "cpu", "num_blocks": 64, "block_size": 8}
    want = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(prompts, greedy, use_tqdm=False)]
    sharded = LLM(path, tensor_parallel_size=2, **engine)
    return want, [o.outputs[0].token_ids for o in sharded.generate(prompts, greedy, use_tqdm=False)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_rank_holds_exactly_its_slice_of_the_dequantized_weights(llama_256, tmp_path, fmt) -> None:
    path = FORMATS[fmt](llama_256, tmp_path / fmt)
    whole = load_model(path)
    for rank in (0, 1):
        shard = load_model(path, tp_rank=rank, tp_size=2)
        _assert_layers_are_rank_slices(shard, whole, rank)
        if fmt == "w8a8-static":
            proj = shard.model.layers[0].self_attn.qkv_proj
            assert torch.equal(proj.input_scale, whole.model.layers[0].self_attn.qkv_proj.input_scale)


def test_greedy_over_two_ranks_equals_one_process(llama_256, tmp_path) -> None:
    path = writers.write_gptq(llama_256, tmp_path / "gptq", bits=4, group_size=32, sym=False)
    want, got = _greedy_one_and_two_ranks(
        path, [[1, 5, 9, 33, 7], [4, 4, 4, 100, 200, 300, 17], list(range(10, 40))]
    )
    assert got == want and len({t for row in got for t in row}) > 6


def test_what_cannot_split_is_refused_by_name(llama_256, tmp_path) -> None:
    act_order = writers.write_gptq(llama_256, tmp_path / "desc", desc_act=True)
    with pytest.raises(UnsupportedCheckpoint, match="GPTQ desc_act"):
        load_model(act_order, tp_rank=0, tp_size=2)
    # a GGUF row of one 256-value block cannot split over two ranks
    pytest.importorskip("gguf", reason="the gguf extra is not installed")
    from batchgen.models.quant.gguf_writer import write_gguf

    k_quant = write_gguf(llama_256, tmp_path / "k.gguf", {"attn_output": 12}, seed=1)
    with pytest.raises(UnsupportedCheckpoint, match="attn_output.weight holds 1 blocks per row"):
        load_model(k_quant, tp_rank=0, tp_size=2)
    # fp8 blocks of 96 rows: a rank's 128 rows of q/gate would start inside a block
    blocks = writers.write_block_fp8(llama_256, tmp_path / "blocks", block=(96, 64))
    with pytest.raises(UnsupportedCheckpoint, match="not whole fp8 scale blocks of 96"):
        load_model(blocks, tp_rank=1, tp_size=2)
    # int4 groups of 128 over the 256 inputs of o_proj: two ranks hold a group each, four would split one
    ct = _ct(bits=4, group_size=128)(llama_256, tmp_path / "ct")
    cfg = json.loads((Path(ct) / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 128
    load_model(ct, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        load_model(ct, tp_rank=0, tp_size=4)


GGUF_MIX = {"attn_q": 12, "attn_k": 14, "attn_v": 13, "attn_output": 8, "ffn_gate": 11, "ffn_up": 10,
            "ffn_down": 12}  # fmt: skip
"""Q4_K, Q6_K, Q5_K, Q8_0, Q3_K, Q2_K, Q4_K: every row-parallel row (256 or 512 inputs) splits into whole blocks."""


def test_a_gguf_file_splits_into_each_ranks_rows_and_blocks(llama_256, tmp_path) -> None:
    pytest.importorskip("gguf", reason="the gguf extra is not installed")
    from batchgen.models.quant.gguf_writer import write_gguf

    path = write_gguf(
        llama_256, tmp_path / "m.gguf", GGUF_MIX, seed=2, output_type=14
    )  # the head in Q6_K too
    whole = load_model(path)
    vocab = whole.lm_head.dense_weight()
    for rank in (0, 1):
        shard = load_model(path, tp_rank=rank, tp_size=2)
        _assert_layers_are_rank_slices(shard, whole, rank)
        rows = -(
            -whole.config.vocab_size // 2
        )  # the vocabulary-parallel head: the rank's rows, the last one padded
        head = shard.lm_head.dense_weight()
        part = vocab[rank * rows : (rank + 1) * rows]
        assert torch.equal(head[: part.shape[0]], part) and not head[part.shape[0] :].any()


def test_a_gguf_file_over_two_ranks_gives_one_process_greedy_output(llama_256, tmp_path) -> None:
    pytest.importorskip("gguf", reason="the gguf extra is not installed")
    from batchgen.models.quant.gguf_writer import write_gguf

    path = write_gguf(
        llama_256, tmp_path / "m.gguf", {"attn_output": 2, "ffn_down": 8}, seed=3
    )  # Q8_0 elsewhere
    want, got = _greedy_one_and_two_ranks(path, [[1, 5, 9, 33, 7], list(range(10, 40))])
    assert got == want and len({t for row in got for t in row}) > 6


@pytest.mark.parametrize("weights", ["int8", "fp8"])
def test_dynamic_per_token_inputs_over_two_ranks_equal_one_process(llama_256, tmp_path, weights) -> None:
    """W8A8 / FP8_DYNAMIC: a row-parallel projection's token scale comes from the token's whole input (the
    ranks' slices reduced), so each rank quantizes the token as one process does."""
    path = writers.write_compressed_w8a8(llama_256, tmp_path / weights, weights=weights)
    shard = load_model(path, tp_rank=0, tp_size=2)
    down = shard.model.layers[0].mlp.down_proj
    assert (
        down.token_scales_over_ranks and not shard.model.layers[0].self_attn.qkv_proj.token_scales_over_ranks
    )
    want, got = _greedy_one_and_two_ranks(path, [[1, 5, 9, 33, 7], list(range(10, 40))])
    assert got == want and len({t for row in got for t in row}) > 4
