"""Counting tokens without generating: Anthropic's POST /v1/messages/count_tokens through the
official anthropic client, and vLLM's /tokenize and /detokenize. Oracles: the prompt tokens the
generation endpoints themselves report for the same body (input_tokens + cache reads + cache
writes on /v1/messages, prompt_tokens on the OpenAI endpoints), and the model's tokenizer loaded
on its own."""
from __future__ import annotations

import anthropic
import pytest
from live_server import ENGINE, MODEL
from tool_fixtures import ANTHROPIC_TOOLS, TOOLS

from prefixserve.tokenizer import load_tokenizer

SYSTEM = "You are a travel agent with tools. Answer in one sentence."
BODIES = [
    dict(messages=[{"role": "user", "content": "Hello"}]),
    dict(system=SYSTEM, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=ANTHROPIC_TOOLS),
    dict(system=[{"type": "text", "text": SYSTEM * 8, "cache_control": {"type": "ephemeral"}}],
         messages=[{"role": "user", "content": [{"type": "text", "text": "Paris?"}]}]),
    dict(system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather in Oslo for two days?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 C"}]}]),
]


@pytest.mark.parametrize("body", BODIES)
def test_count_tokens_is_what_messages_reports_as_its_prompt(claude, body):
    counted = claude.messages.count_tokens(model=MODEL, **body)
    sent = claude.messages.create(model=MODEL, max_tokens=1, **body)
    u = sent.usage
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_count_tokens_refuses_what_messages_refuses(claude, http):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.count_tokens(model=MODEL, messages=[])
    assert "messages" in str(bad.value)
    r = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                     "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert r.status_code == 400 and r.json()["type"] == "error" and "thinking" in r.json()["error"]["message"]
    r = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                     "tool_choice": {"type": "tool", "name": "nope"}})
    assert r.status_code == 400
    assert http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [
        {"role": "user", "content": "still serving"}]}).json()["input_tokens"] > 0


def test_tokenize_a_prompt_as_completions_would(http, client):
    tokenizer = load_tokenizer(MODEL)
    text = "The block manager keeps a pool of pages."
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == ENGINE["max_model_len"]
    assert "".join(r["token_strs"]) == tokenizer.decode(r["tokens"], skip_special_tokens=False)
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert r["count"] == completion.usage.prompt_tokens


def test_tokenize_messages_as_chat_completions_would(http, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Lima?"}]
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1)
    assert r["count"] == len(r["tokens"]) == chat.usage.prompt_tokens
    without_prompt = http.post("/tokenize", json={"messages": messages, "tools": TOOLS,
                                                  "add_generation_prompt": False}).json()
    assert without_prompt["tokens"] == r["tokens"][:without_prompt["count"]]
    assert without_prompt["count"] < r["count"]


def test_detokenize_inverts_tokenize(http):
    text = "Caches keep what was computed, <|im_end|> included."
    tokens = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json() == {"prompt": text}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/detokenize", {"tokens": [1, -4]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_token_requests_are_4xx_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, r.text
    assert http.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200
