"""The Triton weight-only GEMMs (``batchgen.kernels.quant_linear_triton``) against float64 products on the
dequantized weights, interpreted on CPU tensors and compiled on CUDA (marker ``gpu``); GGUF's block formats
repacked as grouped integers for them, against gguf-py's dequantization; and the quantized layers and whole
models on the GPU path (``TRITON_INTERPRET=1`` runs it on the CPU), greedy output against transformers."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import PROMPTS, batchgen_greedy, transformers_greedy, transformers_model

pytest.importorskip(
    "triton", reason="Triton is not installed (the kernels run compiled or in its interpreter)"
)

from batchgen import LLM  # noqa: E402
from batchgen.kernels.cpu_quant_linear import FORMATS, dequantize  # noqa: E402
from batchgen.kernels.quant_linear_triton import Tiles, fp8_linear_triton, gpu_tiles, int_linear_triton  # noqa: E402
from batchgen.models.quant import writers  # noqa: E402
from batchgen.models.quant.fp8 import Fp8Linear  # noqa: E402
from batchgen.models.quant.group_linear import GroupQuantLinear, IntPart, pack_along_inputs  # noqa: E402
from batchgen.models.quant.quant_linear import QuantLinear, on_triton  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]
SHAPES = [(1, 40, 64, 32), (5, 96, 256, 128), (70, 33, 128, 64)]  # (M, N, K, group): decode, tails, prefill


def _assert_product(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """`got` equals ``x @ wᵀ + bias`` (float64) within float32 summation error, bounded by ``|x| @ |w|ᵀ``."""
    x, w = x.double().reshape(-1, x.shape[-1]), w.double()
    want, bound = x @ w.t(), x.abs() @ w.abs().t()
    if bias is not None:
        want, bound = want + bias.double(), bound + bias.double().abs()
    err = (got.cpu().double().reshape(want.shape) - want).abs()
    assert (err <= 4e-6 * bound + 1e-7).all(), f"max error {err.max().item():.3g}"


def _int_case(n: int, k: int, group: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.05 + 0.01
    zero = torch.randn(n, k // group, generator=g) * 0.1
    return u, scales, zero


def _int_reference(u, scales, zero, group, bits, round_bf16=False) -> torch.Tensor:
    w = (u - (1 << (bits - 1))).float() * scales.repeat_interleave(group, 1)
    if zero is not None:
        w = w + zero.repeat_interleave(group, 1)
    return (w.to(torch.bfloat16).float() if round_bf16 else w).double()


def _int_product(device, x, u, bits, scales, group, bias=None, zero=None, **kwargs) -> torch.Tensor:
    """:func:`int_linear_triton` of the values `u` packed, every tensor moved to `device`."""
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    return int_linear_triton(on(x), on(pack_along_inputs(u, bits)), bits, on(scales), group, on(bias),
                             zero=on(zero), **kwargs)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_int_linear_matches_float64_on_dequantized_weights(device, bits, shape) -> None:
    m, n, k, group = shape
    u, scales, zero = _int_case(n, k, group, bits, seed=m + bits)
    x, bias = torch.randn(m, k), torch.randn(n)
    for z, b in ((None, None), (zero, bias)):
        got = _int_product(device, x, u, bits, scales, group, b, z)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        _assert_product(got, x, _int_reference(u, scales, z, group, bits), b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_the_gpu_tile_picks_and_k_split_in_slices_match_float64(device, fmt) -> None:
    """The configurations the GPU runs (narrow decode tiles with K split in slices summed afterwards, per-tile or
    gathered scales; the dequantized weight multiplied by torch above 16 rows), interpreted, against float64;
    slices that do not divide K evenly and the fused kernel on prefill rows too."""
    bits, per_word = (8, 1) if fmt == "fp8" else (int(fmt[3:]), 32 // int(fmt[3:]))
    cases = [
        ((m, n, k, group), gpu_tiles(m, k, group, per_word))
        for m, n, k, group in ((1, 40, 1024, 128), (9, 72, 512, 32), (40, 33, 256, 64), (130, 20, 192, 64))
    ]
    cases += [
        ((3, 24, 640, 128), Tiles(16, 16, 128, split=3)),  # 5 steps in slices of 2, 2, 1
        ((40, 33, 256, 64), Tiles(32, 32, 64)),  # the fused kernel on prefill rows
        ((130, 20, 192, 64), Tiles(128, 64, 64)),
    ]
    assert any(t is not None and t.split > 1 for _, t in cases[:4]) and any(t is None for _, t in cases[:4])
    assert any(t is not None and t.block_k == group for (_, _, _, group), t in cases)
    for i, ((m, n, k, group), tiles) in enumerate(cases):
        g = torch.Generator().manual_seed(i)
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        if fmt == "fp8":
            q, scales = _fp8_case(n, k, group, seed=i)
            w = _fp8_reference(q, scales, group)
            got = fp8_linear_triton(
                *(t.to(device) for t in (x, q, scales)), group, bias.to(device), tiles=tiles
            )
        else:
            u, scales, zero = _int_case(n, k, group, bits, seed=i)
            w = _int_reference(u, scales, zero, group, bits)
            got = _int_product(device, x, u, bits, scales, group, bias, zero, tiles=tiles)
        _assert_product(got, x, w, bias)


@pytest.mark.parametrize("device", DEVICES)
def test_int_linear_rounds_weights_to_bfloat16_writes_column_slices_and_takes_16_bit_inputs(device) -> None:
    n, k, group, bits = 48, 128, 32, 4
    u, scales, _ = _int_case(n, k, group, bits, seed=3)
    packed = pack_along_inputs(u, bits).to(device)
    x = torch.randn(3, 2, k)  # any leading shape
    got = int_linear_triton(x.to(device), packed, bits, scales.to(device), group, round_bf16=True)
    w = _int_reference(u, scales, None, group, bits, round_bf16=True)
    assert got.shape == (3, 2, n)
    _assert_product(got, x, w)
    out = torch.full((6, n + 10), 7.0, device=device)  # a fused projection's output: these columns only
    int_linear_triton(
        x.reshape(6, k).to(device),
        packed,
        bits,
        scales.to(device),
        group,
        round_bf16=True,
        out=out[:, 4 : 4 + n],
    )
    assert (out[:, :4] == 7).all() and (out[:, 4 + n :] == 7).all()
    torch.testing.assert_close(out[:, 4 : 4 + n].cpu(), got.reshape(6, n).cpu(), atol=1e-6, rtol=1e-6)
    for dtype in (torch.bfloat16, torch.float16):  # bfloat16 models on a GPU: the result in the input dtype
        x16 = x.reshape(6, k).to(dtype)
        got16 = int_linear_triton(x16.to(device), packed, bits, scales.to(device), group)
        assert got16.dtype == dtype
        want = x16.double() @ _int_reference(u, scales, None, group, bits).t()
        torch.testing.assert_close(got16.cpu().double(), want, atol=3e-2, rtol=2e-2)


def _fp8_case(n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    q[(q & 127) == 127] = 0  # NaN bytes: not weights
    q[0, :16] = torch.arange(16, dtype=torch.uint8)  # zero and subnormals
    q[1, :16] = torch.arange(128, 144, dtype=torch.uint8)  # negative zero and negative subnormals
    scales = torch.rand(n, -(-k // group), generator=g) + 0.5
    return q, scales


def _fp8_reference(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The dequantized float64 weight of fp8 bytes `q` with a scale per `group` inputs."""
    return q.view(torch.float8_e4m3fn).double() * scales.double().repeat_interleave(group, 1)[:, : q.shape[1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [32, 96, 200])  # 200: a last scale block of the row cut short
def test_fp8_linear_matches_float64_on_dequantized_weights(device, group) -> None:
    m, n, k = 9, 40, 256
    q, scales = _fp8_case(n, k, group, seed=group)
    x, bias = torch.randn(m, k), torch.randn(n)
    w = _fp8_reference(q, scales, group)
    got = fp8_linear_triton(x.to(device), q.to(device), scales.to(device), group, bias.to(device))
    _assert_product(got, x, w, bias)


@pytest.mark.parametrize("name", [f.name for f in FORMATS.values()])
def test_gguf_blocks_repacked_as_grouped_integers_equal_gguf_dequantization(name) -> None:
    from batchgen.models.quant.gguf_repack import repack
    from batchgen.models.quant.gguf_writer import random_blocks

    type_id = next(t for t, f in FORMATS.items() if f.name == name)
    k = 512
    packed = random_blocks(7, k, type_id, seed=type_id)
    want = dequantize(packed, type_id, k)  # gguf-py's dequantization, bit for bit
    part = repack(packed, type_id, k)
    assert part.bits in (4, 8) and 0 <= int(part.values.min()) and int(part.values.max()) < 1 << part.bits
    dense = GroupQuantLinear(k, [part]).dense_weight()
    if name in ("Q4_1", "Q4_K"):  # (u - 8) s + zero_term: a float32 sum of its own
        torch.testing.assert_close(dense, want, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(dense, want)


def test_on_triton_follows_the_device_and_the_interpreter_switch(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not on_triton(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert on_triton(torch.zeros(1))


def test_quantized_layers_on_the_gpu_path_equal_their_dense_weights(monkeypatch) -> None:
    """GroupQuantLinear (activation order, zero terms, two layouts fused), Fp8Linear (block scales that do not
    divide the inputs) and a GGUF projection repacked: the Triton path against ``x @ dense_weightᵀ + b``."""
    from batchgen.models.quant.gguf_checkpoint import quant_linear
    from batchgen.models.quant.gguf_writer import random_blocks

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = 256
    u4, s4, z4 = _int_case(24, k, 32, 4, seed=1)
    u8, s8, _ = _int_case(16, k, 64, 8, seed=2)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    group = GroupQuantLinear(
        k, [IntPart(u4, s4, 4, 32, perm=perm, zero_term=z4), IntPart(u8, s8, 8, 64)], bias=torch.randn(40)
    )
    q, scales = _fp8_case(30, k, 96, seed=5)
    fp8 = Fp8Linear(k, [(q.view(torch.float8_e4m3fn), scales, 96)], bias=None)
    parts = [(random_blocks(8, k, 12, seed=1), 12), (random_blocks(8, k, 14, seed=2), 14)]  # Q4_K beside Q6_K
    gguf = quant_linear(k, parts, None, torch.device("meta"))  # a device other than the CPU: repacked
    assert isinstance(gguf, GroupQuantLinear) and gguf.bits == [4, 8]
    gguf = GroupQuantLinear(k, [p for p in _parts_of(parts, k)])  # the same layer, on the CPU
    x = torch.randn(2, 3, k)
    for layer in (group, fp8, gguf):
        got = layer(x)
        assert got.shape == (2, 3, layer.out_features)
        _assert_product(got, x, layer.dense_weight(), layer.bias)


def _parts_of(parts, k):
    from batchgen.models.quant.gguf_repack import repack

    return [repack(p, t, k) for p, t in parts]


@pytest.fixture(scope="module")
def llama_64(ckpt_factory) -> str:
    """Small enough for the interpreter to run every projection of a whole model quickly."""
    return ckpt_factory("llama", seed=34, hidden_size=64, intermediate_size=128)


@pytest.mark.parametrize("kind", ["gptq-act-order", "ct-int4-bf16", "block-fp8"])
def test_quantized_checkpoints_on_the_gpu_path_greedy_equal_the_cpu_kernels(
    llama_64, tmp_path, monkeypatch, kind
) -> None:
    """The CPU path (C kernels) is held to transformers' loading of these checkpoints by the format tests."""
    if kind == "gptq-act-order":
        path = writers.write_gptq(llama_64, tmp_path / "q", desc_act=True, sym=False, seed=3)
    elif kind == "ct-int4-bf16":
        pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
        from quant_helpers import write_compressed_tensors

        path = write_compressed_tensors(llama_64, tmp_path / "q", bits=4, group_size=32, dtype=torch.bfloat16)
    else:  # blocks that divide neither the rows nor the inputs
        path = writers.write_block_fp8(llama_64, tmp_path / "q", block=(48, 40))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    want = batchgen_greedy(LLM(path, num_blocks=64, block_size=8, max_num_seqs=4), PROMPTS[:2], new=8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # every projection through the Triton kernels, interpreted
    assert batchgen_greedy(LLM(path, num_blocks=64, block_size=8, max_num_seqs=4), PROMPTS[:2], new=8) == want
    assert len({t for row in want for t in row}) > 4  # not one repeated token


def test_a_gguf_file_repacked_for_the_gpu_path_greedy_equals_transformers(
    llama_64, tmp_path, monkeypatch
) -> None:
    """The 32-value formats on a whole model (the 256-value K-quants need wider rows: their repacking is held
    above, format by format and through a layer)."""
    pytest.importorskip("gguf", reason="the gguf extra is not installed")
    from batchgen.models.quant.gguf_writer import write_gguf

    formats = {"attn_q": 2, "attn_k": 3, "attn_v": 6, "attn_output": 7, "ffn_gate": 8, "ffn_up": 2,
               "ffn_down": 6}  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0  # fmt: skip
    path = write_gguf(llama_64, tmp_path / "m.gguf", formats, seed=1)
    want = transformers_greedy(transformers_model(tmp_path, gguf_file="m.gguf"), PROMPTS[:2], new=8)
    llm = LLM(path, num_blocks=64, block_size=8, max_num_seqs=4)
    model = llm.engine.model
    for name, module in list(model.named_modules()):  # what a GPU load builds: every projection repacked
        if isinstance(module, QuantLinear):
            parts = list(zip(module.weights, module.type_ids))
            layer = GroupQuantLinear(module.in_features, _parts_of([(p.data, t) for p, t in parts], module.in_features),
                                     module.bias)  # fmt: skip
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, layer)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert batchgen_greedy(llm, PROMPTS[:2], new=8) == want and len({t for row in want for t in row}) > 4


def test_the_gemm_benchmark_times_each_kernel_and_checks_its_product(tmp_path, capsys) -> None:
    import json

    from batchgen.bench import quant_gemm

    assert quant_gemm.main(["--device", "cpu", "--json", str(tmp_path / "r.json")]) == 0
    points = json.loads((tmp_path / "r.json").read_text())["points"]
    assert len(points) == len(quant_gemm.CPU_ROWS)
    for p in points:
        assert set(p["times_us"]) == set(p["kernel_us"]) == {"dense", "int4-g128", "int8-g128", "fp8-ch"}
        assert all(t > 0 for t in [*p["times_us"].values(), *p["kernel_us"].values()])
        assert p["weight_bytes"]["int4-g128"] < p["weight_bytes"]["int8-g128"] < p["weight_bytes"]["dense"]
        assert all(d < 4e-3 for d in p["max_rel_diff"].values())  # bfloat16 outputs
    assert "weight-only GEMMs" in capsys.readouterr().out
    tiles = (
        [quant_gemm.Tiles(16, 16, 128, 2), quant_gemm.Tiles(16, 32, 128)],
        [quant_gemm.Tiles(32, 16, 64)],
    )
    found = quant_gemm.sweep(torch.device("cpu"), {"small": (48, 256)}, (1, 20), tiles, log=lambda line: None)
    assert [(f["kind"], f["m"]) for f in found] == [(k, m) for m in (1, 20) for k in ("int4-g128", "fp8-ch")]
    assert [len(f["times_us"]) for f in found] == [3, 3, 2, 2]
    assert [f["picked"] is None for f in found] == [False, False, True, True]  # dequantize above 16 rows
    assert all(min(f["times_us"].values()) > 0 for f in found)
