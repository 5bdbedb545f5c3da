"""A VL server's request log lints to what the server did with its pictures: the log records each
picture by its content hash, decoded size and tokens, never its bytes; the lint keys the picture's
tokens by that hash, so its reusable tokens equal the cached tokens the server reported, and a changed
picture is named (changed-image, with its part), the same picture resized said to be another picture,
and the same picture in another lossless encoding no miss at all."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
from live_server import LiveServer
from PIL import Image

from prefixserve import EngineConfig, LLMEngine
from prefixserve.diagnose import lint, load_renderer
from prefixserve.diagnose.log_reader import read_log
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.model.random_models import RANDOM_PRESETS
from prefixserve.multimodal.processor import process_image

MODEL = "random:qwen2.5-vl-tiny"
SYSTEM = "You describe pictures for a catalogue. Answer in one short sentence, naming the main object."


def picture(seed: int, size: tuple[int, int] = (150, 230)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def body(data: bytes, media_type: str) -> dict:
    url = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
    return {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "Describe it."}]}]}


def test_a_vl_servers_log_lints_to_its_cached_tokens_and_names_the_changed_picture(tmp_path):
    log = tmp_path / "requests.jsonl"
    engine = LLMEngine(EngineConfig(model=MODEL, seed=0, block_size=16, num_kv_blocks=256, max_model_len=2048))
    a, b = picture(1), picture(1)
    b.putpixel((7, 7), tuple(255 - v for v in a.getpixel((7, 7))))   # one pixel differs
    resized = a.resize((300, 460))
    sent = [("a.png", encoded(a, "PNG"), "image/png"), ("a.bmp", encoded(a, "BMP"), "image/bmp"),
            ("b.png", encoded(b, "PNG"), "image/png"), ("a-resized.png", encoded(resized, "PNG"), "image/png")]
    with LiveServer(build_app(engine, ServerConfig(request_log=str(log)))) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as http:
        usages = []
        for _, data, media_type in sent:
            r = http.post("/v1/chat/completions", json=body(data, media_type))
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    text = log.read_text()
    for _, data, _ in sent:   # no picture's bytes reach the log
        assert base64.b64encode(data).decode()[:64] not in text
    logged = [json.loads(line)["body"]["messages"][1]["content"][0] for line in text.splitlines()]
    vision = RANDOM_PRESETS["qwen2.5-vl-tiny"].vision
    for part, (_, data, _), image in zip(logged, sent, (a, a, b, resized)):
        assert set(part) == {"type", "prefixserve_image"}
        record = part["prefixserve_image"]
        assert (record["width"], record["height"]) == image.size
        assert record["tokens"] == process_image(image, vision).num_tokens
        assert record["bytes"] == len(data)
    hashes = [p["prefixserve_image"]["hash"] for p in logged]
    # the same pixels in two encodings: one hash; one pixel off, or resized: others
    assert hashes[0] == hashes[1] and len({hashes[0], hashes[2], hashes[3]}) == 3

    records = read_log(log)
    renderer = load_renderer(MODEL)
    assert [len(renderer.render(r).token_ids) for r in records] == [u["prompt_tokens"] for u in usages]
    report = lint(records, renderer, block_size=16)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert [r.reusable_tokens for r in report.requests] == cached
    # the BMP is the PNG's picture: its picture's tokens were all reused, and no rule fires on it
    first_image = renderer.render(records[0]).images[0]
    assert cached[1] >= first_image.end and not report.requests[1].findings
    # one pixel off: a miss from the picture's block on, named with its part
    changed = [f for f in report.requests[2].findings if f.rule == "changed-image"]
    assert len(changed) == 1 and changed[0].position == first_image.start
    assert cached[2] == first_image.start // 16 * 16
    assert "messages[1].content[0]" in changed[0].detail and "the same size" in changed[0].detail
    assert changed[0].tokens_lost == cached[1] - cached[2]
    # resized: another size, so another picture
    resized_finding = [f for f in report.requests[3].findings if f.rule == "changed-image"]
    assert len(resized_finding) == 1 and "300x460" in resized_finding[0].detail
    assert f"{a.width}x{a.height}" in resized_finding[0].detail
