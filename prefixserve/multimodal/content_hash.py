"""An image's 128-bit content hash: what its KV blocks and its encoder output are keyed by.

It covers the decoded pixels, their size and every processor setting that changes the patches or the
number of tokens, so the same picture in another encoding with the same pixels hits, and the same
picture at another size, or under other settings, does not.
"""
from __future__ import annotations

import hashlib

from PIL import Image

from prefixserve.model.vision_config import VisionConfig

_DOMAIN = b"prefixserve/image/v1\x00"


def image_content_hash(image: Image.Image, vision: VisionConfig, min_pixels: int, max_pixels: int) -> bytes:
    """16 bytes of BLAKE2b over an RGB image's pixels, size and the settings it is processed under."""
    if image.mode != "RGB":
        raise ValueError(f"hash the decoded RGB image, got mode {image.mode}")
    digest = hashlib.blake2b(_DOMAIN, digest_size=16)
    settings = repr((image.size, vision.processor_settings(), min_pixels, max_pixels)).encode()
    digest.update(len(settings).to_bytes(4, "little") + settings)
    digest.update(image.tobytes())
    return digest.digest()
