"""Qwen2.5-VL: a Qwen2 language model whose rotary is M-RoPE, behind the vision tower (model/vision.py).

Image placeholder tokens take the vision tower's outputs as their embeddings (the caller scatters them
into `inputs_embeds`), and each token has three rotary positions (temporal, height, width): equal for
text, the grid cell for an image token (multimodal/positions.py computes them).
"""
from __future__ import annotations

import torch
from torch import nn

from prefixserve.model.attention.backend import AttentionBackend
from prefixserve.model.attention.registry import AUTO
from prefixserve.model.config import ModelConfig
from prefixserve.model.decoder import CausalLM
from prefixserve.model.layers import rope_inverse_frequencies
from prefixserve.model.vision import VisionTower


class MRotaryEmbedding(nn.Module):
    """Rotary whose frequencies are split in three sections, each turned by one axis of the position."""

    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int],
                 *, device: torch.device | str) -> None:
        super().__init__()
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {head_dim // 2}")
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, theta, None).to(device),
                             persistent=False)
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.register_buffer("axis", axis.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (or [T]: a text-only batch, every axis equal) -> (cos, sin) [T, 1, head_dim // 2]."""
        if positions.dim() == 1:
            angles = positions.float()[:, None] * self.inv_freq[None, :]
        else:
            angles = positions.float()[self.axis].t() * self.inv_freq[None, :]
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


class VisionLanguageModel(CausalLM):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 attention_backend: AttentionBackend | str = AUTO) -> None:
        if config.vision is None:
            raise ValueError("a vision-language model needs a config with a vision part")
        super().__init__(config, dtype=dtype, device=device, attention_backend=attention_backend)
        self.rotary = MRotaryEmbedding(config.head_dim, config.rope_theta, config.vision.mrope_section,
                                       device=device)
        self.visual = VisionTower(config.vision, dtype=dtype, device=device)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """The vision tower's output for the images, in the language model's dtype [tokens, hidden]."""
        return self.visual(pixel_values, grid_thw).to(self.embed_tokens.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.platform.embedding(input_ids, self.embed_tokens)
