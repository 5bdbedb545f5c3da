"""Tool calls and structured output end to end: the official openai and anthropic clients against
a live server on the random tiny model.

Random weights never write a well-formed call by chance, so every call here is forced
(tool_choice "required" / a named function / Anthropic "any" or "tool", response_format
json_schema): constrained decoding is what makes the model's output a call. Oracles: the JSON
schema itself (jsonschema_rs validates every argument object), the non-streamed response of the
same seeded request (the stream must assemble into it), and the pool's invariants afterwards.
"""
from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest
from live_server import MODEL, assert_pool_idle
from tool_fixtures import ANTHROPIC_TOOLS, MESSAGES, SCHEMAS, TOOLS, WEATHER, assert_valid_call

# ---------------------------------------------------------------- OpenAI
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_choice_returns_valid_tool_calls(client, server, seed):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", max_tokens=200, temperature=1.0,
                                       seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert_valid_call(call.function.name, call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)
    assert_pool_idle(server)


def test_named_function_and_no_parallel_calls_give_exactly_that_call(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        assert_valid_call("get_time", call.function.arguments)


def test_stream_assembles_into_the_non_streamed_calls(client, server):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=200, temperature=1.0, seed=7)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None, "the id is sent once, with the call's first delta"
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert_pool_idle(server)


def test_response_format_json_schema_constrains_content(client):
    schema = {"type": "object", "properties": {
        "answer": {"type": "string", "maxLength": 20},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["answer", "confidence", "tags"], "additionalProperties": False}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema_rs.validate(schema, json.loads(r.choices[0].message.content))


def test_history_with_tool_calls_and_tool_messages_renders_them(client, server):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", max_tokens=200, temperature=0)
    message = first.choices[0].message
    history = MESSAGES + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "n": i})}
        for i, c in enumerate(message.tool_calls)]
    # another salt: the server's turn memory would (rightly) keep the first turn's own tokens,
    # and this test compares with a plain tokenization of the rendered history
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            max_tokens=8, temperature=0, extra_body={"cache_salt": "fresh"})
    rendered = server.async_llm.tokenizer.apply_chat_template(
        history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    # the prompt holds every call the model made, written exactly as it wrote it, and the results
    for call in message.tool_calls:
        assert f'{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in rendered
    assert rendered.count("<tool_response>") == len(message.tool_calls)
    assert second.usage.prompt_tokens == len(server.async_llm.tokenizer.encode(rendered))


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}},
     "response_format"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "f"}}]}]},
     "messages[2].tool_calls[0]"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[2].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(server, body, param):
    payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert_pool_idle(server)


# ---------------------------------------------------------------- Anthropic
def test_anthropic_any_returns_tool_use_blocks(claude, server):
    for seed_text in ("Paris please", "Oslo please"):
        m = claude.messages.create(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "any"}, extra_body={"temperature": 1.0},
                                   messages=[{"role": "user", "content": seed_text}])
        assert m.stop_reason == "tool_use"
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and all(b.id.startswith("toolu_") for b in uses)
        for block in uses:
            jsonschema_rs.validate(SCHEMAS[block.name], block.input)
    assert_pool_idle(server)


def test_anthropic_stream_sends_input_json_deltas_that_assemble_into_the_input(claude):
    kwargs = dict(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": "Weather in Lima?"}])
    whole = claude.messages.create(**kwargs)
    partial = ""
    kinds = []
    with claude.messages.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial += event.delta.partial_json
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    (expected,) = [b for b in whole.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather"
    assert json.loads(partial) == use.input == expected.input
    jsonschema_rs.validate(WEATHER, use.input)
    assert "content_block_start" in kinds and "content_block_stop" in kinds


def test_anthropic_tool_result_history_renders_as_tool_turns(claude, server):
    first = claude.messages.create(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Lima?"}])
    (use,) = [b for b in first.content if b.type == "tool_use"]
    messages = [{"role": "user", "content": "Lima?"},
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"},
                    {"type": "text", "text": "And tomorrow?"}]}]
    second = claude.messages.create(model=MODEL, max_tokens=8, tools=ANTHROPIC_TOOLS, messages=messages,
                                    extra_body={"temperature": 0, "cache_salt": "fresh"})  # as above
    openai_history = [{"role": "user", "content": "Lima?"},
                      {"role": "assistant", "tool_calls": [{"id": use.id, "type": "function", "function": {
                          "name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}}]},
                      {"role": "tool", "content": "18 C and sunny"},
                      {"role": "user", "content": "And tomorrow?"}]
    rendered = server.async_llm.tokenizer.apply_chat_template(
        openai_history, tools=[t for t in TOOLS], tokenize=False, add_generation_prompt=True)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens + \
        second.usage.cache_creation_input_tokens == len(server.async_llm.tokenizer.encode(rendered))
    assert_pool_idle(server)


def test_anthropic_bad_tool_blocks_are_a_400(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    body["messages"] = [{"role": "user", "content": "hi"}]
    body["tool_choice"] = {"type": "tool", "name": "missing"}
    body["tools"] = ANTHROPIC_TOOLS
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400
    assert_pool_idle(server)
