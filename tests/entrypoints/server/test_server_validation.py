"""Every field validated at the edge: the inputs that used to fail inside the engine step (ending
every stream in flight) or in the tokenizer (a 500) are each a 400 naming the field, while a
stream already running finishes untouched; plus the small things a careful client notices."""
from __future__ import annotations

import threading

import httpx
import pytest
from bad_inputs import BAD_INPUTS, CHAT, raw_json
from live_server import ENGINE, MODEL, LiveServer, assert_pool_idle, metrics
from waiting import wait_until

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def server():
    """Body limits BAD_INPUTS is written against (tests/bad_inputs.py). The render timeout is below the
    clients' 60 s, so a render that hangs is reported as such, and far above a render's few ms: the
    render child runs at the lowest priority, and on a loaded machine a 2 s bound could cut off good bodies."""
    app = build_app(LLMEngine(EngineConfig(**ENGINE)),
                    ServerConfig(max_messages=64, max_body_bytes=2**20, render_timeout_s=30.0))
    with LiveServer(app) as live:
        yield live


def chat_body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}], **extra}


def check_bad_inputs(client: httpx.Client) -> None:
    for path, text, param in BAD_INPUTS:
        r = raw_json(client, path, text)
        error = r.json()["error"]
        assert 400 <= r.status_code < 500, (path, text[:80], r.text[:300])
        if param is not None and path == "/v1/messages":  # Anthropic's body has no param: the message names it
            assert error["message"].startswith(param), (text[:80], error)
        elif param is not None:
            assert error.get("param") == param, (text[:80], error)


def test_each_bad_field_is_a_400_naming_it_while_a_running_stream_finishes_untouched(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        chunks: list[str] = []

        def stream() -> None:
            with client.stream("POST", CHAT, json=chat_body(max_tokens=300, ignore_eos=True, stream=True)) as r:
                chunks.extend(line for line in r.iter_lines() if line.startswith("data:"))

        runner = threading.Thread(target=stream)
        runner.start()
        try:
            check_bad_inputs(client)
        finally:
            runner.join(60)
        assert chunks[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in chunks[-2].replace(" ", "")
        listing = client.get("/v1/cached_contents")
        assert listing.status_code == 200 and listing.json()["data"] == []
    assert server.in_engine(lambda e: e.stats().blocks_pinned) == 0
    assert_pool_idle(server)


def test_a_body_beyond_the_bound_is_a_413_before_it_is_parsed(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        r = client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": "x" * (2**20 + 10)}]))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert client.get("/health").status_code == 200


def test_request_id_is_echoed_and_streams_are_declared_as_event_streams(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        r = client.post(CHAT, json=chat_body(), headers={"X-Request-Id": "trace-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        schema = client.get("/openapi.json").json()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
            assert "text/event-stream" in schema["paths"][path]["post"]["responses"]["200"]["content"]


def test_aborted_requests_are_counted_in_the_request_metrics(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        before = metrics(client).get("prefixserve:request_success_total", 0.0)
        with client.stream("POST", CHAT, json=chat_body(max_tokens=1500, ignore_eos=True, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # leave after the first chunk: the server aborts the request
        wait_until(lambda: metrics(client).get("prefixserve:request_success_total", 0.0) >= before + 1,
                   what="the aborted request counted")
    assert_pool_idle(server)


def test_a_trusted_client_template_that_loops_for_ever_is_stopped_and_the_server_goes_on():
    app = build_app(LLMEngine(EngineConfig(**ENGINE)),
                    ServerConfig(trust_request_chat_template=True, render_timeout_s=5.0))
    with LiveServer(app) as live, httpx.Client(base_url=live.base_url, timeout=60) as client:
        # the sandbox refuses one huge range, not nested ones
        looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
        # 10^10 loop steps never end in a test's lifetime: an answer at all, and this one, says the
        # render was stopped (no wall-clock bound here: on a loaded machine it would race the load)
        r = client.post(CHAT, json=chat_body(chat_template=looping))
        assert r.status_code == 400 and r.json()["error"]["code"] == "render_timeout"
        ok = client.post(CHAT, json=chat_body(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))
        assert ok.status_code == 200, ok.text
        assert client.post(CHAT, json=chat_body()).status_code == 200
