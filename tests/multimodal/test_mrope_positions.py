"""M-RoPE positions of prompts with images against HF transformers' get_rope_index (the same rules
written independently): text before, between and after images of several grid shapes, an image at
the very start and at the very end, and the delta generated tokens add."""
from __future__ import annotations

import random

import pytest
import torch

from checkpoint_factory import VL_IDS, build_tiny_vl_model
from prefixserve.multimodal.inputs import MultimodalPrompt
from prefixserve.multimodal.positions import mrope_positions

IMAGE = VL_IDS["image_token_id"]


@pytest.fixture(scope="module")
def hf_rope_index():
    return build_tiny_vl_model().model.get_rope_index


@pytest.mark.parametrize("seed", range(12))
def test_positions_and_delta_equal_hf(hf_rope_index, seed: int) -> None:
    rng = random.Random(seed)
    tokens: list[int] = []
    images = []
    for i in range(rng.randint(1, 3)):
        # images are never adjacent (a prompt has <|vision_end|><|vision_start|> between them, and HF's
        # grouping by token type would take two adjacent images for one)
        tokens += [rng.randrange(8000) for _ in range(rng.choice([0, 1, 5, 17] if i == 0 else [1, 2, 17]))]
        grid = (1, 2 * rng.randint(1, 6), 2 * rng.randint(1, 6))
        images.append((len(tokens), grid))
        tokens += [IMAGE] * (grid[1] * grid[2] // 4)
    tokens += [rng.randrange(8000) for _ in range(rng.choice([0, 3, 9]))]
    ids = torch.tensor([tokens])
    expected, delta = hf_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(),
                                    image_grid_thw=torch.tensor([g for _, g in images]))
    ours, our_delta = mrope_positions(len(tokens), images, merge=2)
    assert torch.equal(ours, expected[:, 0])
    assert our_delta == int(delta)
    generated = MultimodalPrompt((), ours, our_delta).rope_positions(len(tokens), len(tokens) + 3)
    assert torch.equal(generated, (torch.arange(len(tokens), len(tokens) + 3) + int(delta)).expand(3, -1))
