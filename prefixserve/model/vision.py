"""The Qwen2.5-VL vision tower: patches -> a ViT with 2D rotary and window attention -> merged tokens.

Each 14x14 (x2 frames) patch is one row of `pixel_values` (the processor's flat layout, merge groups of
2x2 neighbouring patches contiguous). Most blocks attend within windows of `window_size` pixels, the
`fullatt_block_indexes` ones across the whole image; rows are reordered window by window for that and
put back after the merger, which turns each 2x2 group into one language-model token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.layers import empty_parameter
from prefixserve.model.platform import apply_rotary
from prefixserve.model.vision_config import VisionConfig

_EPS = 1e-6


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # normalised in float32, rounded before the weight: the reference's order
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _EPS)).to(x.dtype)


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch [N, 2], in the processor's order (merge groups contiguous)."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rows, cols = rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grid_thw: list[tuple[int, int, int]], merge: int, window_units: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """(merge groups in window order [G], window boundaries in patches). A window is window_units x
    window_units merge groups; windows at the right and bottom edges are cut short."""
    order, bounds, base = [], [0], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in range(t):
            for top in range(0, gh, window_units):
                for left in range(0, gw, window_units):
                    cells = index[frame, top:top + window_units, left:left + window_units].flatten()
                    order.append(cells + base)
                    bounds.append(bounds[-1] + cells.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), bounds


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        d, i = c.hidden_size, c.intermediate_size
        self.num_heads, self.head_dim = c.num_heads, d // c.num_heads
        self.norm1 = empty_parameter(d, dtype=dtype, device=device)
        self.norm2 = empty_parameter(d, dtype=dtype, device=device)
        self.qkv = empty_parameter(3 * d, d, dtype=dtype, device=device)
        self.qkv_bias = empty_parameter(3 * d, dtype=dtype, device=device)
        self.proj = empty_parameter(d, d, dtype=dtype, device=device)
        self.proj_bias = empty_parameter(d, dtype=dtype, device=device)
        self.gate_proj = empty_parameter(i, d, dtype=dtype, device=device)
        self.gate_bias = empty_parameter(i, dtype=dtype, device=device)
        self.up_proj = empty_parameter(i, d, dtype=dtype, device=device)
        self.up_bias = empty_parameter(i, dtype=dtype, device=device)
        self.down_proj = empty_parameter(d, i, dtype=dtype, device=device)
        self.down_bias = empty_parameter(d, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        n = x.shape[0]
        qkv = F.linear(_rms_norm(x, self.norm1), self.qkv, self.qkv_bias).view(n, 3, self.num_heads, self.head_dim)
        q = apply_rotary(qkv[:, 0].float(), cos, sin).to(x.dtype)
        k = apply_rotary(qkv[:, 1].float(), cos, sin).to(x.dtype)
        v = qkv[:, 2]
        out = torch.empty_like(q)
        for start, end in zip(bounds[:-1], bounds[1:]):
            # each window (or image) attends within itself, in both directions
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            ).transpose(0, 1)
        x = x + F.linear(out.reshape(n, -1), self.proj, self.proj_bias)
        h = _rms_norm(x, self.norm2)
        h = F.silu(F.linear(h, self.gate_proj, self.gate_bias)) * F.linear(h, self.up_proj, self.up_bias)
        return x + F.linear(h, self.down_proj, self.down_bias)


class VisionTower(nn.Module):
    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = c
        # the Conv3d whose kernel equals its stride is a matmul over each flattened patch
        self.patch_embed = empty_parameter(c.hidden_size, c.patch_dim, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(VisionBlock(c, dtype=dtype, device=device) for _ in range(c.depth))
        merged = c.hidden_size * c.spatial_merge_size ** 2
        self.merger_norm = empty_parameter(c.hidden_size, dtype=dtype, device=device)
        self.merger_fc1 = empty_parameter(merged, merged, dtype=dtype, device=device)
        self.merger_fc1_bias = empty_parameter(merged, dtype=dtype, device=device)
        self.merger_fc2 = empty_parameter(c.out_hidden_size, merged, dtype=dtype, device=device)
        self.merger_fc2_bias = empty_parameter(c.out_hidden_size, dtype=dtype, device=device)
        head_dim = c.hidden_size // c.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.int64).float() / (head_dim // 2)
        self.register_buffer("inv_freq", (1.0 / c.rope_theta ** quarter).to(device), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[patches, patch_dim] of one or more images -> [patches / merge^2, out_hidden] language-model
        embeddings, image after image."""
        c = self.config
        unit = c.spatial_merge_size ** 2
        x = F.linear(pixel_values.to(self.patch_embed.dtype), self.patch_embed)
        n = x.shape[0]
        order, window_bounds = window_order(grid_thw, c.spatial_merge_size,
                                            c.window_size // c.spatial_merge_size // c.patch_size)
        order = order.to(x.device)
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        pos = patch_positions(grid_thw, c.spatial_merge_size).to(x.device)
        angles = (pos[:, :, None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]: rows, then columns
        angles = angles.view(n // unit, unit, -1)[order].reshape(n, -1)
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        full_bounds = [0]  # full attention spans one frame of one image
        for t, h, w in grid_thw:
            for _ in range(t):
                full_bounds.append(full_bounds[-1] + h * w)
        full = set(c.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_bounds if i in full else window_bounds)
        merged = _rms_norm(x, self.merger_norm).view(n // unit, -1)
        merged = F.linear(F.gelu(F.linear(merged, self.merger_fc1, self.merger_fc1_bias)),
                          self.merger_fc2, self.merger_fc2_bias)
        return merged[torch.argsort(order)]
