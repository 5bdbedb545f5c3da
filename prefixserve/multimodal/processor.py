"""The Qwen2-VL image processor's rules: resize to multiples of patch * merge within [min, max] pixels
(aspect kept), bicubic on 8-bit pixels, scale to [0, 1], normalise, and lay out the patches flat: one row
per patch (channels, frames, rows, columns), the patches of each 2x2 merge group contiguous. A still
image fills both frames of a temporal patch with itself."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from prefixserve.errors import InvalidRequestError
from prefixserve.model.vision_config import VisionConfig

MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor         # [patches, patch_dim] float32
    grid_thw: tuple[int, int, int]     # (frames, patch rows, patch columns)
    num_tokens: int                    # placeholder tokens in the prompt: patches / merge^2

    def __reduce__(self):
        # By value, as a numpy array: the patches cross from the render process and to a replica
        # through Ray, and a pickled torch tensor would go by torch's shared-memory handoff instead
        # (a file in /dev/shm, whose room a container may not have, handed over by a live sender).
        return _rebuilt, (self.pixel_values.numpy(), self.grid_thw, self.num_tokens)


def _rebuilt(pixels: np.ndarray, grid_thw: tuple[int, int, int], num_tokens: int) -> ProcessedImage:
    # Ray hands a numpy array over read-only (zero-copy), and torch wants to own writable memory
    return ProcessedImage(torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy()), grid_thw, num_tokens)


def resized_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): each a multiple of factor, area within [min_pixels, max_pixels] where the
    rounding allows, aspect as close as it allows."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def process_image(image: Image.Image, vision: VisionConfig, *, param: str = "image",
                  min_pixels: int | None = None, max_pixels: int | None = None) -> ProcessedImage:
    """An RGB image -> its patches. min/max_pixels narrow the model's own bounds for one request."""
    lo = vision.min_pixels if min_pixels is None else max(vision.min_pixels, min_pixels)
    hi = vision.max_pixels if max_pixels is None else min(vision.max_pixels, max_pixels)
    try:
        height, width = resized_size(image.height, image.width, vision.factor, lo, max(lo, hi))
    except ValueError as e:
        raise InvalidRequestError(f"cannot resize the image: {e}", param=param) from None
    if (width, height) != image.size:
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    mean = torch.tensor(vision.image_mean).view(3, 1, 1)
    std = torch.tensor(vision.image_std).view(3, 1, 1)
    pixels = (pixels - mean) / std
    p, m, t = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    gh, gw = height // p, width // p
    patches = pixels.view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    patches = patches.unsqueeze(5).expand(gh // m, gw // m, m, m, 3, t, p, p)
    return ProcessedImage(patches.reshape(gh * gw, 3 * t * p * p).contiguous(), (1, gh, gw), gh * gw // (m * m))
