"""Images through a real server: OpenAI image_url parts (data: URLs, file: URLs under the allowed folder)
and Anthropic base64 image blocks reach the model; image tokens count in prompt_tokens and, on a second
question about the same picture, in the cached tokens; each bad image is a 400 naming its field while
the server keeps serving."""
from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import LiveServer, metrics
from PIL import Image

from prefixserve import EngineConfig, LLMEngine, SamplingParams
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.media import MediaConfig
from prefixserve.model.random_models import RANDOM_PRESETS
from prefixserve.multimodal.processor import process_image

MODEL = "random:qwen2.5-vl-tiny"
MAX_IMAGE_BYTES = 200_000


def picture(seed: int, size: tuple[int, int] = (150, 230)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_tokens(image: Image.Image) -> int:
    return process_image(image, RANDOM_PRESETS["qwen2.5-vl-tiny"].vision).num_tokens


def bomb() -> bytes:
    """A small PNG whose header declares 100000 x 100000 pixels."""
    png = encoded(picture(9, (8, 8)))
    ihdr = png[12:29]
    body = b"IHDR" + struct.pack(">II", 100_000, 100_000) + ihdr[12:]
    return png[:8] + struct.pack(">I", 13) + body + struct.pack(">I", zlib.crc32(body)) + png[33:]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(encoded(picture(5)))
    return folder


@pytest.fixture(scope="module")
def server(media_dir: Path):
    engine = LLMEngine(EngineConfig(model=MODEL, seed=0, block_size=16, num_kv_blocks=256, max_model_len=2048,
                                    limit_mm_per_prompt={"image": 2}))
    config = ServerConfig(max_waiting=64, media=MediaConfig(allowed_local_path=str(media_dir),
                                                            max_image_bytes=MAX_IMAGE_BYTES, max_images=2))
    with LiveServer(build_app(engine, config)) as live:
        yield live


def chat(http: httpx.Client, parts: list, text: str = "What is it?") -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]})


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_openai_image_counts_and_caches(http: httpx.Client) -> None:
    image = picture(1)
    # the same conversation with the placeholder as plain text: its one <|image_pad|> is the image's tokens
    as_text = chat(http, [{"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}])
    first = chat(http, [image_part(data_url(encoded(image)))])
    assert first.status_code == 200, first.text
    tokens = image_tokens(image)
    assert first.json()["usage"]["prompt_tokens"] == as_text.json()["usage"]["prompt_tokens"] - 1 + tokens
    second = chat(http, [image_part(data_url(encoded(image)))])   # the same picture as PNG again
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (first.json()["usage"]["prompt_tokens"] - 1) // 16 * 16 >= tokens
    scraped = metrics(http)
    assert scraped["prefixserve:encoder_runs_total"] >= 1


def test_anthropic_base64_image(http: httpx.Client) -> None:
    image = picture(2)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(encoded(image, "JPEG")).decode()}}
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": [
        {"role": "user", "content": [block, {"type": "text", "text": "Describe it."}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > image_tokens(image)


def test_local_file_under_the_allowed_folder(http: httpx.Client, media_dir: Path) -> None:
    r = chat(http, [image_part((media_dir / "cat.png").as_uri())])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("case", ["undecodable", "truncated", "mismatched media type", "decompression bomb",
                                  "too many images", "over the size cap", "URL outside the allow-list",
                                  "file outside the folder"])
def test_bad_image_is_a_400_naming_the_field(http: httpx.Client, case: str, tmp_path: Path) -> None:
    png = encoded(picture(3))
    field = "messages[0].content[0].image_url.url"
    parts = {
        "undecodable": [image_part(data_url(b"definitely not an image"))],
        "truncated": [image_part(data_url(png[:len(png) // 2]))],
        "mismatched media type": [image_part(data_url(png, "image/jpeg"))],
        "decompression bomb": [image_part(data_url(bomb()))],
        "too many images": [image_part(data_url(png))] * 3,
        "over the size cap": [image_part(data_url(encoded(picture(4, (400, 400)))))],
        "URL outside the allow-list": [image_part("http://example.com/cat.png")],
        "file outside the folder": [image_part((tmp_path / "x.png").as_uri())],
    }[case]
    if case == "file outside the folder":
        (tmp_path / "x.png").write_bytes(png)
    r = chat(http, parts)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == ("messages" if case == "too many images" else field), error
    assert chat(http, [image_part(data_url(png))]).status_code == 200


def test_the_diagnosis_names_a_changed_picture(http: httpx.Client) -> None:
    """Two requests whose text is equal and whose picture differs: their token ids are equal, yet the
    diagnosis finds them diverging at the picture's first token, in the image part, and says why."""
    def ask(image: Image.Image) -> dict:
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "temperature": 0, "prefixserve": {"diagnose": True},
            "messages": [{"role": "system", "content": "You describe pictures for a catalogue, briefly."},
                         {"role": "user", "content": [{"type": "text", "text": "Item 7:"},
                                                      image_part(data_url(encoded(image))),
                                                      {"type": "text", "text": "Describe it."}]}]})
        assert r.status_code == 200, r.text
        return r.json()
    ask(picture(30))
    same = ask(picture(30))["prefixserve"]["diagnosis"]
    other = ask(picture(31))
    diagnosis = other["prefixserve"]["diagnosis"]
    assert same["note"] != diagnosis["note"]
    assert "picture" in diagnosis["note"]
    assert "message 1" in diagnosis["part"]   # the user turn holding the picture
    assert diagnosis["current_text"].startswith("<image>")
    # the divergence is the picture's first token: everything before it was shared
    assert diagnosis["shared_tokens"] == diagnosis["divergence_position"]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == diagnosis["divergence_position"] // 16 * 16


def test_responses_input_image_renders_as_chat_and_its_continuation_hits(http: httpx.Client) -> None:
    """/v1/responses takes input_image parts: the prompt is the chat route's for the same content
    (the oracle: chat completions' prompt_tokens), and a continuation by previous_response_id hits
    the cache past the picture."""
    image = picture(7)
    url = data_url(encoded(image))
    as_chat = chat(http, [image_part(url)])
    first = http.post("/v1/responses", json={
        "model": MODEL, "max_output_tokens": 3, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                               {"type": "input_text", "text": "What is it?"}]}]})
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["input_tokens"] == as_chat.json()["usage"]["prompt_tokens"]
    second = http.post("/v1/responses", json={
        "model": MODEL, "max_output_tokens": 3, "temperature": 0, "previous_response_id": first.json()["id"],
        "input": "And its colour?"})
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= image_tokens(image)
    assert usage["input_tokens_details"]["cached_tokens"] >= (first.json()["usage"]["input_tokens"] // 16 - 1) * 16


def large_picture(seed: int) -> Image.Image:
    """700x560 (500 image tokens at the model's bounds), smooth enough to stay under the byte cap."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, 700, dtype=np.float64)[None, :, None] * rng.uniform(0.2, 1.0, (1, 1, 3))
    return Image.fromarray(np.broadcast_to(ramp, (560, 700, 3)).astype(np.uint8))


def sized_part(image: Image.Image, **options) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(encoded(image)), **options}}


def test_detail_low_and_a_pixel_budget_shrink_the_picture(http: httpx.Client) -> None:
    image = large_picture(40)
    vision = RANDOM_PRESETS["qwen2.5-vl-tiny"].vision
    full = chat(http, [sized_part(image)]).json()["usage"]["prompt_tokens"]
    low = chat(http, [sized_part(image, detail="low")])
    assert low.status_code == 200, low.text
    # "low": at most 256 image tokens of 28x28 pixels (docs/multimodal.md)
    low_tokens = process_image(image, vision, max_pixels=256 * 28 * 28).num_tokens
    assert low_tokens <= 256 < image_tokens(image)
    assert low.json()["usage"]["prompt_tokens"] == full - image_tokens(image) + low_tokens
    responses = [http.post("/v1/responses", json={
        "model": MODEL, "max_output_tokens": 2, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(encoded(image)), "detail": detail},
            {"type": "input_text", "text": "What is it?"}]}]}).json()["usage"]["input_tokens"]
        for detail in ("auto", "low")]
    assert responses[0] - responses[1] == image_tokens(image) - low_tokens   # the same on /v1/responses
    budget = chat(http, [sized_part(image, max_pixels=100_000)])
    assert budget.status_code == 200, budget.text
    assert budget.json()["usage"]["prompt_tokens"] == full - image_tokens(image) + process_image(
        image, vision, max_pixels=100_000).num_tokens


def test_the_content_hash_covers_the_pixel_bounds(http: httpx.Client) -> None:
    image = large_picture(41)
    vision = RANDOM_PRESETS["qwen2.5-vl-tiny"].vision
    first = chat(http, [sized_part(image)]).json()["usage"]
    # the model's own bounds asked for explicitly: the same picture, the same hash, a hit past it
    same = chat(http, [sized_part(image, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)]).json()
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == (first["prompt_tokens"] - 1) // 16 * 16
    # one pixel less of budget: resized alike (as many tokens), yet other bounds are another picture
    other = chat(http, [sized_part(image, max_pixels=vision.max_pixels - 1)]).json()["usage"]
    assert other["prompt_tokens"] == first["prompt_tokens"]
    assert other["prompt_tokens_details"]["cached_tokens"] < image_tokens(image)


@pytest.mark.parametrize("options, field, message", [
    ({"max_pixels": 2_000_000}, "image_url.max_pixels", "outside the server's bounds"),
    ({"min_pixels": 10}, "image_url.min_pixels", "outside the server's bounds"),
    ({"min_pixels": 500_000, "max_pixels": 400_000}, "image_url.min_pixels", "above max_pixels"),
    ({"max_pixels": "big"}, "image_url.max_pixels", "positive integer"),
    ({"detail": "medium"}, "image_url.detail", "\"low\""),
])
def test_pixel_options_outside_the_bounds_are_a_400_naming_the_field(
        http: httpx.Client, options: dict, field: str, message: str) -> None:
    r = chat(http, [sized_part(picture(42), **options)])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"messages[0].content[0].{field}" and message in error["message"]
    assert chat(http, [sized_part(picture(42))]).status_code == 200   # the server goes on


def test_anthropic_image_block_takes_a_pixel_budget(http: httpx.Client) -> None:
    image = large_picture(43)
    vision = RANDOM_PRESETS["qwen2.5-vl-tiny"].vision

    def ask(**options) -> httpx.Response:
        return http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(encoded(image)).decode()}, **options},
            {"type": "text", "text": "What is it?"}]}]})
    small = ask(max_pixels=100_000)
    assert small.status_code == 200, small.text
    full, small = ask().json()["usage"], small.json()["usage"]
    assert full["input_tokens"] + full["cache_read_input_tokens"] - image_tokens(image) == \
        small["input_tokens"] + small["cache_read_input_tokens"] - process_image(
            image, vision, max_pixels=100_000).num_tokens
    bad = ask(max_pixels=0)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("messages[0].content[0].max_pixels")


def test_the_render_process_prepares_the_pictures(server: LiveServer, http: httpx.Client) -> None:
    """A server request's pictures reach the engine prepared by the render process: the engine decodes
    and processes none of them itself, yet the model runs on them. The same picture added in-process as
    a PIL image is prepared by the engine, and counted: the count is what would show a server request
    whose pictures the engine processed again."""
    def engine_stats():
        return server.in_engine(lambda engine: engine.stats())
    before = engine_stats()
    r = chat(http, [image_part(data_url(encoded(picture(50)))), image_part(data_url(encoded(picture(51))))])
    assert r.status_code == 200, r.text
    after = engine_stats()
    assert after.encoder_runs == before.encoder_runs + 2
    assert after.images_prepared == before.images_prepared

    async def offline() -> None:
        stream = await server.async_llm.add_request(
            "offline-picture", {"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is it?",
                                "multi_modal_data": {"image": [picture(52)]}}, SamplingParams(max_tokens=1))
        async for _ in stream:
            pass
    asyncio.run(offline())
    assert engine_stats().images_prepared == after.images_prepared + 1


def test_a_picture_the_processor_refuses_is_a_400_naming_its_part(http: httpx.Client) -> None:
    """Refused while being processed (in the render process), not while being decoded: the error names
    the part, as a decoding error does, and the server goes on."""
    sliver = picture(53, (1, 300))   # an aspect ratio of 300, over the processor's 200
    r = chat(http, [image_part(data_url(encoded(picture(54)))), image_part(data_url(encoded(sliver)))])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url.url", error
    assert "aspect ratio" in error["message"]
    assert chat(http, [image_part(data_url(encoded(picture(54))))]).status_code == 200
