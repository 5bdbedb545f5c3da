"""Every field validated at the edge: the inputs that used to fail inside the engine step (ending
every stream in flight) or in the tokenizer (a 500) are each a 400 naming the field, while a
stream already running finishes untouched; plus the small things a careful client notices."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from test_server_api import LiveServer, assert_pool_idle

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

MODEL = "random:qwen3-tiny"
ENGINE = dict(model=MODEL, seed=0, block_size=16, num_kv_blocks=512, max_model_len=2048, max_num_seqs=32)
CHAT = "/v1/chat/completions"
SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def server():
    app = build_app(LLMEngine(EngineConfig(**ENGINE)),
                    ServerConfig(max_messages=64, max_body_bytes=2**20, render_timeout_s=2.0))
    with LiveServer(app) as live:
        yield live


def chat_body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}], **extra}


def raw_json(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """JSON as the text given (NaN, Infinity and lone surrogate escapes are not what json.dumps sends)."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


BAD_INPUTS = [
    # (path, JSON text, the field the 400 must name)
    (CHAT, '{"model": "%s", "max_tokens": 2, "top_k": %d, "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, 2**63), "top_k"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "top_k": %d, "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, 10**29), "top_k"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "cache_salt": "a\\ud800b", '
           '"messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "cache_salt"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "x\\udc00"}]}' % MODEL,
     "messages[0].content"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "lone \\ud83d here"}' % MODEL, "prompt"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "temperature"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "top_p": Infinity, "messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "top_p"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "messages": [{"role": "wizard", "content": "hi"}]}' % MODEL,
     "messages[0].role"),
    ("/v1/cached_contents", '{"system": "%s", "ttl": Infinity}' % ("x " * 60), "ttl"),
    ("/v1/cached_contents", '{"system": "%s", "ttl": %d}' % ("x " * 60, 10**400), "ttl"),
    ("/v1/cached_contents", '{"system": "%s", "ttl": "%sh"}' % ("x " * 60, "9" * 400), "ttl"),
    ("/v1/messages", '{"model": "%s", "max_tokens": 2, "top_k": %d, "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, 2**40), "top_k"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "chat_template": "{{ 1 }}", '
           '"messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "chat_template"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}, '
           '"messages": [{"role": "user", "content": "hi"}]}' % MODEL, "chat_template_kwargs.chat_template"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "messages": [%s]}'
     % (MODEL, ", ".join(['{"role": "user", "content": "m"}'] * 65)), "messages"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "tools": [%s1%s], "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, "[" * 40, "]" * 40), None),
    (CHAT, '{"model": "%s", "max_tokens": 2, "stop": [%s], "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, ", ".join(['"s%d"' % i for i in range(33)])), "stop"),
    ("/v1/cached_contents", '{"system": "%s", "name": "%s"}' % ("x " * 60, "n" * 300), "name"),
]


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
    from test_server_api import metrics
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        before = metrics(client).get("prefixserve:request_success_total", 0.0)
        with client.stream("POST", CHAT, json=chat_body(max_tokens=1500, ignore_eos=True, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # leave after the first chunk: the server aborts the request
        deadline = time.monotonic() + 30
        while metrics(client).get("prefixserve:request_success_total", 0.0) < before + 1:
            assert time.monotonic() < deadline, "the aborted request was never counted"
            time.sleep(0.05)
    assert_pool_idle(server)


def test_a_trusted_client_template_that_loops_for_ever_is_stopped_and_the_server_goes_on():
    app = build_app(LLMEngine(EngineConfig(**ENGINE)),
                    ServerConfig(trust_request_chat_template=True, render_timeout_s=1.0))
    with LiveServer(app) as live, httpx.Client(base_url=live.base_url, timeout=60) as client:
        # the sandbox refuses one huge range, not nested ones
        looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
        start = time.monotonic()
        r = client.post(CHAT, json=chat_body(chat_template=looping))
        assert r.status_code == 400 and r.json()["error"]["code"] == "render_timeout"
        assert time.monotonic() - start < 20
        ok = client.post(CHAT, json=chat_body(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))
        assert ok.status_code == 200, ok.text
        assert client.post(CHAT, json=chat_body()).status_code == 200
