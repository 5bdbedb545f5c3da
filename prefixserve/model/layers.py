"""Building blocks shared by every decoder family: RMSNorm, rotary embedding, gated MLP.

Their arithmetic is their platform's ops (model/platform.py), taken once at construction: the
platform of their device unless one is handed in.

Parameters are created uninitialised (torch.empty): their values always come
from a checkpoint or from the seeded random initialiser, so a default init
would only cost time (seconds for a 0.6B model).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from prefixserve.model.huge_pages import zeros_on_huge_pages
from prefixserve.model.platform import Platform, platform_for


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # values always come from a checkpoint or a seeded generator; huge pages for the big ones
    return nn.Parameter(zeros_on_huge_pages(shape, dtype=dtype, device=device, resident=False), requires_grad=False)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str,
                 platform: Platform | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim, dtype=dtype, device=device)
        platform = platform or platform_for(device)
        self._norm, self._add_norm = platform.rms_norm, platform.add_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the pre-norm block's residual stream and its normed input.
        The sum may be written into `residual` in place: callers hand over the tensor and use the one returned."""
        return self._add_norm(x, residual, self.weight, self.eps)


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


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 *, dtype: torch.dtype, device: torch.device | str, platform: Platform | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # rows [0, I) are gate_proj, rows [I, 2I) are up_proj
        self.gate_up_proj = empty_parameter(2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.down_proj = empty_parameter(hidden_size, intermediate_size, dtype=dtype, device=device)
        platform = platform or platform_for(device)
        self._linear, self._silu_and_mul = platform.linear, platform.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self._silu_and_mul(self._linear(x, self.gate_up_proj)), self.down_proj)
