"""The native kernels in bfloat16 (fused pointwise, few-row GEMM), against float64 references and HF's
rounding order.

RMSNorm must give the bits of HF's bfloat16 RMSNorm (normalise in float32, round, multiply by the
weight, round); rotation and gating, computed in float32 and rounded once, must be within one
bfloat16 rounding of the exact value. A row's result must not depend on the other rows of the
call (the property prefix caching's exact equality rests on).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from native_kernel_build import build_fresh
from prefixserve.platforms.cpu import platform as layers
from prefixserve.model.layers import GatedMLP, RMSNorm
from prefixserve.platforms.cpu.linear import linear
from prefixserve.platforms.cpu.native.fused_pointwise import FusedPointwise, load
from prefixserve.platforms.cpu.native.small_m_gemm import MAX_ROWS, SmallMGemm
from prefixserve.platforms.cpu.native.small_m_gemm import load as load_gemm

BF16_HALF_ULP = 2.0 ** -8  # relative: half the spacing of bfloat16's 8-bit significand


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> FusedPointwise:
    return build_fresh(load, tmp_path_factory)


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward for a bfloat16 input."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def within_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> bool:
    # one rounding to nearest moves a value by at most half an ulp of the result (plus float32 noise)
    return bool(((got.double() - exact).abs() <= BF16_HALF_ULP * exact.abs() * 1.01 + 1e-30).all())


@pytest.mark.parametrize("rows", [1, 3, 37])
def test_add_rms_norm_gives_hfs_bits(kernel, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=gen).bfloat16()
    residual = torch.randn(rows, 1024, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(1024, generator=gen)).bfloat16()
    updated = residual.clone()
    out = kernel.rms_norm(x, w, 1e-6, residual=updated)
    assert torch.equal(updated, residual + x)
    assert torch.equal(out, hf_rms_norm(residual + x, w, 1e-6))
    assert torch.equal(kernel.rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))


def test_silu_and_mul_within_one_rounding(kernel) -> None:
    gate_up = (torch.randn(19, 2 * 3072, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert within_one_rounding(kernel.silu_and_mul(gate_up), F.silu(gate) * up)


def test_qk_norm_rope_within_one_rounding_of_the_normed_heads_rotated(kernel) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, q_heads, k_heads, d = 21, 16, 8, 128
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * d, generator=gen).bfloat16()
    q_w, k_w = ((1 + 0.1 * torch.randn(d, generator=gen)).bfloat16() for _ in range(2))
    angles = torch.arange(tokens).double()[:, None] * (1e6 ** -(torch.arange(0, d, 2).double() / d))[None]
    cos, sin = angles.cos().bfloat16()[:, None, :], angles.sin().bfloat16()[:, None, :]
    q, k = kernel.qk_norm_rope(qkv, q_heads, k_heads, d, q_w, k_w, 1e-6, cos, sin)

    def exact(heads: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        normed = hf_rms_norm(heads, w, 1e-6).double()  # HF rounds the norm before rotating
        x1, x2 = normed.chunk(2, -1)
        c, s = cos.double(), sin.double()
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    q_exact = exact(qkv[:, :q_heads * d].view(tokens, q_heads, d), q_w)
    k_exact = exact(qkv[:, q_heads * d:(q_heads + k_heads) * d].view(tokens, k_heads, d), k_w)
    # a sum of two products can cancel, so the bound is on the terms' size, not the result's
    scale = torch.cat([q_exact.abs().amax(-1, keepdim=True)] * d, -1)
    assert ((q.double() - q_exact).abs() <= BF16_HALF_ULP * scale).all()
    scale = torch.cat([k_exact.abs().amax(-1, keepdim=True)] * d, -1)
    assert ((k.double() - k_exact).abs() <= BF16_HALF_ULP * scale).all()


def test_a_rows_result_does_not_depend_on_the_batch(kernel) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1024, generator=gen).bfloat16()
    w = torch.randn(1024, generator=gen).bfloat16()
    gate_up = torch.randn(64, 512, generator=gen).bfloat16()
    whole_norm, whole_silu = kernel.rms_norm(x, w, 1e-6), kernel.silu_and_mul(gate_up)
    for rows in (slice(0, 1), slice(5, 9), slice(40, 64)):
        assert torch.equal(kernel.rms_norm(x[rows].contiguous(), w, 1e-6), whole_norm[rows])
        assert torch.equal(kernel.silu_and_mul(gate_up[rows].contiguous()), whole_silu[rows])


def test_bf16_layers_dispatch_to_the_kernels(kernel, monkeypatch) -> None:
    monkeypatch.setattr(layers, "default_kernel", lambda: kernel)
    norm = RMSNorm(64, 1e-6, dtype=torch.bfloat16, device="cpu")
    norm.weight.data.normal_()
    mlp = GatedMLP(64, 32, dtype=torch.bfloat16, device="cpu")
    mlp.gate_up_proj.data.normal_()
    mlp.down_proj.data.normal_()
    x, residual = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    assert layers.fused_kernel(x, norm.weight) is kernel
    assert layers.fused_kernel(x.float(), norm.weight) is None  # mixed dtypes take the torch path
    want_sum = residual + x
    normed, new_residual = norm.add_norm(x, residual)  # may add into residual in place
    assert torch.equal(new_residual, want_sum)
    assert torch.equal(normed, hf_rms_norm(want_sum, norm.weight, 1e-6))
    gate, up = F.linear(normed, mlp.gate_up_proj).double().chunk(2, -1)
    torch.testing.assert_close(mlp(normed).double(), F.linear((F.silu(gate) * up).bfloat16(), mlp.down_proj).double(),
                               rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def gemm(tmp_path_factory) -> SmallMGemm:
    return build_fresh(load_gemm, tmp_path_factory)


@pytest.mark.parametrize("m, n, k, with_bias", [(1, 13, 64, False), (2, 6, 8, True), (7, 1030, 1024, False),
                                                 (MAX_ROWS, 96, 3072, True)])
def test_small_m_gemm_reads_bf16_weights_exactly(gemm: SmallMGemm, m: int, n: int, k: int, with_bias: bool) -> None:
    """The product of the bfloat16 operands' exact values, accumulated in float32, rounded once to bfloat16."""
    gen = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    got = gemm(x, w, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 accumulation error (~k * 2^-24 of the terms' size) plus one bfloat16 rounding of the result
    terms = x.double().abs() @ w.double().abs().T
    assert ((got.double() - exact).abs() <= BF16_HALF_ULP * exact.abs() + k * 2.0 ** -24 * terms + 1e-30).all()
    # a row's bits do not depend on the rows beside it
    assert torch.equal(gemm(x[-1:].contiguous(), w, b), got[-1:])


def test_bf16_linear_takes_the_kernel_for_few_rows(gemm: SmallMGemm, monkeypatch) -> None:
    """Row-major bfloat16 weights (where the CPU has avx512_bf16 the model's are packed instead), up to
    its row limit."""
    calls = []
    monkeypatch.setattr("prefixserve.platforms.cpu.linear.default_kernel",
                        lambda: (lambda *a: calls.append(a[0].shape[0]) or gemm(*a)))
    w = torch.randn(40, 64).bfloat16()
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(linear(x, w).float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)
    assert calls == [1, MAX_ROWS]
    assert not SmallMGemm.supports(torch.randn(2, 64).bfloat16(), torch.randn(4, 64), None)  # mixed dtypes
