"""Image parts -> the engine's prepared images, never on the event loop: data: URLs and base64 always;
http(s) URLs only from the allowed domains and file: URLs only under the allowed folder (both off unless
the server is started with them), fetched with a timeout and a size cap on a worker thread of the server
(fetch_images); decoding, resizing, patches and content hashes in the render process (prepare_images).
Each refusal is a 400 naming the part."""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import unquote, urlsplit

from PIL import Image

from prefixserve.errors import InvalidRequestError
from prefixserve.multimodal import VisionConfig
from prefixserve.multimodal.image_decode import DEFAULT_MAX_DECODED_PIXELS, decode_image
from prefixserve.multimodal.prompt import PreparedImages, prepare_image
from prefixserve.prompt.conversation import ImageSource


@dataclass(frozen=True)
class MediaConfig:
    # hosts http(s) image URLs may name (exact host names); empty: no URL is fetched
    allowed_domains: tuple[str, ...] = ()
    # the folder file: URLs may point into; None: no local file is read
    allowed_local_path: Optional[str] = None
    fetch_timeout_s: float = 5.0
    # encoded bytes of one image, however it arrives (a data URL's decoded payload included)
    max_image_bytes: int = 20 * 2**20
    # decoded pixels of one image, checked on its header before decoding
    max_image_pixels: int = DEFAULT_MAX_DECODED_PIXELS
    # images in one request; None: the engine's limit only
    max_images: Optional[int] = None


def _base64(data: str, where: str, cap: int) -> bytes:
    if len(data) * 3 // 4 > cap:
        raise InvalidRequestError(f"the image is over the {cap}-byte cap", param=where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("the image data is not valid base64", param=where) from None


def _data_url(url: str, where: str, cap: int) -> tuple[bytes, Optional[str]]:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError("a data URL image must be data:<media type>;base64,<data>", param=where)
    return _base64(payload, where, cap), header.removesuffix(";base64") or None


def _http(url: str, where: str, config: MediaConfig) -> bytes:
    host = urlsplit(url).hostname or ""
    if host not in config.allowed_domains:
        raise InvalidRequestError(f"image URL host {host!r} is not in the server's allowed media domains "
                                  "(--allowed-media-domains)", param=where)
    try:
        with urllib.request.urlopen(url, timeout=config.fetch_timeout_s) as response:
            data = response.read(config.max_image_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InvalidRequestError(f"cannot fetch the image: {e}", param=where) from None
    if len(data) > config.max_image_bytes:
        raise InvalidRequestError(f"the image is over the {config.max_image_bytes}-byte cap", param=where)
    return data


def _local(url: str, where: str, config: MediaConfig) -> bytes:
    if config.allowed_local_path is None:
        raise InvalidRequestError("local image files are not served (--allowed-local-media-path)", param=where)
    root = Path(config.allowed_local_path).resolve()
    path = Path(unquote(urlsplit(url).path)).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise InvalidRequestError(f"{path} is not a file under the allowed media folder", param=where)
    if path.stat().st_size > config.max_image_bytes:
        raise InvalidRequestError(f"the image is over the {config.max_image_bytes}-byte cap", param=where)
    return path.read_bytes()


@dataclass(frozen=True)
class LoadedImage:
    """What the request log records of a picture (never its bytes): its decoded size and what its
    encoded form was, so that the lint can tell the same picture sent in another encoding from
    another picture."""
    width: int
    height: int
    format: Optional[str]       # Pillow's name for the encoding: PNG, JPEG, ...
    encoded_bytes: int
    encoded_sha256: str         # of the encoded bytes, hex


# The scheme is read from a URL's head: a data URL may be megabytes, and urlsplit scans all of it.
_SCHEME_HEAD = 64


def _scheme(url: str) -> str:
    return urlsplit(url[:_SCHEME_HEAD]).scheme.lower()


def _remote_scheme(source: ImageSource) -> Optional[str]:
    """"http", "https" or "file" for a part the server fetches; None for one whose bytes are in the body
    (a data URL, base64) or whose scheme the render process refuses."""
    if source.data is not None:
        return None
    scheme = _scheme(source.url or "")
    return scheme if scheme in ("http", "https", "file") else None


def fetch_remote(source: ImageSource, config: MediaConfig) -> Optional[bytes]:
    """An http(s) or file: image part's bytes, fetched within the server's rules (blocking); None for a
    part whose bytes are in the body (a data URL, base64), which the render process reads."""
    scheme = _remote_scheme(source)
    if scheme is None:
        return None
    url = source.url or ""
    return _local(url, source.where, config) if scheme == "file" else _http(url, source.where, config)


def _encoded(source: ImageSource, config: MediaConfig, fetched: Optional[bytes]) -> tuple[bytes, Optional[str]]:
    """(the encoded image, the media type it was sent as)."""
    where, media_type = source.where, source.media_type
    if fetched is not None:
        return fetched, media_type
    if source.data is not None:
        return _base64(source.data, where, config.max_image_bytes), media_type
    url = source.url or ""
    scheme = _scheme(url)
    if scheme == "data":
        return _data_url(url, where, config.max_image_bytes)
    raise InvalidRequestError(f"image URL scheme {scheme!r} is not supported (data:, http(s):, file:)", param=where)


def load_image(source: ImageSource, config: MediaConfig,
               fetched: Optional[bytes] = None) -> tuple[Image.Image, LoadedImage]:
    """One image part decoded to RGB from the body or its fetched bytes (blocking), and its record."""
    data, media_type = _encoded(source, config, fetched)
    image = decode_image(data, param=source.where, media_type=media_type, max_decoded_pixels=config.max_image_pixels)
    with Image.open(io.BytesIO(data)) as header:   # decode_image's result is converted: no format left
        encoding = header.format
    return image, LoadedImage(image.width, image.height, encoding, len(data), hashlib.sha256(data).hexdigest())


# OpenAI's detail "low": at most 256 image tokens of 28x28 pixels (Qwen2-VL's own suggestion of a small
# budget); "high" and "auto" leave the model's bounds
LOW_DETAIL_PIXELS = 256 * 28 * 28


def pixel_bounds(source: ImageSource, model_min: int, model_max: int) -> Optional[dict[str, int]]:
    """The resizing bounds an image part asks for, as multi_modal_data takes them per image (None: the
    model's own). A request may narrow the model's bounds [model_min, model_max], never widen them."""
    if source.min_pixels is None and source.max_pixels is None and source.detail != "low":
        return None
    for name, value in (("min_pixels", source.min_pixels), ("max_pixels", source.max_pixels)):
        if value is not None and not model_min <= value <= model_max:
            raise InvalidRequestError(f"{name} {value} is outside the server's bounds [{model_min}, {model_max}]",
                                      param=f"{source.options_at}.{name}")
    lo = source.min_pixels if source.min_pixels is not None else model_min
    hi = source.max_pixels if source.max_pixels is not None else (
        max(model_min, min(LOW_DETAIL_PIXELS, model_max)) if source.detail == "low" else model_max)
    if lo > hi:
        raise InvalidRequestError(f"min_pixels {lo} is above max_pixels {hi}", param=f"{source.options_at}.min_pixels")
    return {"min_pixels": lo, "max_pixels": hi}


async def fetch_images(sources: Sequence[ImageSource], config: MediaConfig, param: str) -> list[Optional[bytes]]:
    """The fetched bytes of every http(s) or file: image part (None for the others), on a worker thread;
    the count is checked first. Decoding is the render process's (prepare_images)."""
    if config.max_images is not None and len(sources) > config.max_images:
        raise InvalidRequestError(f"{len(sources)} images in one request; at most {config.max_images} allowed "
                                  "(--limit-mm-per-prompt)", param=param)
    if all(_remote_scheme(s) is None for s in sources):   # nothing to fetch: no thread hop
        return [None] * len(sources)
    return await asyncio.to_thread(lambda: [fetch_remote(s, config) for s in sources])


def prepare_images(sources: Sequence[ImageSource], fetched: Sequence[Optional[bytes]],
                   bounds: Sequence[Optional[dict[str, int]]], config: MediaConfig,
                   vision: VisionConfig) -> tuple[PreparedImages, tuple[LoadedImage, ...]]:
    """Every image part decoded, resized within its bounds (pixel_bounds), patched and hashed, as the
    engine takes them, with what the log records of each. CPU-heavy and holding the GIL in parts: the
    render process runs it (prompting/render_pool.py), never the server's."""
    items, records = [], []
    # one at a time, each error naming its part
    for source, data, bound in zip(sources, fetched, bounds):
        image, record = load_image(source, config, data)
        items.append(prepare_image(image, vision, param=source.where, max_decoded_pixels=config.max_image_pixels,
                                   **(bound or {})))
        records.append(record)
    return PreparedImages(tuple(items)), tuple(records)
