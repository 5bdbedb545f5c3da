"""HF transformers' Qwen2.5-VL as the oracle for the vision-language tests: its image processor for the
patches, its model's greedy generation and logits for a prompt of token ids and images."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from checkpoint_factory import VL_IDS, VL_MAX_PIXELS

IMAGE_TOKEN = VL_IDS["image_token_id"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_processor(min_pixels: int = 56 * 56, max_pixels: int = VL_MAX_PIXELS) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def _inputs(token_ids: Sequence[int], images: Sequence[Image.Image]) -> dict:
    ids = torch.tensor([list(token_ids)])
    extra = {}
    if images:
        processed = hf_processor()(images=list(images), return_tensors="pt")
        extra = dict(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                **extra)


@torch.no_grad()
def hf_greedy(model, token_ids: Sequence[int], images: Sequence[Image.Image], max_tokens: int) -> list[int]:
    """HF's greedy continuation of an expanded prompt (our prompt_token_ids) with its images."""
    out = model.generate(**_inputs(token_ids, images), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


@torch.no_grad()
def hf_logprobs(model, token_ids: Sequence[int], images: Sequence[Image.Image]) -> torch.Tensor:
    """log-softmax of HF's logits at every position [len, vocab], one forward over the whole sequence."""
    return model(**_inputs(token_ids, images)).logits[0].float().log_softmax(-1)
