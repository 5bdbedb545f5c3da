"""M-RoPE positions of a prompt (Qwen2-VL's rules): text tokens count up on all three axes; an image's
tokens sit on its grid of merged cells, (start, start + row, start + column), where start is the next text
position; the text after an image resumes at start + the larger side of its grid."""
from __future__ import annotations

import torch


def mrope_positions(num_tokens: int, images: list[tuple[int, tuple[int, int, int]]], merge: int
                    ) -> tuple[torch.Tensor, int]:
    """(positions [3, num_tokens], delta) for images given as (first token index, grid_thw), in order;
    delta: what a token past the prompt adds to its index."""
    pos = torch.empty(3, num_tokens, dtype=torch.int64)
    index = next_pos = 0
    for start, (t, h, w) in images:
        text = start - index
        pos[:, index:start] = torch.arange(text) + next_pos
        next_pos += text
        gh, gw = h // merge, w // merge
        frames = torch.arange(t).view(t, 1, 1).expand(t, gh, gw)
        rows = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        cols = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        grid = torch.stack([frames, rows, cols]).reshape(3, -1) + next_pos
        pos[:, start:start + grid.shape[1]] = grid
        next_pos += max(gh, gw)
        index = start + grid.shape[1]
    pos[:, index:] = torch.arange(num_tokens - index) + next_pos
    top = int(pos.max()) + 1 if num_tokens else 0
    return pos, top - num_tokens
