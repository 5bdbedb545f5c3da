"""Building blocks shared by every decoder family: RMSNorm, rotary embedding, gated MLP.

Parameters are created uninitialised (torch.empty): their values always come
from a checkpoint or from the seeded random initialiser, so a default init
would only cost time (seconds for a 0.6B model).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.huge_pages import zeros_on_huge_pages
from prefixserve.model.linear import linear
from prefixserve.model.native.fused_pointwise import FusedPointwise, default_kernel


def fused_kernel(*tensors: torch.Tensor | None, multiple: int = 8) -> FusedPointwise | None:
    """The fused pointwise kernels where they can take these operands (and nothing needs gradients)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    kernel = default_kernel()
    return kernel if kernel is not None and FusedPointwise.supports(*tensors, multiple=multiple) else None


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # values always come from a checkpoint or a seeded generator; huge pages for the big ones
    return nn.Parameter(zeros_on_huge_pages(shape, dtype=dtype, device=device, resident=False), requires_grad=False)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and (kernel := fused_kernel(x, self.weight)) is not None:
            return kernel.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Low precision: normalise in float32 and round once before the weight, the
        # order HF uses, so bf16 outputs follow the reference implementation closely.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the pre-norm block's residual stream and its normed input.
        The sum may be written into `residual` in place: callers hand over the tensor and use the one returned."""
        if (x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
                and (kernel := fused_kernel(x, residual, self.weight)) is not None):
            return kernel.rms_norm(x, self.weight, self.eps, residual=residual), residual
        residual = residual + x
        return self(residual), residual


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair rotation speeds [head_dim // 2] in float32, with the checkpoint's scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3 scaling: slow rotations (long wavelengths) are stretched by `factor`,
    fast ones are kept, and the band between is blended linearly in 1/wavelength."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = original_len / low    # beyond this: fully stretched
    short_wavelength = original_len / high  # below this: unchanged
    stretched = torch.where(wavelength > long_wavelength, inv_freq / factor, inv_freq)
    blend = (original_len / wavelength - low) / (high - low)
    blended = (1 - blend) * stretched / factor + blend * stretched
    in_band = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(in_band, blended, stretched)


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (the HF "rotate_half" layout) by position * inv_freq."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None,
                 *, device: torch.device | str) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim // 2] in `dtype`, broadcastable over heads."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] -> rotated copy, contiguous."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # rows [0, I) are gate_proj, rows [I, 2I) are up_proj
        self.gate_up_proj = empty_parameter(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.down_proj = empty_parameter(hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        if gate_up.dim() == 2 and gate_up.is_contiguous() and (kernel := fused_kernel(gate_up, multiple=16)):
            return linear(kernel.silu_and_mul(gate_up), self.down_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)
