"""What a prompt's images are once processed: each image's patches, hash and place among the tokens,
and the M-RoPE positions of every prompt token. Built by the engine's intake, carried unread by the
scheduler, read by the worker."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageItem:
    content_hash: bytes                # 16 bytes (multimodal/content_hash.py)
    pixel_values: torch.Tensor         # [patches, patch_dim] float32
    grid_thw: tuple[int, int, int]
    start: int                         # index of its first placeholder token in the prompt
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    images: tuple[ImageItem, ...]
    positions: torch.Tensor            # [3, prompt tokens] int64: (temporal, height, width) rotary positions
    # a token at index i past the prompt (generated) has every position equal to i + delta
    delta: int

    @property
    def image_spans(self) -> tuple[tuple[bytes, int, int], ...]:
        return tuple((image.content_hash, image.start, image.num_tokens) for image in self.images)

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens start..end-1 (prompt or generated)."""
        prompt_len = self.positions.shape[1]
        inside = self.positions[:, start:min(end, prompt_len)]
        if end <= prompt_len:
            return inside
        after = torch.arange(max(start, prompt_len), end, dtype=torch.int64) + self.delta
        return torch.cat([inside, after.expand(3, -1)], dim=1)
