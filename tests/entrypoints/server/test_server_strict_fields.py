"""Strict request fields against a live server: an unknown field at any depth is a 400 naming
its path (as OpenAI's API answers), the same whether the body is parsed in the server or, being
large, in the render process; `allow_unknown_fields` lets them through and logs each once;
fields of the OpenAI and Anthropic APIs that prefixserve ignores answer exactly as without them,
the ones it cannot ignore are refused by name; a max_tokens beyond the context names max_tokens
and the largest value allowed; GET /v1/models/{id} serves client.models.retrieve()."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.auth import KeyTable
from prefixserve.entrypoints.server.config import ServerConfig
from live_server import LiveServer
from serve_process import start_serving

REPO = Path(__file__).resolve().parents[3]
MODEL = "random:qwen3-tiny"
# a short context, so that a request for every token it leaves runs quickly on a CPU
ENGINE = dict(model=MODEL, seed=0, block_size=16, num_kv_blocks=64, max_model_len=160, max_num_seqs=8)
USER = {"role": "user", "content": "Say hello."}
CHAT = {"model": MODEL, "messages": [USER], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Say hello.", "max_tokens": 2}
MESSAGES = {"model": MODEL, "max_tokens": 2, "messages": [USER]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}
# a body over the render process's threshold (64 KiB by default) in every test server below
PADDING = "x" * 70_000


def _serve(**config):
    return LiveServer(build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(**config)))


@pytest.fixture(scope="module")
def server():
    with _serve() as live:
        yield live


@pytest.fixture(scope="module")
def lenient():
    with _serve(allow_unknown_fields=True) as live:
        yield live


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def _padded(endpoint: str, body: dict) -> dict:
    """The same request made large by a longer first prompt (every case below puts its mistake
    after it): parsed in the render process, and refused before anything renders it."""
    if endpoint == "/v1/completions":
        return {**body, "prompt": PADDING}
    return {**body, "messages": [{"role": "user", "content": PADDING}, *body["messages"][1:]]}


# (endpoint, body, the path the error must name)
UNKNOWN = [
    ("/v1/chat/completions", {**CHAT, "temprature": 0.2}, "temprature"),
    ("/v1/chat/completions", {**CHAT, "messages": [USER, {"role": "user", "contnet": "hi"}]},
     "messages[1].contnet"),
    ("/v1/chat/completions", {**CHAT, "messages": [USER, {"role": "user", "content": [
        {"type": "text", "text": "hi", "txet": "hi"}]}]}, "messages[1].content[0].txet"),
    ("/v1/chat/completions", {**CHAT, "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "argumnts": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, "messages[1].tool_calls[0].function.argumnts"),
    ("/v1/chat/completions", {**CHAT, "tools": [{**TOOL, "functon": {}}]}, "tools[0].functon"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        **TOOL["function"], "paramters": {}}}]}, "tools[0].function.paramters"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "shema": {}}}}, "response_format.json_schema.shema"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usge": True}},
     "stream_options.include_usge"),
    ("/v1/chat/completions", {**CHAT, "prefixserve": {"diagnos": True}}, "prefixserve.diagnos"),
    ("/v1/completions", {**COMPLETION, "temprature": 0.2}, "temprature"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "text", "schema": {}}},
     "response_format.schema"),
    ("/v1/messages", {**MESSAGES, "temprature": 0.2}, "temprature"),
    ("/v1/messages", {**MESSAGES, "messages": [USER, {"role": "assistant", "content": [
        {"type": "text", "txt": "hi"}]}]}, "messages[1].content[0].txt"),
    ("/v1/messages", {**MESSAGES, "messages": [USER, {"role": "assistant", "content": "a", "nmae": "x"}]},
     "messages[1].nmae"),
    ("/v1/messages", {**MESSAGES, "tools": [{**ANTHROPIC_TOOL, "input_shema": {}}]}, "tools[0].input_shema"),
    ("/v1/messages", {**MESSAGES, "metadata": {"user": "u"}}, "metadata.user"),
]


@pytest.mark.parametrize("large", [False, True], ids=["inline", "render-process"])
@pytest.mark.parametrize("endpoint,body,path", UNKNOWN, ids=[p for _, _, p in UNKNOWN])
def test_an_unknown_field_is_a_400_naming_its_path(http, endpoint, body, path, large):
    r = http.post(endpoint, json=_padded(endpoint, body) if large else body)
    assert r.status_code == 400, r.text
    if endpoint == "/v1/messages":
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
    else:
        error = r.json()["error"]
        assert error["param"] == path
    assert error["message"] == f"Unrecognized request argument supplied: {path}"


def test_every_unknown_field_is_named(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "temprature": 0.2, "top_pp": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request arguments supplied: temprature, top_pp"


def test_the_official_client_gets_a_bad_request_for_a_typo(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=2, extra_body={"temprature": 0.2})
    assert err.value.body["param"] == "temprature"
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x")
    with pytest.raises(anthropic.BadRequestError, match="temprature"):
        claude.messages.create(model=MODEL, max_tokens=2, messages=[USER], extra_body={"temprature": 0.2})


def test_allowed_unknown_fields_answer_and_are_logged_once_per_name(lenient, caplog):
    name = f"extra_{uuid.uuid4().hex[:8]}"
    nested = f"note_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="prefixserve.entrypoints.server.fields")
    with httpx.Client(base_url=lenient.base_url, timeout=120) as http:
        for body in ({**CHAT, name: 1}, {**CHAT, name: 2}, {**CHAT, name: 3, "metadata": {"padding": PADDING}},
                     {**CHAT, "messages": [{**USER, nested: 1}, {**USER, nested: 2}]}):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert http.post("/v1/completions", json={**COMPLETION, name: 1}).status_code == 200
        assert http.post("/v1/messages", json={**MESSAGES, name: 1}).status_code == 200
        # what the server cannot ignore stays refused
        r = http.post("/v1/chat/completions", json={**CHAT, "audio": {"voice": "alloy", "format": "wav"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "audio"
    lines = [rec.getMessage() for rec in caplog.records]
    assert sum(repr(name) in line for line in lines) == 1, lines
    assert sum(repr(f"messages[].{nested}") in line for line in lines) == 1, lines


def test_ignored_openai_fields_change_nothing(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    plain = dict(model=MODEL, messages=[USER], max_tokens=4, temperature=0)
    expected = client.chat.completions.create(**plain).choices[0].message.content
    ignored = dict(user="u1", store=False, metadata={"app": "t"}, service_tier="auto", parallel_tool_calls=True,
                   prompt_cache_key="k", prompt_cache_retention="in_memory", safety_identifier="s",
                   modalities=["text"], reasoning_effort="low", verbosity="low")
    for name, value in ignored.items():
        got = client.chat.completions.create(**plain, **{name: value}).choices[0].message.content
        assert got == expected, name
    stream = client.chat.completions.create(**plain, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    text = client.completions.create(model=MODEL, prompt="Say hello.", max_tokens=4, temperature=0).choices[0].text
    assert client.completions.create(model=MODEL, prompt="Say hello.", max_tokens=4, temperature=0,
                                     user="u1").choices[0].text == text


def test_ignored_anthropic_fields_change_nothing(server):
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x")
    plain = dict(model=MODEL, max_tokens=4, messages=[USER])
    expected = claude.messages.create(**plain, extra_body={"temperature": 0}).content[0].text
    ignored = {"metadata": {"user_id": "u1"}, "service_tier": "standard_only", "inference_geo": "us",
               "speed": "standard", "thinking": {"type": "disabled"}}
    for name, value in ignored.items():
        got = claude.messages.create(**plain, extra_body={"temperature": 0, name: value}).content[0].text
        assert got == expected, name


REFUSED = [
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "hello"}),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "functions", [TOOL["function"]]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "logit_bias", {"42": 5}),
    ("/v1/completions", "logit_bias", {"42": 5}),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "suffix", "!"),
    ("/v1/messages", "thinking", {"type": "enabled", "budget_tokens": 1024}),
    ("/v1/messages", "container", "c1"),
    ("/v1/messages", "mcp_servers", [{"type": "url", "url": "https://example.com", "name": "m"}]),
    ("/v1/messages", "output_config", {"effort": "low"}),
]


@pytest.mark.parametrize("endpoint,name,value", REFUSED, ids=[f"{e.split('/')[-1]}-{n}" for e, n, _ in REFUSED])
def test_a_field_that_would_change_the_answer_is_refused_by_name(http, endpoint, name, value):
    body = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/messages": MESSAGES}[endpoint]
    r = http.post(endpoint, json={**body, name: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert name in error["message"] and "not supported" in error["message"]
    if endpoint != "/v1/messages":
        assert error["param"] == name


def _context(http) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]


def test_max_tokens_too_large_names_max_tokens_and_the_largest_allowed(http):
    context = _context(http)
    prompt = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    largest = context - prompt
    for field in ("max_tokens", "max_completion_tokens"):
        body = {"model": MODEL, "messages": [USER], field: largest + 1}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field
        assert error["message"].startswith(f"{field} must be at most {largest} ")
        ok = http.post("/v1/chat/completions", json={**body, field: largest, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == largest
    prompt = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    r = http.post("/v1/completions", json={**COMPLETION, "max_tokens": context - prompt + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert f"at most {context - prompt} " in r.json()["error"]["message"]
    usage = http.post("/v1/messages", json={**MESSAGES, "max_tokens": 1}).json()["usage"]
    prompt = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                             "cache_creation_input_tokens"))
    r = http.post("/v1/messages", json={**MESSAGES, "max_tokens": context - prompt + 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"max_tokens must be at most {context - prompt} ")


def test_models_retrieve_gives_the_listed_model_and_404s_an_unknown_one(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    listed = client.models.list().data
    assert [client.models.retrieve(m.id) for m in listed] == listed
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o-mini")
    assert err.value.body["type"] == "not_found_error" and "gpt-4o-mini" in err.value.body["message"]


def test_models_retrieve_needs_a_key_like_the_other_routes():
    with _serve(keys=KeyTable.single("k-alpha-0123")) as live:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            assert http.get(f"/v1/models/{MODEL}").status_code == 401
            assert http.get("/v1/models").status_code == 401
            r = http.get(f"/v1/models/{MODEL}", headers={"Authorization": "Bearer k-alpha-0123"})
            assert r.status_code == 200 and r.json()["id"] == MODEL


def test_serve_allow_unknown_fields_answers_and_logs_each_field_once():
    """The switch as an operator turns it on: `prefixserve serve --allow-unknown-fields`."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc, base = start_serving(
        [sys.executable, "-m", "prefixserve.entrypoints.cli", "serve", "--model", MODEL,
         "--num-kv-blocks", "64", "--max-model-len", "160", "--allow-unknown-fields", "--log-level", "warning"],
        cwd=REPO, env=env)
    try:
        for value in (0.2, 0.3):
            r = httpx.post(base + "/v1/chat/completions", json={**CHAT, "temprature": value}, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    lines = [line for line in out.splitlines() if "'temprature'" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], out
