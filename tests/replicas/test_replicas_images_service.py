"""Images under --replicas, on a local Ray cluster: 2 replicas of random:qwen2.5-vl-tiny behind the
prefix-aware router. The front hashes each picture as the engines do and the router keys the blocks a
picture overlaps by its hash: a second question on the same picture goes to the replica holding it and
reads the picture from its cache; the same text with another picture shares no block past the
picture's first. Each picture is processed once: the replicas' engines take the front's."""
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from prefixserve.diagnose import load_renderer
from prefixserve.diagnose.log_reader import parse_record
from prefixserve.engine import EngineConfig
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.model.random_models import RANDOM_PRESETS
from prefixserve.multimodal.processor import process_image
from prefixserve.replicas.policy import RoutingConfig
from prefixserve.replicas.service import ReplicaConfig, ReplicaService
from live_server import LiveServer
from replica_service import cached, router_views, routers_caught_up, routing, steady_routing
from waiting import wait_until

pytestmark = pytest.mark.slow
MODEL = "random:qwen2.5-vl-tiny"
SYSTEM = " ".join(f"rule{i} keep answers short and name the main object" for i in range(8))


@pytest.fixture(scope="module")
def replicated(cluster):
    service = ReplicaService(EngineConfig(model=MODEL, block_size=16, num_kv_blocks=256, dtype="float32",
                                          max_num_batched_tokens=512), ReplicaConfig(
        num_replicas=2, replica_cpus=0.5, app_name="vl", health_check_period_s=1.0,
        routing=RoutingConfig(router="prefix-aware")), max_waiting=16)
    front = service.start()
    with LiveServer(build_app(front, ServerConfig(max_waiting=16))) as live:
        yield front, live
    service.stop()


def png(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def ask(live, picture: Image.Image, question: str, diagnose: bool = False) -> dict:
    r = httpx.post(live.base_url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 2, "temperature": 0, "prefixserve": {"diagnose": diagnose}, "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png(picture)}},
                                         {"type": "text", "text": question}]}]})
    assert r.status_code == 200, r.text
    return r.json()


def matched_blocks(front) -> int:
    """Blocks the routers' index said the chosen replicas held, over every request routed so far."""
    return sum(sum(view["matched_blocks"].values()) for view in router_views(front).values())


def picture_span(picture: Image.Image, question: str) -> tuple[int, int]:
    """Where the picture's tokens are in the prompt: the prompt rendered as the server renders it."""
    tokens = process_image(picture, RANDOM_PRESETS["qwen2.5-vl-tiny"].vision).num_tokens
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
        {"type": "image", "prefixserve_image": {"hash": "0" * 32, "width": picture.width,
                                                "height": picture.height, "tokens": tokens}},
        {"type": "text", "text": question}]}]}
    placed = load_renderer(MODEL).render(parse_record(body, 1)[0]).images[0]
    return placed.start, placed.end


def test_the_same_picture_goes_to_its_holder_and_another_shares_nothing_past_it(replicated):
    front, live = replicated
    a = Image.fromarray(np.random.default_rng(3).integers(0, 256, (150, 230, 3), dtype=np.uint8))
    b = a.copy()
    b.putpixel((0, 0), tuple(255 - v for v in a.getpixel((0, 0))))   # one pixel differs
    start, end = picture_span(a, "What is it?")
    first = ask(live, a, "What is it?")
    assert first["usage"]["prompt_tokens"] > end > start > 16
    baseline = steady_routing(front)
    holder = max(baseline["held"], key=baseline["held"].get)
    routed = baseline["routed"].get(holder, 0)
    matched = matched_blocks(front)
    second = ask(live, a, "And its colour?")
    assert cached(second) >= end // 16 * 16 and cached(second) > start   # the picture read from the cache
    wait_until(lambda: routers_caught_up(front), what="the routers' view of the replicas' events")
    wait_until(lambda: sum(routing(front)["routed"].values()) == 2, what="the routers' reports")
    assert routing(front)["routed"].get(holder, 0) == routed + 1
    # the router's chain matched the holder's published blocks past the picture: it keys them by the
    # picture's hash exactly as the engine does (without it, nothing from the picture's first block on)
    matched_second = matched_blocks(front) - matched
    assert matched_second * 16 == cached(second)
    other = ask(live, b, "What is it?", diagnose=True)
    # the live diagnosis under --replicas keys the picture too: it names it as the cause
    assert other["prefixserve"]["diagnosis"]["divergence_position"] == start
    assert "picture" in other["prefixserve"]["diagnosis"]["note"]
    # the text before the picture at most: no block the picture touches is shared
    assert cached(other) <= start // 16 * 16
    wait_until(lambda: sum(routing(front)["routed"].values()) == 3, what="the routers' reports")
    assert matched_blocks(front) - matched - matched_second == cached(other) // 16
    # the replicas ran the vision tower on the pictures the front handed them, and processed none of
    # them again (images_prepared counts what an engine decodes and processes itself)
    wait_until(lambda: front.stats().encoder_runs >= 2, what="the replicas' published stats")
    assert front.stats().images_prepared == 0
