"""A decoder layer's elementwise steps in C (kernels/csrc/layer_ops_cpu.c via kernels/cpu_ops.py) against the
torch code they replace: RoPE and the KV store bit for bit, RMSNorm and SiLU·up within float32 rounding; the
plain-C build too; and None (the caller's torch path) whenever the kernel cannot serve a call."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_kernel, cpu_ops
from batchgen.models import llama

needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C compiler (cc/gcc/$CC) found")


@pytest.fixture(autouse=True, params=["avx2", "generic"])
def _library(request, monkeypatch):
    """Every test runs against the machine's build and the plain-C build (BATCHGEN_GENERIC)."""
    monkeypatch.delenv(cpu_kernel.ENV_SWITCH, raising=False)
    cpu_kernel.reset()
    if request.param == "generic" and cpu_kernel.compiler() is not None:
        monkeypatch.setitem(cpu_kernel._state, "lib", cpu_kernel._load(("BATCHGEN_GENERIC",)))
    yield
    cpu_kernel.reset()


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    h = x * x.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
    return h * (1.0 + weight) if gemma else weight * h


@needs_compiler
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm(gemma) -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 300, generator=g) * 3, torch.randn(300, generator=g)
    got = cpu_ops.rms_norm(x, w, 1e-6, gemma)
    torch.testing.assert_close(got, _torch_rms_norm(x, w, 1e-6, gemma), rtol=2e-6, atol=1e-6)
    # per-head weights over a [T, H, D] view whose rows are strided (q and k heads of a fused qkv output)
    qkv = torch.randn(9, 7 * 64 + 2 * 64, generator=g)
    qk = qkv[:, : 7 * 64].view(9, 7, 64)
    wh = torch.randn(7, 64, generator=g)
    got = cpu_ops.rms_norm(qk, wh, 1e-5, gemma)
    torch.testing.assert_close(got, _torch_rms_norm(qk, wh, 1e-5, gemma), rtol=2e-6, atol=1e-6)
    # with a residual added first, in place
    res, h = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g)
    want_x = res + h
    got = cpu_ops.rms_norm(res, w[:96], 1e-6, gemma, add=h)
    assert torch.equal(res, want_x)
    torch.testing.assert_close(got, _torch_rms_norm(want_x, w[:96], 1e-6, gemma), rtol=2e-6, atol=1e-6)


@needs_compiler
def test_silu_mul() -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(11, 2 * 333, generator=g) * 8
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -1e-30])
    want = torch.nn.functional.silu(gate_up[:, :333]) * gate_up[:, 333:]
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), want, rtol=1e-6, atol=1e-6)
    wide = torch.randn(4, 2 * 16 + 8, generator=g)[:, :32]  # rows strided
    torch.testing.assert_close(
        cpu_ops.silu_mul(wide), torch.nn.functional.silu(wide[:, :16]) * wide[:, 16:], rtol=1e-6, atol=1e-6
    )


@needs_compiler
@pytest.mark.parametrize("rot", [64, 32])
def test_rope_bit_for_bit(rot) -> None:
    """Full and partial rotary dims, over the strided q/k heads of a fused qkv output: torch's bits."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(13, 6 * 64 + 64, generator=g)
    x = qkv[:, : 6 * 64].view(13, 6, 64)
    angles = torch.randn(13, rot // 2, generator=g) * 10
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = llama.rope_tables(emb.cos(), emb.sin())
    got = cpu_ops.rope(x, cos, sin)
    half = rot // 2
    xr = x[..., :rot]
    want = xr * cos + torch.cat((xr[..., half:], xr[..., :half]), dim=-1) * sin
    want = torch.cat((want, x[..., rot:]), dim=-1)
    assert torch.equal(got, want)


@needs_compiler
def test_store_kv() -> None:
    """Rows land in their slots, -1 skips, strided sources; a slot past the cache writes nothing (False)."""
    g = torch.Generator().manual_seed(4)
    kc, vc = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    kv = torch.randn(5, 3, 2, 8, generator=g)  # [T, k/v/extra, Hkv, D]: strided k and v
    slots = torch.tensor([0, 5, -1, 23, 9])
    assert cpu_ops.store_kv(kv[:, 0], kv[:, 1], kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 2, 8), vc.view(-1, 2, 8)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], kv[t, 0]) and torch.equal(flat_v[s], kv[t, 1])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 4
    before = kc.clone()
    assert not cpu_ops.store_kv(kv[:, 0], kv[:, 1], kc, vc, torch.tensor([0, 1, 2, 3, 24]))
    assert torch.equal(kc, before)


def test_declines_what_it_cannot_serve(monkeypatch) -> None:
    """Other dtypes, other layouts and BATCHGEN_CPU_KERNEL=0 return None/False: the torch code runs."""
    x = torch.randn(4, 16)
    assert cpu_ops.rms_norm(x.double(), torch.ones(16, dtype=torch.float64), 1e-6, False) is None
    assert cpu_ops.rms_norm(x.t(), torch.ones(4), 1e-6, False) is None
    assert cpu_ops.silu_mul(torch.randn(3, 5)) is None  # odd width
    assert (
        cpu_ops.rope(torch.randn(2, 3, 8).transpose(0, 1), torch.ones(3, 1, 8), torch.ones(3, 1, 8)) is None
    )
    kc = torch.zeros(2, 4, 1, 16)
    assert not cpu_ops.store_kv(
        torch.randn(1, 1, 16), torch.randn(1, 1, 16), kc, kc, torch.tensor([0], dtype=torch.int32)
    )
    monkeypatch.setenv(cpu_kernel.ENV_SWITCH, "0")
    assert cpu_ops.rms_norm(x, torch.ones(16), 1e-6, False) is None
    assert not cpu_ops.store_kv(torch.randn(1, 1, 16), torch.randn(1, 1, 16), kc, kc, torch.tensor([0]))
