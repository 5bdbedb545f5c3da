"""A tokenized prompt with one image placeholder per image -> the model's prompt: each placeholder
expanded to its image's number of tokens, and the images, hashes and positions that go with it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prefixserve.errors import InvalidRequestError
from prefixserve.model.vision_config import VisionConfig
from prefixserve.multimodal.content_hash import image_content_hash
from prefixserve.multimodal.image_decode import DEFAULT_MAX_DECODED_PIXELS, decode_image
from prefixserve.multimodal.inputs import ImageItem, MultimodalPrompt
from prefixserve.multimodal.positions import mrope_positions
from prefixserve.multimodal.processor import ProcessedImage, process_image

# what a prompt's text holds where an image goes (the Qwen2-VL chat template's form)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class PreparedImages:
    """A prompt's images already decoded, processed and hashed (prepare_images), so whoever adds the
    request does none of that work: the server's render process prepares them, the replicas' front
    hands its own to the replica, and AsyncLLM prepares others off the engine thread."""
    items: tuple[tuple[bytes, ProcessedImage], ...]


def prepare_images(images: Sequence[object], vision: VisionConfig, *, param: str,
                   max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> list[tuple[bytes, ProcessedImage]]:
    """Decodes and processes each image (PIL image or encoded bytes, or a dict of one as "image" with its
    own "min_pixels" / "max_pixels", which replace the call's for it): (content hash, patches) each."""
    return [prepare_image(data, vision, param=f"{param}[{i}]", max_decoded_pixels=max_decoded_pixels,
                          min_pixels=min_pixels, max_pixels=max_pixels) for i, data in enumerate(images)]


def prepare_image(data: object, vision: VisionConfig, *, param: str,
                  max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS, min_pixels: int | None = None,
                  max_pixels: int | None = None) -> tuple[bytes, ProcessedImage]:
    """One image of prepare_images: (content hash, patches); an error names `param`."""
    lo_asked, hi_asked = min_pixels, max_pixels
    if isinstance(data, dict):
        unknown = set(data) - {"image", "min_pixels", "max_pixels"}
        if unknown or "image" not in data:
            raise InvalidRequestError(f"an image given as a dict has 'image' and optionally 'min_pixels', "
                                      f"'max_pixels'; got {sorted(data)}", param=param)
        lo_asked, hi_asked = data.get("min_pixels", min_pixels), data.get("max_pixels", max_pixels)
        for name, value in (("min_pixels", lo_asked), ("max_pixels", hi_asked)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}",
                                          param=f"{param}.{name}")
        data = data["image"]
    image = decode_image(data, param=param, max_decoded_pixels=max_decoded_pixels)
    processed = process_image(image, vision, param=param, min_pixels=lo_asked, max_pixels=hi_asked)
    # the bounds the picture was resized within are in its hash: other bounds, another picture
    lo = vision.min_pixels if lo_asked is None else max(vision.min_pixels, lo_asked)
    hi = vision.max_pixels if hi_asked is None else min(vision.max_pixels, hi_asked)
    return image_content_hash(image, vision, lo, hi), processed


def expand_prompt(token_ids: Sequence[int], images: Sequence[tuple[bytes, ProcessedImage]],
                  vision: VisionConfig, *, param: str) -> tuple[list[int], MultimodalPrompt]:
    """(token ids with each image token repeated to its image's length, the prompt's images). A run of
    image tokens as long as its image's is taken as expanded already (a prompt of token ids)."""
    pad = vision.image_token_id
    runs: list[tuple[int, int]] = []   # (first index, length) of each run of image tokens
    for i, t in enumerate(token_ids):
        if t != pad:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if len(runs) != len(images):
        raise InvalidRequestError(
            f"the prompt has {len(runs)} image placeholders ({IMAGE_PLACEHOLDER}) for {len(images)} images",
            param=param)
    out: list[int] = []
    items = []
    previous = 0
    for n, ((where, length), (digest, processed)) in enumerate(zip(runs, images)):
        if length not in (1, processed.num_tokens):
            raise InvalidRequestError(f"image {n} takes {processed.num_tokens} tokens; its placeholder has "
                                      f"{length} (give one, or exactly that many)", param=param)
        out.extend(token_ids[previous:where])
        items.append(ImageItem(digest, processed.pixel_values, processed.grid_thw, len(out), processed.num_tokens))
        out.extend([pad] * processed.num_tokens)
        previous = where + length
    out.extend(token_ids[previous:])
    positions, delta = mrope_positions(len(out), [(item.start, item.grid_thw) for item in items],
                                       vision.spatial_merge_size)
    return out, MultimodalPrompt(tuple(items), positions, delta)
