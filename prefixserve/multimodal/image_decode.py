"""Encoded image bytes (or a PIL image) -> an RGB PIL image, refusing what cannot be served.

The pixel cap is checked on the header, before any pixel is decoded: a small file that declares an
enormous picture (a decompression bomb) is refused without allocating it.
"""
from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from prefixserve.errors import InvalidRequestError

# an image larger than this many decoded pixels is refused unless the caller sets its own cap
DEFAULT_MAX_DECODED_PIXELS = 64 * 1024 * 1024
# media type -> the Pillow format that must be inside
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/gif": "GIF",
               "image/webp": "WEBP", "image/bmp": "BMP"}


def decode_image(data: bytes | Image.Image, *, param: str, media_type: str | None = None,
                 max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> Image.Image:
    """An RGB image, fully decoded. Raises InvalidRequestError naming `param` for bytes that are no
    image, a truncated file, a media type the bytes do not match, or more pixels than allowed."""
    if isinstance(data, Image.Image):
        image = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        if media_type is not None and media_type.lower() not in MEDIA_TYPES:
            raise InvalidRequestError(f"unsupported image media type {media_type!r}; supported: "
                                      f"{', '.join(sorted(MEDIA_TYPES))}", param=param)
        try:
            with warnings.catch_warnings():
                # Pillow's own bomb check warns or raises at sizes of its choosing; ours comes first
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(bytes(data)))
        except UnidentifiedImageError:
            raise InvalidRequestError("cannot decode the image: not an image format Pillow reads",
                                      param=param) from None
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(f"cannot decode the image: {e}", param=param) from None
        if media_type is not None and image.format != MEDIA_TYPES[media_type.lower()]:
            raise InvalidRequestError(f"the image is {image.format}, not the {media_type} it was sent as",
                                      param=param)
    else:
        raise InvalidRequestError(f"an image must be a PIL image or encoded bytes, got {type(data).__name__}",
                                  param=param)
    width, height = image.size
    if width * height > max_decoded_pixels:
        raise InvalidRequestError(f"the image declares {width}x{height} pixels, more than the "
                                  f"{max_decoded_pixels} allowed", param=param)
    if width < 1 or height < 1:
        raise InvalidRequestError("the image has no pixels", param=param)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidRequestError(f"cannot decode the image (truncated or corrupt): {e}", param=param) from None
