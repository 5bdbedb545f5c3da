"""Explicit cache control end to end: the official `anthropic` and `openai` clients against a live
server on a small pool (256 blocks of 16 tokens) where a flood evicts whatever is not pinned.

Oracles: the KV manager itself (its live pins, evictions, integrity), the tokenizer (rendered
lengths), an offline engine with prefix caching off (greedy texts), and the rule that cache
usage adds up to the prompt's tokens.
"""
from __future__ import annotations

import json
import random
import time

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer

from prefixserve import LLM, EngineConfig, LLMEngine, SamplingParams
from prefixserve.entrypoints.cli import build_parser
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

MODEL = "random:qwen3-tiny"
BS = 16
ENGINE = dict(model=MODEL, seed=0, block_size=BS, num_kv_blocks=256, max_model_len=4096,
              max_pinned_fraction=0.5)
# "5m" -> 600 s, "1h" -> 7200 s of the engine's clock, which runs with the wall clock: a scale other
# than 1 shows the server applies it, and one above 1 keeps every pin alive however slowly a loaded
# machine runs a test (pins expire only when a test moves the clock on)
TTL_SCALE = 2.0
VOCAB = ("cache block prefix pin evict token request server engine model prompt memory pool "
         "hash chain scheduler batch decode prefill latency budget policy expiry").split()


class ShiftableClock:
    """Monotonic time plus an offset a test can push forward (to expire pins without sleeping)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def within(t: float, sent: float, answered: float) -> bool:
    """t (a wall-clock time the server stamped while it handled a request) lies between the request
    being sent and answered: bracketed by the request, not compared with a later reading of the
    clock, which a loaded machine can put any time after. The slack covers the server's rounding
    to milliseconds and its reading of two clocks (monotonic and wall) one after the other."""
    return sent - 0.5 <= t <= answered + 0.5


def document(seed: int, tokens: int, tokenizer) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words.extend(rng.choice(VOCAB) + rng.choice(["", "", ",", "."]) for _ in range(50))
    return f"Document {seed}: " + " ".join(words)


@pytest.fixture(scope="module")
def clock() -> ShiftableClock:
    return ShiftableClock()


@pytest.fixture(scope="module")
def server(clock):
    app = build_app(LLMEngine(EngineConfig(**ENGINE), clock=clock),
                    ServerConfig(max_waiting=1024, cache_ttl_scale=TTL_SCALE, trust_request_chat_template=True))
    with LiveServer(app) as live:
        yield live


@pytest.fixture(autouse=True)
def clean_cache(server):
    """Each test starts with no pins and nothing cached."""
    server.in_engine(lambda e: e.reset_prefix_cache())
    yield
    server.in_engine(lambda e: e.kv.check_integrity())


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.async_llm.tokenizer


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def live_pins(server) -> list:
    return server.in_engine(lambda e: e.kv.pins())


def usage_total(usage) -> int:
    """Uncached + read + written input tokens (each never negative)."""
    parts = (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens)
    assert min(parts) >= 0
    return sum(parts)


def chat_prompt_tokens(tokenizer, system: str, user: str) -> int:
    return len(tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": user}], tokenize=True))


@pytest.fixture()
def flooder(client, tokenizer):
    def flood(seed: int, n: int = 10, tokens: int = 400) -> None:
        """Unrelated prompts worth more than the pool: LRU alone would evict every older prefix."""
        for i in range(n):
            client.completions.create(model=MODEL, prompt=document(1000 * seed + i, tokens, tokenizer),
                                   max_tokens=1)
    return flood


def system_blocks(doc: str, ttl: str | None) -> list[dict]:
    block = {"type": "text", "text": doc}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return [block]


def ask(claude: anthropic.Anthropic, doc: str, question: str, ttl: str | None = "1h"):
    return claude.messages.create(model=MODEL, max_tokens=2, system=system_blocks(doc, ttl),
                                  messages=[{"role": "user", "content": question}])


# ------------------------------------------------------------------ the flood
def test_pinned_document_survives_a_flood_and_the_unpinned_one_is_evicted(server, claude, flooder,
                                                                           tokenizer):
    pinned_doc, plain_doc = document(1, 1950, tokenizer), document(2, 1950, tokenizer)
    first = ask(claude, pinned_doc, "Summarise the document.")
    plain = ask(claude, plain_doc, "Summarise the document.", ttl=None)
    (pin,) = live_pins(server)
    assert first.usage.cache_creation_input_tokens == pin.num_tokens >= 1900
    assert first.usage.cache_read_input_tokens == 0
    assert plain.usage.cache_creation_input_tokens == 0
    evictions = server.in_engine(lambda e: e.stats().evictions)
    flooder(1)
    assert server.in_engine(lambda e: e.stats().evictions) > evictions
    pinned_again = ask(claude, pinned_doc, "List three key terms.")
    plain_again = ask(claude, plain_doc, "List three key terms.", ttl=None)
    print(f"\nflood experiment: pinned doc {pin.num_tokens} pinned tokens -> "
          f"{pinned_again.usage.cache_read_input_tokens} hit tokens after the flood; unpinned doc -> "
          f"{plain_again.usage.cache_read_input_tokens} hit tokens")
    assert pinned_again.usage.cache_read_input_tokens == pin.num_tokens  # a full hit
    assert pinned_again.usage.cache_creation_input_tokens == 0
    assert plain_again.usage.cache_read_input_tokens == 0


def test_pin_expires_after_its_ttl_and_becomes_evictable(server, clock, client, flooder, tokenizer):
    doc = document(3, 1000, tokenizer)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": doc, "cache_control": {"type": "ephemeral", "ttl": "5m"}},
        {"type": "text", "text": "What is this about?"}]}]
    sent = time.time()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    (report,) = r.model_extra["prefixserve"]["cache_breakpoints"]
    assert report["ttl_seconds"] == 300 * TTL_SCALE and report["error"] is None
    assert within(report["expires_at"] - 300 * TTL_SCALE, sent, time.time())
    assert [p.num_tokens for p in live_pins(server)] == [report["pinned_tokens"]]
    clock.offset += 300 * TTL_SCALE + 1
    assert live_pins(server) == []
    flooder(2)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_a_hit_refreshes_the_pin_and_never_shortens_it(server, clock, claude, tokenizer):
    doc = document(4, 300, tokenizer)
    ask(claude, doc, "first")
    (long_pin,) = live_pins(server)
    clock.offset += 100
    ask(claude, doc, "second", ttl="5m")  # 5m would end before the 1h pin does
    (pin,) = live_pins(server)
    assert pin.pin_id == long_pin.pin_id and pin.expires_at == pytest.approx(long_pin.expires_at, abs=1e-3)
    ask(claude, doc, "third")  # a 1h hit refreshes: the expiry moves forward
    (refreshed,) = live_pins(server)
    assert refreshed.expires_at > long_pin.expires_at + 90


# ---------------------------------------------------------------------- usage
def test_usage_adds_up_on_both_endpoints_and_in_streams(server, client, claude, tokenizer):
    doc = document(5, 600, tokenizer)
    first = ask(claude, doc, "One")
    second = ask(claude, doc, "Two, a longer question this time")
    assert usage_total(first.usage) == chat_prompt_tokens(tokenizer, doc, "One")
    assert usage_total(second.usage) == chat_prompt_tokens(tokenizer, doc,
                                                           "Two, a longer question this time")
    (pin,) = live_pins(server)
    assert first.usage.cache_creation_input_tokens == pin.num_tokens and pin.num_tokens % BS == 0
    assert second.usage.cache_read_input_tokens >= pin.num_tokens
    assert second.usage.cache_creation_input_tokens == 0

    with claude.messages.stream(model=MODEL, max_tokens=3, system=system_blocks(doc, "1h"),
                                messages=[{"role": "user", "content": "Three"}]) as stream:
        streamed = stream.get_final_message()
    assert usage_total(streamed.usage) == chat_prompt_tokens(tokenizer, doc, "Three")
    assert streamed.usage.cache_read_input_tokens >= pin.num_tokens

    chat_messages = [{"role": "system", "content": [{"type": "text", "text": "(chat) " + doc,
                                                     "cache_control": {"type": "ephemeral"}}]},
                     {"role": "user", "content": "Four"}]
    r = client.chat.completions.create(model=MODEL, messages=chat_messages, max_tokens=2)
    details = r.usage.prompt_tokens_details
    (chat_pin,) = [p for p in live_pins(server) if p.pin_id != pin.pin_id]
    assert details.cache_write_tokens == chat_pin.num_tokens > 0
    assert details.cached_tokens + details.cache_write_tokens <= r.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat_messages, max_tokens=2,
                                              stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None][0]
    assert usage.prompt_tokens == r.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= details.cache_write_tokens
    assert usage.prompt_tokens_details.cache_write_tokens == 0


def test_tool_and_automatic_breakpoints(server, client, claude, tokenizer):
    tool = {"type": "function", "function": {"name": "search", "description": document(12, 300, tokenizer),
                                             "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Find it."}]
    r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages,
                                    tools=[{**tool, "cache_control": {"type": "ephemeral"}}])
    # The mark is taken off before rendering: the prompt is the one without it.
    assert r.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages, tools=[tool], tokenize=True))
    (pin,) = live_pins(server)
    assert r.usage.prompt_tokens_details.cache_write_tokens == pin.num_tokens >= 300
    assert r.model_extra["prefixserve"]["cache_breakpoints"][0]["where"] == "tools[0]"

    question = "Question: " + document(13, 200, tokenizer)
    m = claude.messages.create(model=MODEL, max_tokens=2, cache_control={"type": "ephemeral"},
                               messages=[{"role": "user", "content": question}])
    (auto_pin,) = [p for p in live_pins(server) if p.pin_id != pin.pin_id]
    assert m.usage.cache_creation_input_tokens == auto_pin.num_tokens
    # ChatML: the last block of the request ends right after the question's text.
    assert auto_pin.num_tokens == len(tokenizer.encode("<|im_start|>user\n" + question)) // BS * BS


def test_more_than_four_breakpoints_is_a_clear_400(server, client, claude, http):
    before = server.in_engine(lambda e: e.stats().prompt_tokens)
    blocks = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
              for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=2, system=blocks[:2],
                               messages=[{"role": "user", "content": blocks[2:]}])
    assert "at most 4" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                    messages=[{"role": "user", "content": blocks}])
    assert "at most 4" in str(info.value) and info.value.body["param"] == \
        "messages[0].content[4].cache_control"
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": r.json()["error"]["message"]}}
    assert "ephemeral" in r.json()["error"]["message"]
    assert server.in_engine(lambda e: e.stats().prompt_tokens) == before


def test_a_pin_beyond_the_cap_is_reported_not_dropped(server, claude, http, tokenizer):
    ask(claude, document(6, 1900, tokenizer), "fits")  # ~120 of the 128 pinnable blocks
    second = http.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 2, "system": system_blocks(document(7, 600, tokenizer), "1h"),
        "messages": [{"role": "user", "content": "does not fit"}]})
    assert second.status_code == 200
    (entry,) = second.json()["prefixserve"]["cache_breakpoints"]
    assert entry["pinned_tokens"] == 0 and "max_pinned_blocks" in entry["error"]
    assert "not pinned" in second.headers["prefixserve-cache-warning"]
    assert second.json()["usage"]["cache_creation_input_tokens"] == 0
    assert len(live_pins(server)) == 1


# ------------------------------------------------------------ cached contents
def test_cached_contents_lifecycle(server, http, client, claude, tokenizer):
    doc = document(8, 700, tokenizer)
    body = {"name": "manual", "system": doc, "ttl": "1h",
            "tools": [{"name": "lookup", "description": "Look a term up",
                       "input_schema": {"type": "object", "properties": {"term": {"type": "string"}}}}],
            "messages": [{"role": "user", "content": "Read the manual."},
                         {"role": "assistant", "content": "I have read it."}]}
    sent = time.time()
    created = http.post("/v1/cached_contents", json=body)
    assert created.status_code == 200, created.text
    assert within(created.json()["expire_time"] - 3600 * TTL_SCALE, sent, time.time())
    content = created.json()
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": doc}] + body["messages"], add_generation_prompt=False,
        tools=[{"type": "function", "function": {"name": "lookup", "description": "Look a term up",
                                                 "parameters": body["tools"][0]["input_schema"]}}],
        tokenize=True)
    aligned = len(rendered) // BS * BS
    assert content["usage"] == {"total_tokens": len(rendered), "cached_tokens": aligned}
    assert http.get(f"/v1/cached_contents/{content['id']}").json()["id"] == content["id"]
    assert http.get("/v1/cached_contents/manual").json()["id"] == content["id"]
    assert [c["id"] for c in http.get("/v1/cached_contents").json()["data"]] == [content["id"]]
    assert http.post("/v1/cached_contents", json=body).status_code == 409  # the name is taken

    sent = time.time()
    patched = http.patch("/v1/cached_contents/manual", json={"ttl": "10m"}).json()
    assert within(patched["expire_time"] - 600 * TTL_SCALE, sent, time.time())
    (pin,) = live_pins(server)
    assert pin.num_tokens == aligned

    r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Which tool would you use?"}], extra_body={"cached_content": "manual"})
    assert r.usage.prompt_tokens_details.cached_tokens == aligned
    m = claude.messages.create(model=MODEL, max_tokens=2, extra_body={"cached_content": content["id"]},
                               messages=[{"role": "user", "content": "And now?"}])
    assert m.usage.cache_read_input_tokens == aligned
    with pytest.raises(openai.BadRequestError, match="does not start with cached content"):
        client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
            extra_body={"cached_content": "manual",
                        "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"})
    with pytest.raises(anthropic.BadRequestError, match="system prompt from the cached content"):
        claude.messages.create(model=MODEL, max_tokens=2, system="another system",
                               extra_body={"cached_content": "manual"},
                               messages=[{"role": "user", "content": "x"}])

    deleted = http.delete("/v1/cached_contents/manual")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert live_pins(server) == []
    assert http.get(f"/v1/cached_contents/{content['id']}").status_code == 404
    assert http.get("/v1/cached_contents").json()["data"] == []
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                    extra_body={"cached_content": "manual"})


def test_cached_content_validation(http):
    assert http.post("/v1/cached_contents", json={"system": "too short", "ttl": "1h"}).status_code == 400
    r = http.post("/v1/cached_contents", json={"system": "x " * 100, "ttl": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl"
    assert http.patch("/v1/cached_contents/missing", json={"ttl": 60}).status_code == 404
    assert http.delete("/v1/cached_contents/missing").status_code == 404


# ---------------------------------------------------------- Messages endpoint
@pytest.fixture(scope="module")
def oracle() -> LLM:
    return LLM(**{**ENGINE, "enable_prefix_caching": False})


def test_messages_match_the_offline_engine_and_stream_the_same(claude, oracle):
    kwargs = dict(model=MODEL, max_tokens=12, extra_body={"temperature": 0.0}, system="You are terse.",
                  messages=[{"role": "user", "content": "Name a colour."},
                            {"role": "assistant", "content": "Blue."},
                            {"role": "user", "content": [{"type": "text", "text": "Another one?"}]}])
    m = claude.messages.create(**kwargs)
    prompt = oracle.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
        tokenize=True)
    expected = oracle.generate({"prompt_token_ids": prompt},
                               SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.content[0].type == "text" and m.content[0].text == expected.text
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert m.usage.output_tokens == len(expected.token_ids)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)

    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens


def test_messages_stream_event_sequence(http):
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Stream please."}]}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    deltas = names[3:-3]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and deltas
    assert set(deltas) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(d["delta"]["type"] == "text_delta" for d in datas if d["type"] == "content_block_delta")
    usage = datas[-2]["usage"]
    assert usage["output_tokens"] == 6 or datas[-2]["delta"]["stop_reason"] == "end_turn"


def test_messages_stop_sequences_and_errors(server, claude, http):
    kwargs = dict(model=MODEL, max_tokens=24, extra_body={"temperature": 0.0},
                  messages=[{"role": "user", "content": "Count for me."}])
    text = claude.messages.create(**kwargs).content[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    cut = claude.messages.create(**kwargs, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(**{**kwargs, "model": "claude-opus"})
    r = http.post("/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "max_tokens" in r.json()["error"]["message"]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and "messages[0].content[0].source" in r.json()["error"]["message"]
    # a well-formed picture, to a model that takes none
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]})
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]


# --------------------------------------------------------- eviction priority
@pytest.mark.parametrize("policy", ["priority", "lru"])
def test_priority_reaches_the_priority_eviction_policy(tokenizer, policy):
    engine = LLMEngine(EngineConfig(**{**ENGINE, "eviction_policy": policy}))
    with LiveServer(build_app(engine)) as live, \
            openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0) as client:
        def chat(doc: str, priority: int):
            return client.chat.completions.create(model=MODEL, max_tokens=1, extra_body={"priority": priority},
                                               messages=[{"role": "user", "content": doc}])
        important, ordinary = document(10, 1200, tokenizer), document(11, 1200, tokenizer)
        chat(important, 10)
        chat(ordinary, 0)
        for i in range(8):  # low-priority traffic worth more than the free pool
            chat(document(100 + i, 400, tokenizer), 0)
        assert live.in_engine(lambda e: e.stats().evictions) > 0
        important_hit = chat(important, 10).usage.prompt_tokens_details.cached_tokens
        if policy == "priority":
            assert important_hit >= 1200 // BS * BS
        else:  # LRU evicts the older document first, whatever its priority
            assert important_hit == 0
        assert chat(ordinary, 0).usage.prompt_tokens_details.cached_tokens == 0


def test_serve_options():
    args = build_parser().parse_args(["serve", "--cache-ttl-scale", "0.01", "--max-pinned-fraction",
                                      "0.25", "--eviction-policy", "priority"])
    assert (args.cache_ttl_scale, args.max_pinned_fraction, args.eviction_policy) == (0.01, 0.25, "priority")
    with pytest.raises(ValueError, match="cache_ttl_scale"):
        ServerConfig(cache_ttl_scale=0)
