"""Llama 3 JSON tool calls streamed incrementally, end to end: a tiny random Llama checkpoint in
the HF layout whose chat template teaches the Llama 3 format, served live, through the official
openai and anthropic clients.

The format is read from the template, so a forced tool_choice makes the model write
`{"name": ..., "parameters": {...}}` calls. Oracles: the JSON schema (jsonschema_rs), the
non-streamed response of the same seeded request (the stream must assemble into it), the same
request with more max_tokens (a cut call is the start of the whole one) and the pool's invariants.
"""
from __future__ import annotations

import json

import jsonschema_rs
import pytest

from prefixserve import EngineConfig, LLMEngine
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

from checkpoint_factory import write_tiny_checkpoint
from live_server import LiveServer, assert_pool_idle
from tool_fixtures import ANTHROPIC_TOOLS, MESSAGES, SCHEMAS, TOOLS, assert_valid_call

# A template of our own in the Llama 3.1 manner: tool results come back in `ipython` turns and
# calls are JSON objects with "name" and "parameters", `;` between several.
LLAMA3_TEMPLATE = """
{%- if tools -%}
<|im_start|>system
Call functions by answering with JSON only: {"name": function name, "parameters": arguments}.
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'tool' -%}<|im_start|>ipython
{{ m.content }}<|im_end|>
{% elif m.tool_calls -%}<|im_start|>assistant
{% for c in m.tool_calls %}{% if not loop.first %}; {% endif %}{"name": {{ c.function.name | tojson }}, "parameters": {{ c.function.arguments }}}{% endfor %}<|im_end|>
{% else -%}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("llama3-tools"), "llama", seed=0)
    (folder / "chat_template.jinja").write_text(LLAMA3_TEMPLATE, encoding="utf-8")
    engine = LLMEngine(EngineConfig(model=str(folder), seed=0, block_size=16, num_kv_blocks=512,
                                    max_model_len=2048, max_num_seqs=64))
    with LiveServer(build_app(engine, ServerConfig(max_waiting=64))) as live:
        live.model = str(folder)
        yield live


def streamed_calls(client, **kwargs) -> tuple[dict[int, dict], str, str, int]:
    """(calls by index, content, finish_reason, argument fragments sent before the last chunk)."""
    calls: dict[int, dict] = {}
    content, finish, early = "", None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None, "the id and name are sent once, first"
                    call["id"], call["name"] = d.id, d.function.name
                assert call["id"] is not None
                call["arguments"] += d.function.arguments or ""
                early += bool(d.function.arguments) and not c.finish_reason
            finish = c.finish_reason or finish
    return calls, content, finish, early


def test_the_template_teaches_the_llama3_format(server):
    from prefixserve.entrypoints.server.tools import tool_format
    assert tool_format(server.async_llm.tokenizer) == "llama3"


@pytest.mark.parametrize("seed", [1, 2])
def test_llama3_calls_stream_incrementally_into_the_non_streamed_calls(client, server, seed):
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=200, temperature=1.0, seed=seed)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    for call in whole.message.tool_calls:
        assert_valid_call(call.function.name, call.function.arguments)
    calls, content, finish, early = streamed_calls(client, **kwargs)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # arguments arrive as they are written, not in one piece at the end
    assert early > len(calls)
    assert_pool_idle(server)


def test_llama3_call_cut_by_max_tokens_is_the_start_of_the_whole_call(client, server):
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=3,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (full,) = client.chat.completions.create(max_tokens=200, **kwargs).choices[0].message.tool_calls
    cut = client.chat.completions.create(max_tokens=12, **kwargs).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    (call,) = cut.message.tool_calls
    assert call.function.name == "get_weather"
    assert full.function.arguments.startswith(call.function.arguments)
    assert len(call.function.arguments) < len(full.function.arguments)
    calls, content, finish, _ = streamed_calls(client, max_tokens=12, **kwargs)
    assert finish == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert_pool_idle(server)


def test_llama3_anthropic_stream_sends_several_input_json_deltas(claude, server):
    kwargs = dict(model=server.model, max_tokens=200, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "Weather in Lima?"}])
    whole = claude.messages.create(**kwargs)
    fragments = []
    with claude.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in uses] == [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    assert len(fragments) > len(uses)
    for block in uses:
        jsonschema_rs.validate(SCHEMAS[block.name], block.input)
    assert_pool_idle(server)


def test_an_answer_in_the_shape_of_a_call_stays_the_answer_under_response_format(client, server):
    """With response_format the output is the format asked for: JSON shaped like a Llama 3 call
    (which a Llama 3 model could well write) is content, streamed or not."""
    shaped = {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                       "required": ["city"], "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False}
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0,
                  seed=1, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": shaped}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert json.loads(choice.message.content)["name"] == "get_weather"
    jsonschema_rs.validate(shaped, json.loads(choice.message.content))
    calls, content, finish, _ = streamed_calls(client, **kwargs)
    assert calls == {} and finish == "stop" and content == choice.message.content
    assert_pool_idle(server)
