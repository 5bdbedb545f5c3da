"""The fused pointwise Triton kernels (float32; under Triton's interpreter without a GPU) against the plain
torch ops of model/platform.py's Platform, which every layer falls back to: RMSNorm alone and with the
residual add (the sum left in the residual), q/k per-head norm with rotary (with and without the norm
weights, from the layer's own rotary table), and SiLU-and-multiply, on ragged widths that are not powers
of two."""
from __future__ import annotations

import pytest
import torch

from kernel_device import KERNEL_DEVICE
from prefixserve.model.platform import Platform
from prefixserve.platforms.cuda import triton_runtime

triton_runtime.prepare(KERNEL_DEVICE)
from prefixserve.platforms.cuda import pointwise  # noqa: E402  (after Triton's mode is settled)

TORCH = Platform()
TOLERANCE = 1e-5


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=KERNEL_DEVICE)


@pytest.mark.parametrize("rows,width", [(5, 64), (3, 200)])
def test_rms_norm_and_residual_add(rows, width):
    torch.manual_seed(width)
    x, residual, weight = randn(rows, width), randn(rows, width), 1 + 0.1 * randn(width)
    assert torch.allclose(pointwise.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6), atol=TOLERANCE)
    expected, expected_sum = TORCH.add_rms_norm(x, residual.clone(), weight, 1e-6)
    got = pointwise.rms_norm(x, weight, 1e-6, residual=residual)
    assert torch.allclose(got, expected, atol=TOLERANCE)
    assert torch.allclose(residual, expected_sum, atol=TOLERANCE)


@pytest.mark.parametrize("head_dim,normed", [(16, True), (24, False), (64, True)])
def test_qk_norm_rope(head_dim, normed):
    torch.manual_seed(head_dim)
    heads, kv_heads, tokens = 4, 2, 6
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q_weight = 1 + 0.1 * randn(head_dim) if normed else None
    k_weight = 1 + 0.1 * randn(head_dim) if normed else None
    angles = torch.arange(tokens, device=KERNEL_DEVICE)[:, None] * 0.37 ** torch.arange(head_dim // 2,
                                                                                        device=KERNEL_DEVICE)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    got = pointwise.qk_norm_rope(qkv, heads, kv_heads, head_dim, q_weight, k_weight, 1e-6, cos, sin)
    expected = TORCH.qk_norm_rope(qkv, heads, kv_heads, head_dim, q_weight, k_weight, 1e-6, cos, sin)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.allclose(a, b, atol=TOLERANCE)


@pytest.mark.parametrize("rows,width", [(4, 48), (2, 1500)])
def test_silu_and_mul(rows, width):
    torch.manual_seed(width)
    gate_up = randn(rows, 2 * width)
    assert torch.allclose(pointwise.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up), atol=TOLERANCE)
