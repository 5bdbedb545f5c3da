"""Large bodies are parsed, checked and validated in the render process, and the conversation of
a chat body stays there until it is rendered. The oracle is the in-process path: a server that
offloads every body (offload_body_bytes=1) must answer every request, good or bad, exactly as a
server that offloads none, and the pool must be idle afterwards."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from bad_inputs import BAD_INPUTS, CHAT, raw_json
from live_server import ENGINE, MODEL, LiveServer, assert_pool_idle

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.prompting.bodies import ParsedConversation, parse_chat
from prefixserve.entrypoints.server.prompting.render_pool import RenderPool
from prefixserve.entrypoints.server.validation import BodyLimits

# a render timeout far above a render's time (the render child runs at the lowest priority: on a
# loaded machine a few seconds can pass) and below the clients' 60 s
SETTINGS = dict(max_messages=64, max_body_bytes=2**20, render_timeout_s=30.0)
SYSTEM = "You are the assistant of a large library. " * 8


@pytest.fixture(scope="module")
def servers():
    """(in-process, offloaded): two servers on identical engines."""
    apps = [build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(offload_body_bytes=bound, **SETTINGS))
            for bound in (2**30, 1)]
    with LiveServer(apps[0]) as local, LiveServer(apps[1]) as offloaded:
        yield local, offloaded


def _chat(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Which books are popular?"}], **extra}


VOLATILE = {"id", "created", "expires_at", "pin_id", "cached_content"}


def _stable(value):
    """The response without ids and clock readings."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _same_answer(a: httpx.Response, b: httpx.Response) -> None:
    assert a.status_code == b.status_code == 200, (a.text[:300], b.text[:300])
    assert _stable(a.json()) == _stable(b.json())


def test_every_bad_input_gets_the_same_answer_from_either_path(servers):
    local, offloaded = servers
    with httpx.Client(base_url=local.base_url, timeout=60) as a, \
            httpx.Client(base_url=offloaded.base_url, timeout=60) as b:
        cases = [(path, text) for path, text, _ in BAD_INPUTS] + [
            (CHAT, "{not json"), (CHAT, ""), (CHAT, "[1, 2]"), (CHAT, "[" * 100_000 + "]" * 100_000),
            (CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}]})),
            (CHAT, json.dumps({"model": MODEL, "max_tokens": "many", "messages": [{"role": "user"}]})),
            ("/v1/messages", json.dumps({"model": MODEL, "messages": []})),
            ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user"}]})),
        ]
        for path, text in cases:
            ra, rb = raw_json(a, path, text), raw_json(b, path, text)
            assert 400 <= ra.status_code < 500, (path, text[:80], ra.text[:300])
            assert (ra.status_code, ra.json()) == (rb.status_code, rb.json()), (path, text[:80])
        wrong_type = b.post(CHAT, content=b"{}", headers={"content-type": "text/plain"})
        assert wrong_type.status_code == 400 and wrong_type.json()["error"]["code"] == "invalid_json"
    assert_pool_idle(local)
    assert_pool_idle(offloaded)


def test_good_requests_get_the_same_answer_from_either_path(servers):
    local, offloaded = servers
    requests = [
        (CHAT, _chat()),
        (CHAT, _chat(messages=[{"role": "system", "content": [{"type": "text", "text": SYSTEM,
                                                               "cache_control": {"type": "ephemeral"}}]},
                               {"role": "user", "content": "And the rare ones?"}])),
        ("/v1/messages", {"model": MODEL, "max_tokens": 6, "temperature": 0, "system": SYSTEM,
                          "cache_control": {"type": "ephemeral"},
                          "messages": [{"role": "user", "content": "Which books are popular?"}]}),
        ("/v1/completions", {"model": MODEL, "max_tokens": 6, "temperature": 0, "prompt": SYSTEM}),
    ]
    with httpx.Client(base_url=local.base_url, timeout=60) as a, \
            httpx.Client(base_url=offloaded.base_url, timeout=60) as b:
        for path, body in requests:
            _same_answer(a.post(path, json=body), b.post(path, json=body))
        for client in (a, b):  # the cache_control pins, which outlive the requests
            assert client.post("/reset_prefix_cache").status_code == 200


def test_cached_contents_work_through_the_offloaded_path(servers):
    local, offloaded = servers
    content = {"model": MODEL, "name": "library", "system": SYSTEM, "ttl": "5m"}
    use = _chat(messages=[{"role": "user", "content": "Which books are popular?"}], cached_content="library")
    with_tools = {**use, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    with httpx.Client(base_url=local.base_url, timeout=60) as a, \
            httpx.Client(base_url=offloaded.base_url, timeout=60) as b:
        for client in (a, b):
            assert client.post("/v1/cached_contents", json=content).status_code == 200
        _same_answer(a.post(CHAT, json=use), b.post(CHAT, json=use))
        ra, rb = a.post(CHAT, json=with_tools), b.post(CHAT, json=with_tools)
        assert ra.status_code == rb.status_code == 400 and ra.json() == rb.json()
        assert ra.json()["error"]["param"] == "tools"
        for client in (a, b):
            assert client.delete("/v1/cached_contents/library").status_code == 200
    assert_pool_idle(local)
    assert_pool_idle(offloaded)


def test_a_conversation_lost_with_its_child_is_parsed_again():
    """The child is killed (a template timed out) between a body's parse and its rendering: the
    rendering still comes out exactly as the conversation built in the server process."""
    pool = RenderPool(MODEL, max_tokens=2048, timeout_s=30.0)
    limits = BodyLimits(max_messages=64, trust_request_chat_template=False)
    raw = json.dumps(_chat()).encode()

    async def run():
        body, source = await pool.parse_chat(raw, "chat", limits)
        assert isinstance(source, ParsedConversation) and body.messages == []
        kept = await pool.render(source)
        _, again = await pool.parse_chat(raw, "chat", limits)
        pool._kill()
        lost = await pool.render(again)
        local = await pool.render(parse_chat(raw, "chat", limits)[1])
        return kept, lost, local
    try:
        kept, lost, local = asyncio.run(run())
    finally:
        pool.shutdown()
    assert kept.token_ids == lost.token_ids == local.token_ids
    assert kept.text == local.text


def test_the_schema_still_describes_every_body(servers):
    local, _ = servers
    with httpx.Client(base_url=local.base_url, timeout=60) as client:
        schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, method, field in [(CHAT, "post", "messages"), ("/v1/messages", "post", "messages"),
                                ("/v1/completions", "post", "prompt"), ("/v1/cached_contents", "post", "ttl"),
                                ("/v1/cached_contents/{key}", "patch", "ttl")]:
        ref = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert field in components[ref.rsplit("/", 1)[1]]["properties"], (path, ref)
    text = json.dumps(schema)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}:
        assert ref in components, ref
