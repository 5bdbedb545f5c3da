"""An answer held to a JSON schema and cut by max_tokens says so, and what it holds is a valid
start of an answer the schema accepts: chat completions and completions with response_format,
a forced tool call on chat completions (finish_reason "length") and on Messages (stop_reason
"max_tokens").

Oracles, independent of the grammar code: jiter's partial-JSON parser (the text so far is the
start of one JSON object, nothing after it), jsonschema_rs on what it parsed with `required` lifted
(every key and value written so far is one the schema allows), the same request with room to
finish (valid whole, and the cut is its prefix: temperature 0)."""
from __future__ import annotations

import json

import jiter
import jsonschema_rs
from live_server import MODEL, assert_pool_idle

SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 48},
    "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Capital of France, and your confidence from 0 to 9?"}]
CUTS = (1, 2, 4, 7, 11, 16, 24, 40)


def assert_valid_start(text: str, schema: dict = SCHEMA) -> None:
    partial = jiter.from_json(text.encode(), partial_mode="trailing-strings") if text else {}
    assert isinstance(partial, dict), text
    jsonschema_rs.validate({**schema, "required": []}, partial)


def cuts_below(tokens: int) -> list[int]:
    cuts = [n for n in CUTS if n < tokens]
    assert len(cuts) >= 4, f"the whole answer is {tokens} tokens: too short to cut"
    return cuts


def test_chat_response_format_cut_says_length_and_is_a_valid_start(client, server):
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, response_format=RESPONSE_FORMAT)
    whole = client.chat.completions.create(max_tokens=400, **kwargs)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(whole.choices[0].message.content))
    for max_tokens in cuts_below(whole.usage.completion_tokens):
        cut = client.chat.completions.create(max_tokens=max_tokens, **kwargs)
        choice = cut.choices[0]
        assert choice.finish_reason == "length" and cut.usage.completion_tokens == max_tokens
        assert whole.choices[0].message.content.startswith(choice.message.content)
        assert_valid_start(choice.message.content)
        chunks = list(client.chat.completions.create(max_tokens=max_tokens, stream=True, **kwargs))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert_pool_idle(server)


def test_completions_response_format_cut_says_length_and_is_a_valid_start(client, server):
    kwargs = dict(model=MODEL, prompt="Capital of France as JSON: ", temperature=0,
                  extra_body={"response_format": RESPONSE_FORMAT})
    whole = client.completions.create(max_tokens=400, **kwargs)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(whole.choices[0].text))
    for max_tokens in cuts_below(whole.usage.completion_tokens):
        choice = client.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
        assert choice.finish_reason == "length"
        assert whole.choices[0].text.startswith(choice.text)
        assert_valid_start(choice.text)
    assert_pool_idle(server)


TOOL = {"type": "function", "function": {"name": "rate", "description": "Rate an answer", "parameters": SCHEMA}}


def test_a_forced_tool_call_cut_says_length_and_its_arguments_are_a_valid_start(client, server):
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, tools=[TOOL], parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "rate"}})
    whole = client.chat.completions.create(max_tokens=400, **kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    (full,) = whole.choices[0].message.tool_calls
    jsonschema_rs.validate(SCHEMA, json.loads(full.function.arguments))
    calls = 0
    for max_tokens in cuts_below(whole.usage.completion_tokens):
        choice = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
        assert choice.finish_reason == "length"
        if choice.message.tool_calls:   # before its arguments began a call is text (test_tool_calls_paths.py)
            (call,) = choice.message.tool_calls
            assert call.function.name == "rate" and full.function.arguments.startswith(call.function.arguments)
            assert_valid_start(call.function.arguments)
            calls += 1
    assert calls >= 2
    assert_pool_idle(server)


def test_a_forced_anthropic_tool_use_cut_says_max_tokens_and_holds_only_allowed_values(claude, server):
    kwargs = dict(model=MODEL, messages=MESSAGES, extra_body={"temperature": 0},
                  tools=[{"name": "rate", "description": "Rate an answer", "input_schema": SCHEMA}],
                  tool_choice={"type": "tool", "name": "rate", "disable_parallel_tool_use": True})
    whole = claude.messages.create(max_tokens=400, **kwargs)
    assert whole.stop_reason == "tool_use"
    (full,) = [b for b in whole.content if b.type == "tool_use"]
    jsonschema_rs.validate(SCHEMA, full.input)
    uses = 0
    for max_tokens in cuts_below(whole.usage.output_tokens):
        cut = claude.messages.create(max_tokens=max_tokens, **kwargs)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == max_tokens
        for block in cut.content:
            if block.type == "tool_use":
                jsonschema_rs.validate({**SCHEMA, "required": []}, block.input)
                assert all(full.input[k] == v for k, v in block.input.items())   # complete values only
                uses += 1
    assert uses >= 2
    assert_pool_idle(server)
