"""A log the server wrote lints to the prompt tokens the engine counted: Anthropic tool
conversations (tool_use, tool_result, tools with input_schema, system blocks, cache_control marks)
and OpenAI ones (text parts, tool_calls, tool messages), each rendered by the lint's reader and
renderer against the usage the real server reported for the same request."""
from __future__ import annotations

import httpx
from live_server import ENGINE, MODEL, LiveServer

from prefixserve import EngineConfig, LLMEngine
from prefixserve.diagnose import load_renderer
from prefixserve.diagnose.log_reader import read_log
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string"}}}
EPHEMERAL = {"type": "ephemeral"}

ANTHROPIC = [
    {"model": MODEL, "max_tokens": 2,
     "system": [{"type": "text", "text": "You are a travel assistant."},
                {"type": "text", "text": "Use the tools.", "cache_control": EPHEMERAL}],
     "tools": [{"name": "get_weather", "description": "The weather now", "input_schema": WEATHER},
               {"name": "get_time", "input_schema": CLOCK, "cache_control": EPHEMERAL}],
     "messages": [
         {"role": "user", "content": "Weather and time in Paris?"},
         {"role": "assistant", "content": [
             {"type": "text", "text": "Checking both."},
             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
             {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"zone": "Europe/Paris"}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, sunny"},
             {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
              "content": [{"type": "text", "text": "clock offline"}, {"type": "text", "text": "retry later"}]},
             {"type": "text", "text": "And tomorrow?"}]}]},
    {"model": MODEL, "max_tokens": 2, "system": "Short answers.",
     "tools": [{"name": "get_weather", "input_schema": WEATHER}],
     "messages": [
         {"role": "user", "content": [{"type": "text", "text": "Rome?"}, {"type": "text", "text": "Please."}]},
         {"role": "assistant", "content": [
             {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": {"city": "Rome, \u00e9t\u00e9"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                       "content": "30 C", "cache_control": EPHEMERAL}]}]},
]

OPENAI = [
    {"model": MODEL, "max_tokens": 2,
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER},
                "cache_control": EPHEMERAL}],
     "messages": [
         {"role": "system", "content": [{"type": "text", "text": "You are a travel assistant."},
                                        {"type": "text", "text": "Use the tools.", "cache_control": EPHEMERAL}]},
         {"role": "user", "content": "Weather in Oslo?", "cache_control": EPHEMERAL},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}]},
]


def reported_prompt_tokens(http: httpx.Client) -> list[int]:
    counts = []
    for body in ANTHROPIC:
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        counts.append(usage["input_tokens"] + usage["cache_read_input_tokens"]
                      + usage["cache_creation_input_tokens"])
    for body in OPENAI:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["prompt_tokens"])
    return counts


def test_a_logged_tool_conversation_lints_to_the_tokens_the_engine_counted(tmp_path):
    log = tmp_path / "requests.jsonl"
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(request_log=str(log)))
    with LiveServer(app) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        reported = reported_prompt_tokens(http)
    records = read_log(log)   # the server closed, so its writer has written every line
    renderer = load_renderer(MODEL)
    assert [len(renderer.render(record).token_ids) for record in records] == reported
    # the Anthropic tool blocks became what the template reads, not dropped text
    first = records[0]
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert [c["function"]["name"] for c in first.messages[2]["tool_calls"]] == ["get_weather", "get_time"]
    assert first.messages[4]["content"] == "Error: clock offline\nretry later"
    assert [t["function"]["name"] for t in first.tools] == ["get_weather", "get_time"]
