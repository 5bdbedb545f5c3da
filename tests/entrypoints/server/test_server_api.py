"""The OpenAI-compatible server, end to end: a real uvicorn on a free loopback port.

Clients are the official `openai` package and raw httpx. Oracles: an offline
engine with prefix caching OFF on the same seeded weights (for texts), the KV
manager's own invariants (check_integrity, block counts) and the OpenAI wire
format the official client parses.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import openai
import pytest
from live_server import ENGINE, MODEL, LiveServer, assert_pool_idle, metrics
from waiting import wait_until

from prefixserve import LLM, EngineConfig, LLMEngine, SamplingParams
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.config import ServerConfig

LONG_PREFIX = ("You are a careful assistant for the prefixserve project. Answer briefly, cite the "
               "manual, and never invent commands. The manual covers installation, configuration, "
               "the block manager, prefix caching, eviction policies and the HTTP server. ") * 3


@pytest.fixture(scope="module")
def server():
    """max_waiting=1024, not the shared server's 64: a test here sends 200 requests at once."""
    app = build_app(LLMEngine(EngineConfig(**ENGINE)), ServerConfig(max_waiting=1024))
    with LiveServer(app) as live:
        yield live


@pytest.fixture(scope="module")
def oracle() -> LLM:
    """Same weights, prefix caching off: what every greedy answer must be."""
    return LLM(**{**ENGINE, "enable_prefix_caching": False})


def greedy(oracle: LLM, prompt, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return oracle.generate(prompt, params)[0].outputs[0].text


# ---------------------------------------------------------------- completions
def test_models_health_and_reset(http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == ENGINE["max_model_len"]
    assert http.get("/health").status_code == 200
    reset = http.post("/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["dropped_blocks"] >= 0


def test_completion_matches_offline_engine_and_reports_usage(client, oracle):
    prompt = "The block manager keeps"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == greedy(oracle, prompt, 12)
    assert r.choices[0].finish_reason == "length"
    expected_prompt = len(oracle.tokenizer.encode(prompt, add_special_tokens=True))
    assert r.usage.prompt_tokens == expected_prompt
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == expected_prompt + 12
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="Streaming text arrives", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunks[0].usage.prompt_tokens_details.cached_tokens >= 0


def test_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "raw events", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[len("data: "):])["object"] == "text_completion"


def test_batch_prompts_n_and_token_prompts(client, oracle):
    ids = oracle.tokenizer.encode("token ids in", add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], n=2,
                                  max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] == greedy(oracle, "first prompt", 5)
    assert by_index[2] == by_index[3] == greedy(oracle, "second prompt", 5)
    assert r.usage.completion_tokens == 20
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], n=2,
                                           max_tokens=5, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == by_index
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy(oracle, {"prompt_token_ids": ids}, 5)
    assert r.usage.prompt_tokens == len(ids)


def test_stop_seed_and_extras(client):
    base = client.completions.create(model=MODEL, prompt="Stop strings cut", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop and stop in text
    cut = client.completions.create(model=MODEL, prompt="Stop strings cut", max_tokens=24,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    seeded = [client.completions.create(
        model=MODEL, prompt="Seeded sampling", max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
        presence_penalty=0.5, frequency_penalty=0.1, user="tester",
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2,
                    "stop_token_ids": [], "priority": 3, "ignore_eos": True}).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Log probabilities", max_tokens=6,
                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0
        # Greedy picks the most likely token: nothing in the top list beats it.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)


# ----------------------------------------------------------------------- chat
def test_chat_string_and_text_parts_agree(client, oracle):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a KV block?"}]
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "What is a KV block?"}]}]
    a = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    b = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    ids = oracle.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert a.object == "chat.completion"
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content == greedy(oracle, {"prompt_token_ids": ids}, 10)
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == 10
    assert a.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_and_logprobs(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Stream a chat reply"}],
                  max_completion_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    content = whole.choices[0].logprobs.content
    assert len(content) == 8
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.logprob == pytest.approx(max(t.logprob for t in token.top_logprobs), abs=1e-5)


# -------------------------------------------------------------- prefix cache
def test_second_request_with_same_prefix_hits_cache(client, http, oracle):
    http.post("/reset_prefix_cache")
    before = metrics(http)
    prompts = [LONG_PREFIX + "Question one?", LONG_PREFIX + "Question two?"]
    first = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0)
    other = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n_prompt = first.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Whole blocks only, and never the last prompt token (its logits are needed).
    assert 0 < cached <= n_prompt - 1 and cached % ENGINE["block_size"] == 0
    assert cached > n_prompt - 1 - ENGINE["block_size"]
    assert other.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == first.choices[0].text
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert first.choices[0].text == oracle.generate(prompts[0], params)[0].outputs[0].text
    assert other.choices[0].text == oracle.generate(prompts[1], params)[0].outputs[0].text
    after = metrics(http)
    hits = after["prefixserve:prefix_cache_hits_total"] - before["prefixserve:prefix_cache_hits_total"]
    assert hits == cached + other.usage.prompt_tokens_details.cached_tokens
    queries = (after["prefixserve:prefix_cache_queries_total"]
               - before["prefixserve:prefix_cache_queries_total"])
    assert queries >= hits


def test_cache_salts_never_share(client, http):
    http.post("/reset_prefix_cache")
    prompt = LONG_PREFIX + "Salted question?"

    def cached(salt) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") > 0


# ------------------------------------------------------------------ bad input
BAD_COMPLETIONS = [
    ('{"model": "x", "prompt": ', None, "JSON"),
    ('["not", "an", "object"]', None, "object"),
    (json.dumps({"model": MODEL}), "prompt", "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}), "temperature", "temperature"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2.5}), "max_tokens", "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}), "stream", "stream"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}), "temperature", "temperature"),
    (json.dumps({"model": MODEL, "prompt": "hi", "top_p": 0}), "top_p", "top_p"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 0}), "n", "n"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}), "max_tokens", "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 99}), "logprobs", "logprobs"),
    (json.dumps({"model": MODEL, "prompt": ""}), "prompt", "empty"),
    (json.dumps({"model": MODEL, "prompt": []}), "prompt", "empty"),
    (json.dumps({"model": MODEL, "prompt": "hi", "cache_salt": ""}), "cache_salt", "cache_salt"),
    (json.dumps({"model": MODEL, "prompt": [10**9]}), "prompt", "token id"),
    (json.dumps({"model": MODEL, "prompt": "word " * 3000, "max_tokens": 4}), "prompt", "max_model_len"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5000}), "max_tokens", "max_model_len"),
]
BAD_CHATS = [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
      "top_logprobs": 50}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}, "stop"),
]


def assert_error_body(r: httpx.Response, status: int, param, mention: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert mention.lower() in err["message"].lower()


def test_bad_input_is_rejected_and_nothing_is_scheduled(server, http, client):
    before = server.in_engine(lambda e: e.stats())
    for body, param, mention in BAD_COMPLETIONS:
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert_error_body(r, 400, param, mention)
    for body, param in BAD_CHATS:
        assert_error_body(http.post("/v1/chat/completions", json=body), 400, param, param.split(".")[0])
    r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert_error_body(r, 404, "model", "gpt-4")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=7000)
    assert "temperature" in str(info.value)
    after = server.in_engine(lambda e: e.stats())
    assert (after.steps, after.prompt_tokens, after.requests_finished) == \
        (before.steps, before.prompt_tokens, before.requests_finished)
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices


# ---------------------------------------------------- disconnects and overload
def test_disconnect_mid_stream_aborts_and_frees_blocks(server, http):
    max_tokens = 1500
    before = server.in_engine(lambda e: e.stats())
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": LONG_PREFIX, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}) as r:
        assert r.status_code == 200
        received = 0
        for line in r.iter_lines():
            received += line.startswith("data: {")
            if received == 3:
                break
    # Closing the response drops the connection; the engine must drop the request.
    def released() -> bool:
        m = metrics(http)
        return m["prefixserve:num_requests_running"] == 0 and m["prefixserve:kv_blocks_in_use"] == 0

    wait_until(released, what="the disconnected request's blocks released")
    after = server.in_engine(lambda e: e.stats())
    # Had it run to completion it would have generated every one of its tokens.
    assert after.generated_tokens - before.generated_tokens < max_tokens
    assert_pool_idle(server)


def test_200_concurrent_requests_batch_and_leave_pool_free(server, http):
    before = server.in_engine(lambda e: e.stats())

    local = threading.local()
    clients: list[httpx.Client] = []

    def one(i: int) -> dict:
        # a client per thread: one httpx pool shared by 48 threads once failed a read with
        # EBADF (not reproducible in isolation); the server is what this test is about
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=server.base_url, timeout=60)
            clients.append(local.client)
        r = local.client.post("/v1/completions", json={
            "model": MODEL, "prompt": f"{LONG_PREFIX[:120]} request number {i}", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(max_workers=48) as pool:
        results = list(pool.map(one, range(200)))
    for c in clients:
        c.close()
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
    assert all(r["usage"]["completion_tokens"] == 4 for r in results)
    assert len({r["id"] for r in results}) == 200
    after = server.in_engine(lambda e: e.stats())
    # One request alone needs 4 steps; 200 served one by one would need 800.
    assert after.steps - before.steps < 800
    assert after.prefix_cache_hits > before.prefix_cache_hits
    assert_pool_idle(server)


def test_queue_bound_answers_429_with_retry_after():
    engine = LLMEngine(EngineConfig(**{**ENGINE, "max_num_seqs": 1, "num_kv_blocks": 256}))
    app = build_app(engine, ServerConfig(max_waiting=3, retry_after_s=3))
    with LiveServer(app) as live, httpx.Client(base_url=live.base_url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "occupy the engine", "max_tokens": 1800, "stream": True,
                "ignore_eos": True}
        streams = []
        try:
            # Three in flight (one runs, max_num_seqs=1, two wait): the bound is reached.
            for _ in range(3):
                s = http.stream("POST", "/v1/completions", json=body)
                r = s.__enter__()
                streams.append(s)
                assert r.status_code == 200
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert_error_body(r, 429, None, "max_waiting")
            assert r.headers["retry-after"] == "3"
            client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="one more", max_tokens=2)
        finally:
            for s in streams:
                s.__exit__(None, None, None)
        wait_until(lambda: not live.in_engine(lambda e: e.has_unfinished_requests()),
                   what="the disconnected requests aborted")
        assert_pool_idle(live)
        # With the queue drained the server takes work again.
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 2})
        assert r.status_code == 200


# -------------------------------------------------------------------- metrics
def test_metrics_exposition(server, client, http):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=3)
    # /metrics shows the stats the engine loop publishes after each step, and the answer can arrive
    # before the last step's are published: a call on the engine loop runs after that publication
    stats = server.in_engine(lambda engine: engine.stats())
    m = metrics(http)
    assert m["prefixserve:weights_bytes"] == stats.weights_bytes > 0
    assert m["prefixserve:kv_cache_bytes"] == stats.kv_cache_bytes > 0
    for name in ("prefixserve:prefix_cache_queries_total", "prefixserve:prefix_cache_hits_total",
                 "prefixserve:prompt_tokens_total", "prefixserve:generation_tokens_total",
                 "prefixserve:num_preemptions_total", "prefixserve:kv_evictions_total",
                 "prefixserve:num_requests_running", "prefixserve:num_requests_waiting",
                 "prefixserve:kv_blocks_in_use", "prefixserve:kv_blocks_cached",
                 "prefixserve:kv_blocks_free", "prefixserve:time_to_first_token_seconds_count",
                 "prefixserve:inter_token_latency_seconds_count",
                 "prefixserve:e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["prefixserve:generation_tokens_total"] >= 3
    assert m["prefixserve:time_to_first_token_seconds_count"] >= 1
    assert m["prefixserve:e2e_request_latency_seconds_count"] >= 1
    assert m["prefixserve:inter_token_latency_seconds_count"] >= 2
    assert (m["prefixserve:kv_blocks_in_use"] + m["prefixserve:kv_blocks_cached"]
            + m["prefixserve:kv_blocks_free"]) == ENGINE["num_kv_blocks"]


# ------------------------------------------------------------ engine failures
def fail_second_step(server: LiveServer) -> None:
    def install(engine):
        real_step, calls = engine.step, []

        def flaky_step():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected step failure")
            return real_step()
        engine.step = flaky_step
    server.in_engine(install)


def test_engine_failure_fails_the_request_and_the_server_keeps_serving(server, http, client):
    body = {"model": MODEL, "prompt": "doomed", "max_tokens": 20, "ignore_eos": True}
    try:
        fail_second_step(server)
        assert_error_body(http.post("/v1/completions", json=body), 500, None, "injected")
        fail_second_step(server)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert "injected" in json.loads(events[-2][len("data: "):])["error"]["message"]
        assert events[-1] == "data: [DONE]"
    finally:
        server.in_engine(lambda e: e.__dict__.pop("step", None))
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="recovered", max_tokens=3).choices
    assert_pool_idle(server)
