"""The tool-call and structured-output paths a vLLM user reaches for beyond the basics, end to end
on the random tiny model (Qwen format) through the official clients: several calls at once,
max_tokens ending a call, tools together with response_format, and Anthropic's tool_choice
variants.

Oracles: the JSON schemas (jsonschema_rs), the same seeded request with enough max_tokens (a cut
call is the start of the whole one), the non-streamed response (a stream assembles into it) and
the pool's invariants.
"""
from __future__ import annotations

import json

import jsonschema_rs
import pytest

from prefixserve.entrypoints.server.anthropic.protocol import MessagesRequest
from prefixserve.entrypoints.server.anthropic.tools import message_tools
from prefixserve.entrypoints.server.tools import ChatTools

from live_server import MODEL, assert_pool_idle
from tool_fixtures import ANTHROPIC_TOOLS, MESSAGES, SCHEMAS, TOOLS, assert_valid_call

ANSWER = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 12},
    "sure": {"type": "boolean"}},
    "required": ["answer", "sure"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
QUESTIONS = ["Weather in Paris?", "Time in Oslo and weather in Lima?", "Plan my trip.", "Lima?",
             "Oslo, three days", "What time is it?"]


def assemble(chunks) -> tuple[dict[int, dict[int, dict]], dict[int, str], dict[int, str]]:
    """Per choice: calls by index, content and finish_reason, from a chat stream."""
    calls: dict[int, dict[int, dict]] = {}
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(c.index, {}).setdefault(d.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or d.function.name
                call["arguments"] += d.function.arguments or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return calls, content, finish


def as_pairs(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


# ------------------------------------------------------------------ OpenAI
def test_required_with_parallel_calls_writes_several_calls_and_without_exactly_one(client, server):
    counts = []
    for seed in range(6):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                      max_tokens=300, temperature=1.0, seed=seed)
        several = client.chat.completions.create(parallel_tool_calls=True, **kwargs).choices[0]
        single = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
        for choice in (several, single):
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert_valid_call(call.function.name, call.function.arguments)
            assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
        assert len(single.message.tool_calls) == 1
        counts.append(len(several.message.tool_calls))
    # the grammar lets the model go on to another call; random weights take that path sometimes
    assert max(counts) > 1, counts
    assert_pool_idle(server)


def test_several_calls_and_n_2_stream_into_the_non_streamed_calls(client, server):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2,
                  parallel_tool_calls=True, max_tokens=300, temperature=1.0, seed=4)
    whole = client.chat.completions.create(**kwargs)
    calls, content, finish = assemble(client.chat.completions.create(stream=True, **kwargs))
    for choice in whole.choices:
        streamed = [(c["name"], c["arguments"]) for _, c in sorted(calls[choice.index].items())]
        assert streamed == as_pairs(choice.message)
        assert content[choice.index] == "" and finish[choice.index] == "tool_calls"
    assert_pool_idle(server)


def test_max_tokens_inside_a_call_gives_length_and_the_call_as_far_as_it_was_written(client, server):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=2,
                  parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(max_tokens=300, **kwargs)
    (full,) = whole.choices[0].message.tool_calls
    cut_calls = 0
    for max_tokens in range(6, whole.usage.completion_tokens, 4):
        cut = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
        assert cut.finish_reason == "length"
        if cut.message.tool_calls is None:  # ended before the arguments began: all of it is text
            assert cut.message.content.startswith("<tool_call>")
        else:
            assert cut.message.content is None
            (call,) = cut.message.tool_calls
            assert call.function.name == "get_weather"
            # the whole arguments once they closed before the call did
            assert full.function.arguments.startswith(call.function.arguments)
            cut_calls += call.function.arguments != full.function.arguments
        calls, content, finish = assemble(client.chat.completions.create(
            stream=True, max_tokens=max_tokens, **kwargs))
        assert finish == {0: "length"} and content == {0: cut.message.content or ""}
        assert [(c["name"], c["arguments"]) for c in calls.get(0, {}).values()] == as_pairs(cut.message)
    assert cut_calls >= 1
    assert_pool_idle(server)


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_tools_with_response_format_give_schema_valid_content(client, server, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, response_format=FORMAT,
                  max_tokens=200, temperature=1.0, seed=1, **extra)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    jsonschema_rs.validate(ANSWER, json.loads(choice.message.content))
    calls, content, finish = assemble(client.chat.completions.create(stream=True, **kwargs))
    assert calls == {} and finish == {0: "stop"} and content == {0: choice.message.content}
    assert_pool_idle(server)


# --------------------------------------------------------------- Anthropic
def test_anthropic_any_is_required_and_disable_parallel_tool_use_gives_one_call(claude, server):
    # "any" is OpenAI's "required" with parallel calls (whose several calls the test above
    # shows): the very same grammar
    tokenizer = server.async_llm.tokenizer
    openai_shape = ChatTools.build(TOOLS, "required", True, None, tokenizer)
    for choice, parallel in (({"type": "any"}, True), ({"type": "any", "disable_parallel_tool_use": True}, False)):
        body = MessagesRequest(model=MODEL, max_tokens=8, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                               messages=[{"role": "user", "content": "hi"}])
        assert message_tools(body, tokenizer).structured == \
            ChatTools.build(TOOLS, "required", parallel, None, tokenizer).structured
    assert message_tools(MessagesRequest(model=MODEL, max_tokens=8, tools=ANTHROPIC_TOOLS,
                                         tool_choice={"type": "any"}, messages=[{"role": "user", "content": "hi"}]),
                         tokenizer).structured == openai_shape.structured
    for question in QUESTIONS:
        message = claude.messages.create(
            model=MODEL, max_tokens=300, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 1.0},
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": question}])
        assert message.stop_reason == "tool_use"
        (use,) = [b for b in message.content if b.type == "tool_use"]
        jsonschema_rs.validate(SCHEMAS[use.name], use.input)
    assert_pool_idle(server)


def test_anthropic_named_tool_uses_only_that_tool(claude, server):
    for question in QUESTIONS[:3]:
        message = claude.messages.create(model=MODEL, max_tokens=300, tools=ANTHROPIC_TOOLS,
                                         tool_choice={"type": "tool", "name": "get_time"},
                                         extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": question}])
        uses = [b for b in message.content if b.type == "tool_use"]
        assert uses and {b.name for b in uses} == {"get_time"}
        for block in uses:
            jsonschema_rs.validate(SCHEMAS["get_time"], block.input)
    assert_pool_idle(server)


def test_anthropic_max_tokens_inside_a_call_streams_as_it_is_answered(claude, server):
    kwargs = dict(model=MODEL, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "Weather in Lima?"}])
    (full,) = [b for b in claude.messages.create(max_tokens=300, **kwargs).content if b.type == "tool_use"]
    # 20 tokens end this request's call inside its arguments
    cut = claude.messages.create(max_tokens=20, **kwargs)
    assert cut.stop_reason == "max_tokens"
    (use,) = [b for b in cut.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    # what was written of the input: keys of the whole input, with its values where complete
    assert set(use.input) <= set(full.input) and use.input != full.input
    with claude.messages.stream(max_tokens=20, **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in cut.content]
    assert_pool_idle(server)
