"""/v1/responses end to end through the official openai client against a live server.

Oracles: the KV cache itself (a prompt's cached tokens can only cover tokens identical to an
earlier prompt's, so an agent loop whose every turn hits the whole previous turn proves the
continuation rendered the previous prompt and output token for token), the openai client's own
parsing of every object and event, jsonschema_rs for structured output, and the non-streamed
answer for the streamed one (greedy).
"""
from __future__ import annotations

import json

import httpx
import jsonschema_rs
import openai
import pytest
from live_server import ENGINE, MODEL, assert_pool_idle
from tool_fixtures import SCHEMAS, TOOLS, assert_valid_call

BS = ENGINE["block_size"]
TURNS = 12
INSTRUCTIONS = ("You are a travel agent. Use the tools to look up weather and local time before you "
                "answer, one call per turn, and keep every result in mind. ") * 4
# the fixtures' tools in the Responses shape (flat: name, description, parameters)
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def covered(prompt_tokens: int, completion_tokens: int) -> int:
    """The previous turn's tokens a continuation must find cached: every full block of its prompt
    and output (its last output token, the end of turn, was sampled but never computed)."""
    return (prompt_tokens + completion_tokens - 1) // BS * BS


def _turn(client, turn: int, **kwargs):
    """Even turns through responses.create, odd ones through responses.stream."""
    kwargs = dict(model=MODEL, instructions=INSTRUCTIONS, tools=RESPONSE_TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=200, temperature=1.0,
                  extra_body={"seed": turn}, **kwargs)
    if turn % 2 == 0:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        return stream.get_final_response()


def test_agent_loop_through_previous_response_id_hits_every_earlier_turn(server, client):
    r = _turn(client, 0, input="Plan a week: weather in Paris, Oslo and Lima, and their times.")
    table = []
    previous = None
    for turn in range(TURNS):
        assert r.status == "completed"
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1
        assert_valid_call(calls[0].name, calls[0].arguments)
        usage = r.usage
        bound = covered(*previous) if previous is not None else 0
        table.append((turn + 1, usage.input_tokens, usage.input_tokens_details.cached_tokens, bound))
        assert usage.input_tokens_details.cached_tokens >= bound, table
        previous = (usage.input_tokens, usage.output_tokens)
        if turn == TURNS - 1:
            break
        result = {"turn": turn, "tool": calls[0].name, "value": 17.5 + turn}
        r = _turn(client, turn + 1, previous_response_id=r.id,
                  input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps(result)}])
    print("turn, prompt tokens, cached tokens, the previous turn's full blocks:", table)
    # the last response holds the whole conversation: 1 user message, then a call and its output a turn
    items = client.responses.input_items.list(r.id, order="asc", limit=100).data
    assert [i.type for i in items] == ["message"] + ["function_call", "function_call_output"] * (TURNS - 1)
    assert_pool_idle(server)


def test_streamed_events_follow_openais_sequence_and_equal_the_created_response(client):
    kwargs = dict(model=MODEL, input="Say something about caches.", max_output_tokens=24, temperature=0,
                  store=False)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{whole.status}"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text
    if final is not None:
        assert final.output_text == whole.output_text
        assert final.usage.output_tokens == whole.usage.output_tokens


def test_streamed_function_call_arguments_add_up_to_the_call(client):
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=RESPONSE_TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                                 temperature=1.0, extra_body={"seed": 3}, store=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.name == "get_weather"
    assert_valid_call(call.name, call.arguments)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments


def test_text_format_json_schema_constrains_the_answer(client):
    schema = SCHEMAS["get_weather"]
    r = client.responses.create(model=MODEL, input="Weather as JSON", max_output_tokens=200, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "weather", "schema": schema}},
                                extra_body={"seed": 1})
    assert r.status == "completed"
    jsonschema_rs.validate(schema, json.loads(r.output_text))


def test_retrieve_list_input_items_and_delete(client):
    first = client.responses.create(model=MODEL, input="First question", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=4,
                                      temperature=0, input=[{"role": "user", "content": [
                                          {"type": "input_text", "text": "Second"},
                                          {"type": "input_text", "text": "question"}]}])
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    assert got.previous_response_id == first.id
    assert got.usage.input_tokens == second.usage.input_tokens
    newest_first = client.responses.input_items.list(second.id).data
    assert [i.type for i in newest_first] == ["message", "message", "message"]
    assert [i.role for i in newest_first] == ["user", "assistant", "user"]
    assert [c.text for c in newest_first[0].content] == ["Second", "question"]
    assert newest_first[1].content[0].text == first.output_text
    oldest_first = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in oldest_first.data] == [i.id for i in newest_first[::-1][:2]]
    assert oldest_first.has_more
    # the client pages on by `after` until has_more is false
    assert [i.id for i in client.responses.input_items.list(second.id, limit=1)] == [i.id for i in newest_first]
    client.responses.delete(second.id)
    for gone in (lambda: client.responses.retrieve(second.id),
                 lambda: client.responses.create(model=MODEL, previous_response_id=second.id, input="more")):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = client.responses.create(model=MODEL, input="Not kept", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


BAD_BODIES = [
    ({"previous_response_id": "resp_" + "0" * 32, "input": "hi"}, 404, "previous_response_id"),
    ({"previous_response_id": "../../etc/passwd", "input": "hi"}, 404, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "bogus"}]}, 400, "input[0].type"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, 400,
     "input[0].content[0].file_id"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 400,
     "input[0].content[0].type"),
    # a picture for a text-only model
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     400, "input"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"}]}, 400,
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id"),
    ({"input": [{"role": "user", "content": "hi", "contnet": 1}]}, 400, "input[0].contnet"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": ENGINE["max_model_len"]}, 400, "max_output_tokens"),
    ({"input": "hi " * ENGINE["max_model_len"]}, 400, "input"),
    ({"input": "hi", "temprature": 0.5}, 400, "temprature"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": "hi"}] * 3000}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "hi", "prompt_cache_retention": "forever"}, 400, "prompt_cache_retention"),
]


@pytest.mark.parametrize("body,status,param", BAD_BODIES)
def test_bad_input_is_a_4xx_naming_the_field(http, body, status, param):
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = http.post("/v1/responses", json={"model": MODEL, "input": "still serving", "max_output_tokens": 2,
                                          "store": False})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_unknown_stored_ids_are_404_on_every_route(http):
    for method, path in (("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/" + "resp_" + "1" * 32),
                         ("GET", "/v1/responses/resp_%2e%2e/input_items")):
        r = http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


@pytest.fixture
def two_tenants(tmp_path):
    from live_server import LiveServer

    from prefixserve import EngineConfig, LLMEngine
    from prefixserve.entrypoints.server.app import build_app
    from prefixserve.entrypoints.server.auth import KeyTable
    from prefixserve.entrypoints.server.config import ServerConfig
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-acme-0001": "acme", "key-globex-01": "globex"}))
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(keys=KeyTable.from_file(keys)))
    with LiveServer(app) as live:
        yield live


def test_another_tenants_response_is_404(two_tenants):
    def client(key):
        return openai.OpenAI(base_url=two_tenants.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
    a, b = client("key-acme-0001"), client("key-globex-01")
    mine = a.responses.create(model=MODEL, input="Acme's secret plan", max_output_tokens=4, temperature=0)
    for attempt in (lambda: b.responses.retrieve(mine.id), lambda: b.responses.input_items.list(mine.id),
                    lambda: b.responses.delete(mine.id),
                    lambda: b.responses.create(model=MODEL, previous_response_id=mine.id, input="and?")):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert a.responses.retrieve(mine.id).output_text == mine.output_text
    with httpx.Client(base_url=two_tenants.base_url, timeout=60) as raw:
        assert raw.get(f"/v1/responses/{mine.id}").status_code == 401


def test_diagnose_against_an_earlier_response_names_it(client):
    first = client.responses.create(model=MODEL, input="The manual covers caching.", max_output_tokens=2,
                                     temperature=0)
    second = client.responses.create(model=MODEL, input="The handbook covers caching.", max_output_tokens=2,
                                      temperature=0, extra_body={"diagnose_against": first.id})
    diagnosis = second.model_extra["prefixserve"]["diagnosis"]
    assert diagnosis["compared_to"] == "resp-" + first.id[len("resp_"):]
    assert "manual" in diagnosis["earlier_text"] and "handbook" in diagnosis["current_text"]


def test_an_explicit_breakpoint_pins_the_prefix_up_to_it(client):
    manual = "The block manager hands out pages of sixteen tokens and takes them back. " * 12
    part = {"type": "input_text", "text": manual, "prompt_cache_breakpoint": {"mode": "explicit"}}
    ask = dict(model=MODEL, max_output_tokens=2, temperature=0, store=False)
    first = client.responses.create(**ask, input=[{"role": "user", "content": [
        part, {"type": "input_text", "text": "First question?"}]}])
    written = first.usage.input_tokens_details.cache_write_tokens
    assert written > 0
    second = client.responses.create(**ask, input=[{"role": "user", "content": [
        part, {"type": "input_text", "text": "Another question entirely?"}]}])
    # token-exact (not rounded to a block): the hit ends where the mark does
    assert second.usage.input_tokens_details.cached_tokens == written
    assert second.usage.input_tokens_details.cache_write_tokens == 0
