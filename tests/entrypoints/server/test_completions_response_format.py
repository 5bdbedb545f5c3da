"""response_format on POST /v1/completions, through the official openai client against a live
server on the random tiny model.

Random weights never write JSON by chance, so every parsable output here is the constraint's
doing. Oracles: json.loads and the schema itself (jsonschema_rs) for every choice, streamed or
not, n > 1 and several prompts included; the chat endpoint's 400 for the same bad value (one
parser serves both); the pool's invariants after every refusal.
"""
from __future__ import annotations

import json

import httpx
import jiter
import jsonschema_rs
import pytest

from live_server import MODEL, assert_pool_idle

SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 16},
    "score": {"type": "integer", "minimum": 0, "maximum": 9},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["answer", "score", "tags"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
PROMPT = "Answer in JSON: what is the capital of France?"


def test_json_schema_constrains_every_choice_of_every_prompt(client, server):
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Another question?"], n=3,
                                  max_tokens=300, temperature=1.0, seed=5,
                                  extra_body={"response_format": JSON_SCHEMA})
    assert sorted(c.index for c in r.choices) == list(range(6))
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(SCHEMA, json.loads(choice.text))
    assert len({c.text for c in r.choices}) > 1, "every sample draws its own output"
    assert_pool_idle(server)


def test_json_object_gives_a_json_object(client):
    finished = 0
    for seed in (4, 5):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300, temperature=1.0, n=2,
                                      seed=seed, extra_body={"response_format": {"type": "json_object"}})
        for choice in r.choices:
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.text), dict)
                finished += 1
            else:  # random weights fill a free-form object until max_tokens: still valid so far
                assert choice.finish_reason == "length"
                assert isinstance(jiter.from_json(choice.text.encode(), partial_mode="trailing-strings"), dict)
    assert finished >= 1


def test_text_is_unconstrained_and_the_same_as_no_response_format(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    text = client.completions.create(**kwargs, extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == plain


def test_streamed_choices_assemble_into_valid_json(client, server):
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=300,
                                           temperature=1.0, seed=11, stream=True,
                                           extra_body={"response_format": JSON_SCHEMA}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema_rs.validate(SCHEMA, json.loads(text))
    assert_pool_idle(server)


@pytest.mark.parametrize("response_format, param", [
    ({"type": "yaml"}, "response_format.type"),
    ({}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}},
     "response_format.json_schema.schema"),
    # llguidance cannot compile a lookbehind: refused before anything is queued
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}},
     "response_format"),
    ("json_object", "response_format"),
])
def test_bad_response_format_is_the_chat_endpoints_400_and_the_server_keeps_serving(
        server, client, response_format, param):
    answers = []
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
        r = httpx.post(server.base_url + path, timeout=60,
                       json={"model": MODEL, "max_tokens": 4, "response_format": response_format, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        answers.append(r.json()["error"]["message"])
    assert answers[0] == answers[1]
    assert_pool_idle(server)
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"
