"""The image half of a step for a vision-language model: the embeddings of the image tokens the step
computes (from the encoder cache or the vision tower) and every token's M-RoPE positions."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from prefixserve.worker.encoder_cache import EncoderCache


def multimodal_inputs(model: Any, sequences: Sequence[Any], input_ids: torch.Tensor, positions: torch.Tensor,
                      cache: EncoderCache) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(input embeddings with the image tokens' rows replaced, or None when the step computes no image
    token; rotary positions [3, T]). A sequence's images are encoded only where the step computes
    some of their tokens: an image the cached prefix covers is never encoded."""
    rope = positions.unsqueeze(0).expand(3, -1).clone()
    embeds = None
    row = 0
    for seq in sequences:
        n = len(seq.token_ids)
        mm = seq.multimodal
        if mm is not None:
            start, end = seq.start_pos, seq.start_pos + n
            rope[:, row:row + n] = mm.rope_positions(start, end).to(rope.device)
            for image in mm.images:
                lo, hi = max(image.start, start), min(image.end, end)
                if lo >= hi:
                    continue
                if embeds is None:
                    embeds = model.embed(input_ids)
                features = cache.get_or_encode(image.content_hash, lambda image=image: model.encode_images(
                    image.pixel_values.to(embeds.device), [image.grid_thw]))
                embeds[row + lo - start:row + hi - start] = features[lo - image.start:hi - image.start]
        row += n
    return embeds, rope
